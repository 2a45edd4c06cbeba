#!/bin/sh
# Cold boot to first exec of a full VM (`backend: "vm"`: QEMU q35, the
# image's systemd as PID 1, warren-init as its service) beside a microVM
# (`backend: "microvm"`: QEMU -M microvm, warren-init as PID 1) on the same
# image, kernel and guest size, over Warren's HTTP API, and writes
# bench/results/<YYYY-MM-DD>-vm-boot.md.
#
# Usage: bench/vm-boot.sh [SAMPLES]      (default 5 per backend; needs root)
#
# One sample: POST /v1/sandboxes (returns once the guest's agent answered a
# ping: the boot), POST .../exec?wait=true {"argv":["true"]} (the first
# exec), DELETE. The two backends take turns sample by sample, so both see
# the same background load. One unrecorded sample per backend first: it
# builds the driver's initramfs and the image's EROFS layer disk, which
# later creates reuse. The server runs with WARREN_MICROVM_ACCEL=tcg, so no
# create pays for the KVM probe (this host's KVM cannot run the guest).
# The image is Debian bookworm minbase + systemd-sysv + procps (the vm
# tests' image, built and cached by scripts/make-default-image.sh).
set -eu

cd "$(dirname "$0")/.."
SAMPLES=${1:-5}
BIN=${WARREN_BIN:-$PWD/target/debug/warren}
ROOTFS=/var/cache/warren/vm-systemd-rootfs
MEMORY_MIB=512
OUT=bench/results/$(date -u +%Y-%m-%d)-vm-boot.md

[ "$(id -u)" -eq 0 ] || { echo "vm-boot.sh: needs root" >&2; exit 1; }
[ -x "$BIN" ] || { echo "vm-boot.sh: no $BIN (cargo build -p warren -p warren-init)" >&2; exit 1; }
WARREN_IMAGE_PACKAGES=systemd-sysv,procps scripts/make-default-image.sh "$ROOTFS" >&2

DATA=$(mktemp -d /tmp/warren-vm-boot.XXXXXX)
INSTANCE=wb-vm-$$
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

WARREN_MICROVM_ACCEL=tcg "$BIN" serve --data-dir "$DATA" --listen 127.0.0.1:0 --instance "$INSTANCE" \
    >"$DATA.log" 2>&1 &
SERVER=$!
i=0
while [ ! -s "$DATA/server.url" ]; do
    i=$((i + 1))
    [ $i -lt 300 ] || { echo "vm-boot.sh: the server did not start:" >&2; cat "$DATA.log" >&2; exit 1; }
    kill -0 "$SERVER" 2>/dev/null || { echo "vm-boot.sh: the server died:" >&2; cat "$DATA.log" >&2; exit 1; }
    sleep 0.1
done
URL=$(cat "$DATA/server.url")
curl -sf "$URL/v1/images" -d "{\"name\": \"systemd\", \"dir\": \"$ROOTFS\"}" >/dev/null

now_ms() { echo $(($(date +%s%N) / 1000000)); }

# Prints "<backend> <create ms> <first exec ms>".
sample() {
    backend=$1
    t0=$(now_ms)
    info=$(curl -sf "$URL/v1/sandboxes" \
        -d "{\"image\": \"systemd\", \"backend\": \"$backend\", \"memory_mib\": $MEMORY_MIB, \"cpus\": 1, \"disk_mib\": 256}") || {
        echo "vm-boot.sh: $backend create failed:" >&2
        tail -n 20 "$DATA.log" >&2
        exit 1
    }
    t1=$(now_ms)
    id=$(echo "$info" | jq -r .id)
    code=$(curl -sf "$URL/v1/sandboxes/$id/exec?wait=true" -d '{"argv": ["true"]}' | jq -r .exit_code)
    t2=$(now_ms)
    [ "$code" = 0 ] || { echo "vm-boot.sh: exec true in $backend answered $code" >&2; exit 1; }
    curl -sf -X DELETE "$URL/v1/sandboxes/$id" >/dev/null
    echo "$backend $((t1 - t0)) $((t2 - t1))"
}

echo "vm-boot.sh: warm-up (initramfs and layer disk per driver)" >&2
sample microvm >/dev/null
sample vm >/dev/null
: >"$SAMPLES_FILE"
n=1
while [ $n -le "$SAMPLES" ]; do
    for backend in microvm vm; do
        s=$(sample $backend)
        echo "vm-boot.sh: sample $n: $s" >&2
        echo "$s" >>"$SAMPLES_FILE"
    done
    n=$((n + 1))
done

# Median (nearest rank), min and max of column $2 (+ $3 when total) per backend.
stats() {
    backend=$1 what=$2
    awk -v b="$backend" -v w="$what" '$1 == b { v = (w == "create") ? $2 : (w == "exec") ? $3 : $2 + $3; print v }' \
        "$SAMPLES_FILE" | sort -n | awk '{ a[NR] = $1 } END { m = int((NR + 1) / 2); printf "%d / %d / %d", a[m], a[1], a[NR] }'
}

{
    echo "# Full VM vs microVM: cold boot to first exec ($(date -u +%Y-%m-%d))"
    echo
    echo "- machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)," \
        "$(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo), host kernel $(uname -r)"
    echo "- $(qemu-system-x86_64 --version | head -n 1), accelerator tcg (this host's KVM is paravirtual and cannot run the guest)"
    echo "- guest kernel: $(basename "$(ls /boot/vmlinuz-*-cloud-amd64 | sort | tail -n 1)"), $MEMORY_MIB MiB, 1 vCPU, 256 MiB writable disk"
    echo "- image: $ROOTFS (Debian bookworm minbase + systemd-sysv + procps, $(du -sh "$ROOTFS" | cut -f1))"
    echo "- binaries: $BIN and the warren-init beside it (debug builds; the guest runs that warren-init)"
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ); command: \`bench/vm-boot.sh $SAMPLES\`; load at the start: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo
    echo "$SAMPLES samples per backend, taken in turns; median / min / max in ms."
    echo
    echo "| backend | create (boot to the agent's answer) | first exec \`true\` | create + first exec |"
    echo "|---|---|---|---|"
    for backend in microvm vm; do
        echo "| \`$backend\` | $(stats $backend create) | $(stats $backend exec) | $(stats $backend total) |"
    done
    echo
    echo "What the full VM adds: SeaBIOS and the q35 machine's devices, then"
    echo "systemd's boot up to \`basic.target\` (journald, tmpfiles, sysusers,"
    echo "the unit graph), after which it starts the agent's service (the rest"
    echo "of the boot runs on beside the first exec); the kernel, initramfs and"
    echo "layer stacking are the microVM's."
} >"$OUT"
echo "vm-boot.sh: wrote $OUT" >&2
cat "$OUT"
