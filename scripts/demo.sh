#!/usr/bin/env bash
# Builds Warren, makes the default image (once, cached), starts the embedded
# server and runs a sample agent-style rollout against it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup-host.sh
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release --workspace --bins --locked
ROOTFS=${WARREN_DEFAULT_ROOTFS:-/var/cache/warren/default-rootfs}
scripts/make-default-image.sh "$ROOTFS"
DATA=${WARREN_DATA_DIR:-/var/lib/warren}
mkdir -p "$DATA"
rm -f "$DATA/server.url"
target/release/warren serve --data-dir "$DATA" --listen 127.0.0.1:0 --destroy-on-exit &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do [ -s "$DATA/server.url" ] && break; kill -0 $SERVER || exit 1; sleep 0.1; done
export WARREN_URL=$(cat "$DATA/server.url")
if ! target/release/warren image ls | grep -q '^default '; then
    target/release/warren image import-dir default "$ROOTFS"
fi
python3 examples/rollout.py
