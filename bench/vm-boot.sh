#!/bin/sh
# Cold boot to first exec of a full VM (`backend: "vm"`: QEMU q35, the
# image's systemd as PID 1, warren-init as its service) beside a microVM
# (`backend: "microvm"`: QEMU -M microvm, warren-init as PID 1) on the same
# image, kernel and guest size, over Warren's HTTP API; beside them a
# microVM and a full VM restored from a snapshot (a second server with
# `--vm-snapshots on`) and three bare QEMU -M microvm boots of the same
# kernel, QEMU start to exit: one of the driver's initramfs told
# `warren.probe` (warren-init powers the VM off as soon as it runs) and
# two of a trivial init (a 9 KiB initramfs of a static program that only
# powers the VM off): with the kernel's own boot (only the timing flags
# without which it does not boot well under TCG: issue 6's comparison),
# and with the kernel command line the driver gives its guests (which
# skips boot work no guest uses: the floor for Warren's own share); writes
# bench/results/<YYYY-MM-DD>-vm-boot.md.
#
# Usage: bench/vm-boot.sh [--no-full-vm] [SAMPLES]   (default 5 per backend; needs root)
#   --no-full-vm    skip the full VM (`vm`, cold and snapshot): microVM and bare only
#   VM_BOOT_OUT=f   write the results to f instead of bench/results/<date>-vm-boot.md
#
# It measures the release binaries (target/release/warren and the
# warren-init beside it, which the guest runs as its init): a debug
# warren-init under TCG is several times slower than what ships. Build them
# first: cargo build --release -p warren -p warren-init (or point WARREN_BIN
# at another build).
#
# One sample: POST /v1/sandboxes (returns once the guest's agent answered a
# ping: the boot), POST .../exec?wait=true {"argv":["true"]} (the first
# exec), DELETE; before the DELETE it reads how long the sandbox's CPU cap
# (its cgroup's `cpu.stat`) throttled QEMU, which the bare QEMU does not
# run under (see "CPU caps" in the results). The two backends take turns sample by sample, so both see
# the same background load. One unrecorded sample per backend first: it
# builds the driver's initramfs and the image's EROFS layer disk, which
# later creates reuse. The server runs with WARREN_MICROVM_ACCEL=tcg, so no
# create pays for the KVM probe (this host's KVM cannot run the guest).
# The image is Debian bookworm minbase + systemd-sysv + procps (the vm
# tests' image, built and cached by scripts/make-default-image.sh).
set -eu

cd "$(dirname "$0")/.."
FULL_VM=1
if [ "${1:-}" = --no-full-vm ]; then FULL_VM=0; shift; fi
SAMPLES=${1:-5}
BIN=${WARREN_BIN:-$PWD/target/release/warren}
ROOTFS=/var/cache/warren/vm-systemd-rootfs
MEMORY_MIB=512
OUT=${VM_BOOT_OUT:-bench/results/$(date -u +%Y-%m-%d)-vm-boot.md}
LABELS="microvm vm snapshot vmsnapshot bare trivial trimmed"
SNAP_LABELS="snapshot vmsnapshot"
if [ $FULL_VM = 0 ]; then LABELS="microvm snapshot bare trivial trimmed" SNAP_LABELS=snapshot; fi

[ "$(id -u)" -eq 0 ] || { echo "vm-boot.sh: needs root" >&2; exit 1; }
[ -x "$BIN" ] || { echo "vm-boot.sh: no $BIN (cargo build --release -p warren -p warren-init)" >&2; exit 1; }
[ -x "$(dirname "$BIN")/warren-init" ] || { echo "vm-boot.sh: no warren-init beside $BIN" >&2; exit 1; }
for tool in cc cpio; do
    command -v $tool >/dev/null || { echo "vm-boot.sh: needs $tool (for the trivial init)" >&2; exit 1; }
done
WARREN_IMAGE_PACKAGES=systemd-sysv,procps scripts/make-default-image.sh "$ROOTFS" >&2

DATA=$(mktemp -d /tmp/warren-vm-boot.XXXXXX)
SNAP_DATA=$(mktemp -d /tmp/warren-vm-snap.XXXXXX)
INSTANCE=wb-vm-$$
SAMPLES_FILE=$DATA.samples
# The kernel command line the driver gave its first guest (see `sample`).
APPEND_FILE=$DATA.append
TRIVIAL=$DATA.trivial
SERVER=""
SNAP_SERVER=""
URL=""
SNAP_URL=""

stop_server() { # <pid> <url>
    if [ -n "$2" ]; then
        for id in $(curl -sf "$2/v1/sandboxes" | jq -r '.sandboxes[] | select(.state != "ended") | .id'); do
            curl -sf -X DELETE "$2/v1/sandboxes/$id" >/dev/null || true
        done
    fi
    if [ -n "$1" ]; then
        kill -TERM "$1" 2>/dev/null || true
        wait "$1" 2>/dev/null || true
    fi
}

cleanup() {
    stop_server "$SERVER" "$URL"
    stop_server "$SNAP_SERVER" "$SNAP_URL"
    rm -rf "$DATA" "$SNAP_DATA" "$SAMPLES_FILE" "$APPEND_FILE" "$DATA.log" "$SNAP_DATA.log" "$TRIVIAL"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Waits for the server <pid> on <data dir> and imports the image; prints its URL.
server_url() {
    i=0
    while [ ! -s "$2/server.url" ]; do
        i=$((i + 1))
        [ $i -lt 300 ] || { echo "vm-boot.sh: the server did not start:" >&2; cat "$2.log" >&2; exit 1; }
        kill -0 "$1" 2>/dev/null || { echo "vm-boot.sh: the server died:" >&2; cat "$2.log" >&2; exit 1; }
        sleep 0.1
    done
    url=$(cat "$2/server.url")
    curl -sf "$url/v1/images" -d "{\"name\": \"systemd\", \"dir\": \"$ROOTFS\"}" >/dev/null
    echo "$url"
}

WARREN_MICROVM_ACCEL=tcg "$BIN" serve --data-dir "$DATA" --listen 127.0.0.1:0 --instance "$INSTANCE" \
    >"$DATA.log" 2>&1 &
SERVER=$!
URL=$(server_url "$SERVER" "$DATA")
WARREN_MICROVM_ACCEL=tcg "$BIN" serve --data-dir "$SNAP_DATA" --listen 127.0.0.1:0 --instance "$INSTANCE-s" \
    --vm-snapshots on >"$SNAP_DATA.log" 2>&1 &
SNAP_SERVER=$!
SNAP_URL=$(server_url "$SNAP_SERVER" "$SNAP_DATA")

now_ms() { echo $(($(date +%s%N) / 1000000)); }

# Prints "<label> <create ms> <first exec ms> <boot>". Labels `snapshot`
# and `vmsnapshot` are a microVM and a full-VM create on the server with
# snapshots on.
sample() {
    label=$1
    backend=$label url=$URL log=$DATA.log
    if [ "$label" = snapshot ]; then backend=microvm url=$SNAP_URL log=$SNAP_DATA.log; fi
    if [ "$label" = vmsnapshot ]; then backend=vm url=$SNAP_URL log=$SNAP_DATA.log; fi
    t0=$(now_ms)
    info=$(curl -sf "$url/v1/sandboxes" \
        -d "{\"image\": \"systemd\", \"backend\": \"$backend\", \"memory_mib\": $MEMORY_MIB, \"cpus\": 1, \"disk_mib\": 256}") || {
        echo "vm-boot.sh: $label create failed:" >&2
        tail -n 20 "$log" >&2
        exit 1
    }
    t1=$(now_ms)
    id=$(echo "$info" | jq -r .id)
    code=$(curl -sf "$url/v1/sandboxes/$id/exec?wait=true" -d '{"argv": ["true"]}' | jq -r .exit_code)
    t2=$(now_ms)
    [ "$code" = 0 ] || { echo "vm-boot.sh: exec true in $label answered $code" >&2; exit 1; }
    instance=$INSTANCE
    [ "$url" = "$URL" ] || instance=$INSTANCE-s
    [ "$backend" = microvm ] && instance=$instance-vm || instance=$instance-fullvm
    throttled=$(throttled_ms "$instance/$id")
    [ -s "$APPEND_FILE" ] || [ "$label" != microvm ] || guest_append "$instance/$id" >"$APPEND_FILE"
    curl -sf -X DELETE "$url/v1/sandboxes/$id" >/dev/null
    echo "$label $((t1 - t0)) $((t2 - t1)) $(echo "$info" | jq -r '.boot // "-"') $throttled"
}

# The kernel command line of the QEMU in the sandbox cgroup <instance>/<id>
# without what only that sandbox is told (its `warren.*` words).
guest_append() {
    for procs in /sys/fs/cgroup/cpu/$1/cgroup.procs /sys/fs/cgroup/$1/cgroup.procs; do
        [ -f "$procs" ] || continue
        for pid in $(cat "$procs"); do
            tr '\0' '\n' <"/proc/$pid/cmdline" | awk 'found { print; exit } $0 == "-append" { found = 1 }' |
                tr ' ' '\n' | grep -v '^warren\.' | tr '\n' ' '
            return
        done
    done
}

# How long the CPU cap of the sandbox's cgroup <instance>/<id> (its `cpus`:
# the QEMU process, vCPU and emulation threads together) held QEMU back so
# far, in ms; "-" if the cgroup cannot be read.
throttled_ms() {
    if [ -f "/sys/fs/cgroup/cpu/$1/cpu.stat" ]; then
        awk '$1 == "throttled_time" { printf "%d", $2 / 1000000 }' "/sys/fs/cgroup/cpu/$1/cpu.stat"
    elif [ -f "/sys/fs/cgroup/$1/cpu.stat" ]; then
        awk '$1 == "throttled_usec" { printf "%d", $2 / 1000 }' "/sys/fs/cgroup/$1/cpu.stat"
    else
        echo -
    fi
}

# The trivial init: powers the VM off (reboot(2) with
# LINUX_REBOOT_CMD_POWER_OFF) and nothing else; without libc, so the
# initramfs is one 9 KiB file.
mkdir -p "$TRIVIAL/root"
cat >"$TRIVIAL/init.c" <<'EOF'
void _start(void) {
    long ret;
    __asm__ volatile("syscall" : "=a"(ret) : "a"(169), "D"(0xfee1dead), "S"(672274793), "d"(0x4321fedc)
                     : "rcx", "r11", "memory");
    for (;;) __asm__ volatile("syscall" : "=a"(ret) : "a"(34) : "rcx", "r11", "memory");
}
EOF
cc -static -nostdlib -Os -s -o "$TRIVIAL/root/init" "$TRIVIAL/init.c"
(cd "$TRIVIAL/root" && echo init | cpio --quiet -o -H newc) >"$TRIVIAL/initramfs.cpio"

# QEMU -M microvm with the driver's kernel, booting <label>'s initramfs:
# `bare` the driver's (its init told to power off at once), `trivial` and
# `trimmed` the trivial init's; prints "<label> <ms> 0 cold". `trivial`'s
# kernel line has only the timing flags the driver gives (the host's TSC
# rate, read from /proc/cpuinfo here), `bare`'s and `trimmed`'s the
# driver's whole line (from its first guest's QEMU).
KERNEL=$(ls /boot/vmlinuz-*-cloud-amd64 | sort -V | tail -n 1)
TSC_KHZ=$(awk '/cpu MHz/ {printf "%d", $4 * 1000; exit}' /proc/cpuinfo)
bare() {
    initrd=$DATA/vm/.initramfs.cpio
    [ "$1" = bare ] || initrd=$TRIVIAL/initramfs.cpio
    append="console=ttyS0 quiet panic=-1 tsc=reliable no_timer_check tsc_early_khz=$TSC_KHZ lpj=$((TSC_KHZ * 4))"
    [ "$1" = trivial ] || append=$(cat "$APPEND_FILE")
    # The same kernel as the driver boots: the vmlinux it unpacked from
    # $KERNEL (PVH entry, no decompression in the guest) when it did.
    kernel=$KERNEL
    [ -f "$DATA/vm/.vmlinux" ] && kernel=$DATA/vm/.vmlinux
    t0=$(now_ms)
    qemu-system-x86_64 -M microvm,pit=off,pic=off,rtc=on,isa-serial=on -accel tcg,tb-size=64 -cpu max,cx16=off \
        -m $MEMORY_MIB -smp 1 -nodefaults -no-user-config -display none -no-reboot \
        -kernel "$kernel" -initrd "$initrd" \
        -append "$append warren.probe" \
        >/dev/null 2>&1 </dev/null || { echo "vm-boot.sh: the $1 QEMU boot failed" >&2; exit 1; }
    t1=$(now_ms)
    echo "$1 $((t1 - t0)) 0 cold -"
}

LOAD_AT_START=$(cut -d' ' -f1-3 /proc/loadavg)
echo "vm-boot.sh: warm-up (initramfs and layer disk per driver; the snapshot)" >&2
sample microvm >/dev/null
[ -s "$APPEND_FILE" ] || { echo "vm-boot.sh: could not read the guest's kernel command line" >&2; exit 1; }
[ $FULL_VM = 0 ] || sample vm >/dev/null
# The first create of the shape boots and starts the snapshot's build.
for label in $SNAP_LABELS; do
    i=0
    until [ "$(sample $label | cut -d' ' -f4)" = snapshot ]; do
        i=$((i + 1))
        [ $i -lt 60 ] || { echo "vm-boot.sh: no $label restore after 60 creates" >&2; tail -n 20 "$SNAP_DATA.log" >&2; exit 1; }
        sleep 2
    done
done
: >"$SAMPLES_FILE"
n=1
while [ $n -le "$SAMPLES" ]; do
    for label in $LABELS; do
        case $label in
        bare | trivial | trimmed) s=$(bare "$label") ;;
        *) s=$(sample "$label") ;;
        esac
        echo "vm-boot.sh: sample $n: $s" >&2
        if [ "${label%snapshot}" != "$label" ] && [ "$(echo "$s" | cut -d' ' -f4)" != snapshot ]; then
            echo "vm-boot.sh: a create on the snapshot server booted cold:" >&2
            grep -i -A3 'snapshot' "$SNAP_DATA.log" | tail -n 20 >&2
            exit 1
        fi
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

# The lowest and highest ratio of a turn's microVM cold boot to first exec
# to the same turn's bare boot <label> (the samples file holds the turns
# in order, one line per backend and turn).
turn_ratios() {
    awk -v b="$1" '$1 == "microvm" { c[++nc] = $2 + $3 } $1 == b { r[++nb] = $2 }
        END { for (i = 1; i <= nc && i <= nb; i++) { x = c[i] / r[i]; if (i == 1 || x < lo) lo = x; if (i == 1 || x > hi) hi = x }
              printf "%.2f-%.2fx", lo, hi }' "$SAMPLES_FILE"
}

{
    echo "# VM boot to first exec: full VM and microVM cold and from a snapshot, bare QEMU ($(date -u +%Y-%m-%d))"
    echo
    echo "- machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)," \
        "$(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo), host kernel $(uname -r)"
    echo "- $(qemu-system-x86_64 --version | head -n 1), accelerator tcg (this host's KVM is paravirtual and cannot run the guest)"
    echo "- guest kernel: $(basename "$KERNEL") (booted as the vmlinux the driver unpacks from it, PVH entry: Warren and both bare boots alike), $MEMORY_MIB MiB, 1 vCPU, 256 MiB writable disk"
    echo "- image: $ROOTFS (Debian bookworm minbase + systemd-sysv + procps, $(du -sh "$ROOTFS" | cut -f1))"
    echo "- binaries: $BIN and the warren-init beside it ($(basename "$(dirname "$BIN")") build; the guest runs that warren-init)"
    flag=""; [ $FULL_VM = 1 ] || flag="--no-full-vm "
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ); command: \`bench/vm-boot.sh $flag$SAMPLES\`; load at the start: $LOAD_AT_START"
    echo
    echo "$SAMPLES samples per backend, taken in turns; median / min / max in ms."
    echo
    echo "| backend | create (boot to the agent's answer) | first exec \`true\` | create + first exec |"
    echo "|---|---|---|---|"
    echo "| \`microvm\` | $(stats microvm create) | $(stats microvm exec) | $(stats microvm total) |"
    [ $FULL_VM = 0 ] || echo "| \`vm\` | $(stats vm create) | $(stats vm exec) | $(stats vm total) |"
    echo "| \`microvm\` restored from a snapshot (\`--vm-snapshots on\`) | $(stats snapshot create) | $(stats snapshot exec) | $(stats snapshot total) |"
    [ $FULL_VM = 0 ] || echo "| \`vm\` restored from a snapshot (\`--vm-snapshots on\`) | $(stats vmsnapshot create) | $(stats vmsnapshot exec) | $(stats vmsnapshot total) |"
    echo "| bare \`qemu -M microvm\`, same kernel and initramfs, init powers off at once (QEMU start to exit) | $(stats bare create) | - | $(stats bare total) |"
    echo "| bare \`qemu -M microvm\`, same kernel, a trivial init (9 KiB initramfs) that powers off (QEMU start to exit) | $(stats trivial create) | - | $(stats trivial total) |"
    echo "| the same trivial init, the kernel command line Warren gives its guests | $(stats trimmed create) | - | $(stats trimmed total) |"
    echo
    cold=$(stats microvm total | cut -d' ' -f1)
    snap=$(stats snapshot total | cut -d' ' -f1)
    bare=$(stats bare total | cut -d' ' -f1)
    trivial=$(stats trivial total | cut -d' ' -f1)
    trimmed=$(stats trimmed total | cut -d' ' -f1)
    full=""
    if [ $FULL_VM = 1 ]; then
        vmcold=$(stats vm total | cut -d' ' -f1)
        vmsnap=$(stats vmsnapshot total | cut -d' ' -f1)
        full=" full VM $(awk -v s="$vmsnap" -v c="$vmcold" 'BEGIN { printf "%.2f", s / c }')x;"
    fi
    echo "Medians: snapshot restore to first exec / cold boot to first exec =" \
        "$(awk -v s="$snap" -v c="$cold" 'BEGIN { printf "%.2f", s / c }')x (target <= 0.2x),$full" \
        "cold boot to first exec / bare boot of a trivial init = $(awk -v c="$cold" -v b="$trivial" 'BEGIN { printf "%.2f", c / b }')x" \
        "(target <= 1.1x; per turn $(turn_ratios trivial)), / bare boot of the same initramfs =" \
        "$(awk -v c="$cold" -v b="$bare" 'BEGIN { printf "%.2f", c / b }')x (per turn $(turn_ratios bare))," \
        "/ trivial init with Warren's kernel command line (Warren's own share) =" \
        "$(awk -v c="$cold" -v b="$trimmed" 'BEGIN { printf "%.2f", c / b }')x (per turn $(turn_ratios trimmed))."
    echo
    echo "Warren's kernel command line, as its guests get it (without each"
    echo "sandbox's own \`warren.*\` words): \`$(cat "$APPEND_FILE")\`"
    echo
    if [ $FULL_VM = 1 ]; then
        echo "What the full VM adds: SeaBIOS and the q35 machine's devices, then"
        echo "systemd's boot up to \`basic.target\` (journald, tmpfiles, sysusers,"
        echo "the unit graph), after which it starts the agent's service (the rest"
        echo "of the boot runs on beside the first exec); the kernel, initramfs and"
        echo "layer stacking are the microVM's."
        echo
    else
        echo "The full VM was not measured in this run (\`--no-full-vm\`)."
        echo
    fi
    echo "CPU caps: a sandbox's QEMU (vCPU and emulation threads together) runs in"
    echo "its cgroup capped at the sandbox's \`cpus\` (1 CPU here), the bare QEMU"
    echo "uncapped. The cap is what a sandbox pays for and stays; what it cost"
    echo "here, per cold \`microvm\` sample (ms the cgroup was throttled, from its"
    echo "\`cpu.stat\`): $(awk '$1 == "microvm" { printf "%s%s", sep, $5; sep = ", " }' "$SAMPLES_FILE")."
    echo "A trivial bare boot never uses more than one CPU in a period (throttled"
    echo "0 ms in a cgroup with the same cap, tried by hand on 2026-12-04), so"
    echo "capping it too would"
    echo "change nothing."
    echo
    echo "A snapshot restore: a sparse copy of the snapshot's writable disk, QEMU"
    echo "loading the stopped guest's migration stream (\`-incoming fd:3\`), the"
    echo "mux, \`cont\`, then init's \`Identify\` (hostname, entropy and CRNG reseed,"
    echo "clock). The bare boot is the floor a cold boot cannot go below: the"
    echo "kernel and init's start, without disks, modules or the agent; the"
    echo "trivial init's is the same without unpacking warren-init and the"
    echo "modules (issue 6's comparison), with the kernel's own boot or with"
    echo "the boot work Warren's command line skips left out (what is left to"
    echo "Warren's own machinery)."
} >"$OUT"
echo "vm-boot.sh: wrote $OUT" >&2
cat "$OUT"
