#!/usr/bin/env bash
# Runs the E2B compatibility suite against the `warren` just built, once with
# each SDK version below, each in its own virtualenv (so the official `e2b`
# package never meets ours). Needs root (real sandboxes) and PyPI.
#
# Usage: python/e2b_tests/run.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/../.."
# The newest 2.x, and one from before 2.51 (which still creates with
# `POST /sandboxes` and connects with `POST /sandboxes/{id}/connect`).
VERSIONS=${WARREN_E2B_VERSIONS:-"2.63.0 2.50.0"}
VENVS=${WARREN_E2B_VENVS:-$PWD/target/e2b-venvs}
export WARREN_BIN=${WARREN_BIN:-$PWD/target/debug/warren}
python3 -c 'import venv, ensurepip' 2>/dev/null ||
    { apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null; }
for v in $VERSIONS; do
    venv="$VENVS/e2b-$v"
    if ! "$venv/bin/python" -c "import e2b, pytest, pytest_asyncio" 2>/dev/null; then
        python3 -m venv "$venv"
        "$venv/bin/pip" install --quiet --disable-pip-version-check "e2b==$v" pytest pytest-asyncio
    fi
    echo "== e2b $v"
    "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider python/e2b_tests "$@"
done
