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
cargo test --workspace --locked -- --test-threads=2
