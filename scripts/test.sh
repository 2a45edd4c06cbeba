#!/usr/bin/env bash
# The whole test suite: installs what it needs, builds, lints, tests.
# Runs as root (namespaces, mounts, cgroups are real).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup-host.sh
export PATH="$HOME/.cargo/bin:$PATH"
export CARGO_TERM_COLOR=never
cargo fmt --all -- --check
# A real S3-compatible server for the blob-store tests (built from crates.io once).
crates/warren-image/scripts/s3-server.sh install
cargo build --workspace --all-targets --locked
cargo clippy --workspace --all-targets --locked -- -D warnings
# The default image (cached after the first build): the function backend's
# python/C/C++ test runs in it.
scripts/make-default-image.sh /var/cache/warren/default-rootfs
cargo test --workspace --locked --no-fail-fast -- --test-threads=2
# The Python SDK against the `warren` just built. PIP_BREAK_SYSTEM_PACKAGES:
# Debian's own python3 refuses pip installs without it (PEP 668).
python3 -m pip --version >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq python3-pip >/dev/null; }
PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    ./python pytest pytest-asyncio playwright
WARREN_BIN="$PWD/target/debug/warren" python3 -m pytest -q -rs python/tests
# The dashboard in headless Chromium (the system one, from setup-host.sh).
WARREN_BIN="$PWD/target/debug/warren" python3 -m pytest -q -rs tests/browser
# The official `e2b` SDK (newest 2.x and one before 2.51), each in its own venv.
WARREN_BIN="$PWD/target/debug/warren" python/e2b_tests/run.sh
