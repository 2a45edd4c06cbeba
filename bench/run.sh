#!/bin/sh
# Runs Warren's side-by-side benchmark: builds the release binaries, installs
# the peers (bubblewrap, runc, crun) when missing, and writes
# bench/results/<YYYY-MM-DD>.md. Needs root (cgroups, namespaces, runc).
#
# Usage: bench/run.sh [--quick] [any other warren-bench flag]
#   --quick   small sample counts and short windows, for a smoke run
#
# Everything the benchmark makes (the Warren server, sandboxes, containers,
# cgroups, mounts, temp dirs) is removed when it ends, also on error or
# Ctrl-C. A run killed outright leaves only names carrying its pid, which
# the `--sweep` below (and the start of every run) removes.
set -eu

cd "$(dirname "$0")/.."

missing=""
command -v bwrap >/dev/null 2>&1 || missing="$missing bubblewrap"
command -v runc >/dev/null 2>&1 || missing="$missing runc"
command -v crun >/dev/null 2>&1 || missing="$missing crun"
if [ -n "$missing" ]; then
    echo "run.sh: installing$missing" >&2
    apt-get update -qq
    # shellcheck disable=SC2086 # one word per package
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing
fi

cargo build --release --workspace --bins

bench=target/release/warren-bench
trap '"$bench" --sweep || true' EXIT

has_out=no
for arg in "$@"; do
    case "$arg" in --out|--out=*) has_out=yes ;; esac
done
if [ "$has_out" = yes ]; then
    "$bench" "$@"
else
    "$bench" --out "bench/results/$(date +%F).md" "$@"
fi
