#!/usr/bin/env bash
# Installs what Warren needs on a fresh Debian 12 machine (idempotent).
set -euo pipefail
need=()
for pkg_bin in busybox-static:/bin/busybox debootstrap:/usr/sbin/debootstrap tar:/bin/tar; do
    pkg=${pkg_bin%%:*}; bin=${pkg_bin#*:}
    [ -x "$bin" ] || need+=("$pkg")
done
if [ "${WARREN_BENCH:-0}" = 1 ]; then
    for pkg_bin in bubblewrap:/usr/bin/bwrap runc:/usr/sbin/runc crun:/usr/bin/crun hyperfine:/usr/bin/hyperfine; do
        pkg=${pkg_bin%%:*}; bin=${pkg_bin#*:}
        [ -x "$bin" ] || need+=("$pkg")
    done
fi
if [ ${#need[@]} -gt 0 ]; then
    echo "setup: installing ${need[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null; then
    if [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    else
        echo "setup: no Rust toolchain found (cargo); install rustup's stable toolchain" >&2
        exit 1
    fi
fi
