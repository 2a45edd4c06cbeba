#!/bin/sh
# Pause to disk and restore of a full VM (`backend: "vm"`, q35 + systemd)
# and a microVM (`backend: "microvm"`) of the same image and size, over
# Warren's HTTP API, beside the in-memory pause (QMP stop/cont), and writes
# bench/results/<YYYY-MM-DD>-vm-pause-disk.md.
#
# Usage: bench/vm-pause-disk.sh [SAMPLES]   (default 5 per backend; needs root)
#
# One sample on a booted VM (one per backend for the whole run, with a
# 64 MiB tmpfs file written first so the guest has touched memory to save):
# POST .../pause?to_disk=true (guest -> paused.mem, QEMU exits), the size of
# paused.mem, POST .../resume (QEMU loads the file, a new mux, Identify with
# the host's time), POST .../exec?wait=true {"argv":["true"]}; then the same
# with a plain pause and resume. The backends take turns sample by sample.
# The server runs with WARREN_MICROVM_ACCEL=tcg (this host's KVM cannot run
# the guest). The image is the vm tests' (Debian bookworm minbase +
# systemd-sysv + procps, built and cached by scripts/make-default-image.sh).
set -eu

cd "$(dirname "$0")/.."
SAMPLES=${1:-5}
BIN=${WARREN_BIN:-$PWD/target/debug/warren}
ROOTFS=/var/cache/warren/vm-systemd-rootfs
MEMORY_MIB=512
OUT=bench/results/$(date -u +%Y-%m-%d)-vm-pause-disk.md

[ "$(id -u)" -eq 0 ] || { echo "vm-pause-disk.sh: needs root" >&2; exit 1; }
[ -x "$BIN" ] || { echo "vm-pause-disk.sh: no $BIN (cargo build -p warren -p warren-init)" >&2; exit 1; }
WARREN_IMAGE_PACKAGES=systemd-sysv,procps scripts/make-default-image.sh "$ROOTFS" >&2

DATA=$(mktemp -d /tmp/warren-vm-pause.XXXXXX)
SAMPLES_FILE=$DATA.samples
SERVER=""
URL=""

cleanup() {
    if [ -n "$URL" ]; then
        for id in $(curl -sf "$URL/v1/sandboxes" | jq -r '.sandboxes[] | select(.state != "ended") | .id'); do
            curl -sf -X DELETE "$URL/v1/sandboxes/$id" >/dev/null || true
        done
    fi
    if [ -n "$SERVER" ]; then
        kill -TERM "$SERVER" 2>/dev/null || true
        wait "$SERVER" 2>/dev/null || true
    fi
    rm -rf "$DATA" "$SAMPLES_FILE" "$DATA.log"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

WARREN_MICROVM_ACCEL=tcg "$BIN" serve --data-dir "$DATA" --listen 127.0.0.1:0 --instance "wb-pause-$$" \
    >"$DATA.log" 2>&1 &
SERVER=$!
i=0
while [ ! -s "$DATA/server.url" ]; do
    i=$((i + 1))
    [ $i -lt 300 ] || { echo "vm-pause-disk.sh: the server did not start:" >&2; cat "$DATA.log" >&2; exit 1; }
    sleep 0.1
done
URL=$(cat "$DATA/server.url")
curl -sf "$URL/v1/images" -d "{\"name\": \"systemd\", \"dir\": \"$ROOTFS\"}" >/dev/null

now_ms() { echo $(($(date +%s%N) / 1000000)); }

post() { # <path> [<json body>]; fails loudly
    body=${2:-'{}'}
    curl -sf -X POST "$URL$1" -H 'content-type: application/json' -d "$body" || {
        echo "vm-pause-disk.sh: POST $1 failed" >&2
        tail -n 20 "$DATA.log" >&2
        exit 1
    }
}

create() { # <backend> -> id
    info=$(post /v1/sandboxes "{\"image\": \"systemd\", \"backend\": \"$1\", \"memory_mib\": $MEMORY_MIB, \"cpus\": 1, \"disk_mib\": 256}")
    id=$(echo "$info" | jq -r .id)
    post "/v1/sandboxes/$id/exec?wait=true" '{"argv": ["sh", "-c", "head -c 67108864 /dev/urandom >/dev/shm/fill"]}' >/dev/null
    echo "$id"
}

MICROVM=$(create microvm)
VM=$(create vm)

# Prints "<backend> <pause to disk ms> <paused.mem MiB> <restore ms> <exec ms> <pause ms> <resume ms>".
sample() {
    backend=$1 id=$2
    dir=$DATA/vm
    [ "$backend" = vm ] && dir=$DATA/fullvm
    t0=$(now_ms)
    post "/v1/sandboxes/$id/pause?to_disk=true" >/dev/null
    t1=$(now_ms)
    mem=$(($(stat -c %s "$dir/$id/paused.mem") / 1048576))
    post "/v1/sandboxes/$id/resume" >/dev/null
    t2=$(now_ms)
    code=$(post "/v1/sandboxes/$id/exec?wait=true" '{"argv": ["true"]}' | jq -r .exit_code)
    t3=$(now_ms)
    [ "$code" = 0 ] || { echo "vm-pause-disk.sh: exec true in $backend answered $code" >&2; exit 1; }
    post "/v1/sandboxes/$id/pause" >/dev/null
    t4=$(now_ms)
    post "/v1/sandboxes/$id/resume" >/dev/null
    t5=$(now_ms)
    echo "$backend $((t1 - t0)) $mem $((t2 - t1)) $((t3 - t2)) $((t4 - t3)) $((t5 - t4))"
}

: >"$SAMPLES_FILE"
n=1
while [ $n -le "$SAMPLES" ]; do
    for backend in microvm vm; do
        if [ $backend = vm ]; then s=$(sample vm "$VM"); else s=$(sample microvm "$MICROVM"); fi
        echo "vm-pause-disk.sh: sample $n: $s" >&2
        echo "$s" >>"$SAMPLES_FILE"
    done
    n=$((n + 1))
done

# Median (nearest rank), min and max of column <n> for <backend>.
stats() {
    awk -v b="$1" -v c="$2" '$1 == b { print $c }' "$SAMPLES_FILE" | sort -n |
        awk '{ a[NR] = $1 } END { m = int((NR + 1) / 2); printf "%d / %d / %d", a[m], a[1], a[NR] }'
}

{
    echo "# VM pause to disk and restore: full VM and microVM ($(date -u +%Y-%m-%d))"
    echo
    echo "- machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)," \
        "$(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo), host kernel $(uname -r)"
    echo "- $(qemu-system-x86_64 --version | head -n 1), accelerator tcg (this host's KVM is paravirtual and cannot run the guest)"
    echo "- guest kernel: $(basename "$(ls /boot/vmlinuz-*-cloud-amd64 | sort -V | tail -n 1)"), $MEMORY_MIB MiB, 1 vCPU, 256 MiB writable disk, 64 MiB written to /dev/shm"
    echo "- image: $ROOTFS (Debian bookworm minbase + systemd-sysv + procps)"
    echo "- binaries: $BIN and the warren-init beside it (debug builds)"
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ); command: \`bench/vm-pause-disk.sh $SAMPLES\`; load at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo
    echo "$SAMPLES samples per backend on one VM each, taken in turns; median / min / max in ms."
    echo
    echo "| backend | pause to disk | \`paused.mem\` (MiB) | resume from disk | first exec after | pause (in memory) | resume (in memory) |"
    echo "|---|---|---|---|---|---|---|"
    for backend in microvm vm; do
        echo "| \`$backend\` | $(stats $backend 2) | $(stats $backend 3) | $(stats $backend 4) | $(stats $backend 5) | $(stats $backend 6) | $(stats $backend 7) |"
    done
    echo
    echo "Pause to disk: the mux is dropped (the guest's agent ends its streams),"
    echo "a 200 ms quiesce, QMP \`stop\`, \`migrate fd:\` into \`paused.mem\` (the"
    echo "guest's touched pages and device state), \`fsync\`, QEMU killed and"
    echo "reaped. Resume from disk: QEMU started with \`-incoming fd:3\` on the"
    echo "file, the load, \`cont\`, \`Identify\` (the host's time and fresh entropy)"
    echo "straight over the port, then a new mux."
} >"$OUT"
echo "vm-pause-disk.sh: wrote $OUT" >&2
cat "$OUT"
