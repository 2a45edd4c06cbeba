#!/usr/bin/env bash
# A real S3-compatible server for the blob-store tests: s3s-fs, built from
# crates.io into <workspace>/target/tools (no internet beyond crates.io).
#
#   s3-server.sh install          build s3s-fs once (skipped when present)
#   s3-server.sh path             print the binary the tests use
#   s3-server.sh run DIR [PORT]   serve DIR (bucket = a subdirectory) on
#                                 127.0.0.1:PORT (default: OS-chosen)
#
# The tests find the binary through $WARREN_S3S_FS, then target/tools/bin,
# then $PATH. s3s-fs 0.14.1 is the newest release that builds with rustc
# 1.95 (0.17 needs 1.96).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
workspace="$(cd "$here/../../.." && pwd)"
root="$workspace/target/tools"
bin="$root/bin/s3s-fs"
version="0.14.1"

case "${1:-}" in
install)
    if [[ -x "$bin" ]]; then
        echo "s3s-fs already at $bin"
        exit 0
    fi
    cargo install s3s-fs --version "$version" --locked --features binary --root "$root"
    ;;
path)
    echo "$bin"
    ;;
run)
    dir="${2:?usage: $0 run DIR [PORT]}"
    port="${3:-0}"
    RUST_LOG="${RUST_LOG:-info}" exec "$bin" --host 127.0.0.1 --port "$port" \
        --access-key warren --secret-key warren-secret "$dir"
    ;;
*)
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
