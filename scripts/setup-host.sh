#!/usr/bin/env bash
# Installs what Warren needs on a fresh Debian 12 machine (idempotent).
set -euo pipefail
need=()
for pkg_bin in busybox-static:/bin/busybox debootstrap:/usr/sbin/debootstrap tar:/bin/tar \
    erofs-utils:/usr/bin/mkfs.erofs docker-registry:/usr/bin/docker-registry; do
    pkg=${pkg_bin%%:*}; bin=${pkg_bin#*:}
    [ -x "$bin" ] || need+=("$pkg")
done
# warren-net: clang builds the eBPF programs against libbpf's and the
# kernel's headers, libbpf-sys builds libbpf (libelf, zlib, pkg-config,
# make); nft installs the NAT table; the network tests use ip and gcc -static.
for pkg_file in clang:/usr/bin/clang libbpf-dev:/usr/include/bpf/bpf_helpers.h \
    linux-libc-dev:/usr/include/linux/bpf.h libelf-dev:/usr/include/libelf.h zlib1g-dev:/usr/include/zlib.h \
    pkg-config:/usr/bin/pkg-config make:/usr/bin/make nftables:/usr/sbin/nft iproute2:/usr/sbin/ip \
    gcc:/usr/bin/gcc libc6-dev:/usr/lib/x86_64-linux-gnu/libc.a; do
    pkg=${pkg_file%%:*}; file=${pkg_file#*:}
    [ -e "$file" ] || need+=("$pkg")
done
# The adversarial suite: a real XFS image (mkfs.xfs, loop mount), the
# kernel log (dmesg) and the host's addresses (hostname -I).
for pkg_file in xfsprogs:/usr/sbin/mkfs.xfs mount:/usr/bin/mount util-linux:/usr/bin/dmesg hostname:/usr/bin/hostname; do
    pkg=${pkg_file%%:*}; file=${pkg_file#*:}
    [ -e "$file" ] || need+=("$pkg")
done
# The dashboard's browser test (tests/browser) drives Debian's Chromium
# through Python playwright, which downloads no browser of its own.
[ -x /usr/bin/chromium ] || need+=(chromium)
# The E2B suite makes a virtualenv per SDK version (python/e2b_tests/run.sh).
python3 -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
# The benchmark's peers: its own tests (part of the suite) drive them.
for pkg_bin in bubblewrap:/usr/bin/bwrap runc:/usr/sbin/runc crun:/usr/bin/crun; do
    pkg=${pkg_bin%%:*}; bin=${pkg_bin#*:}
    [ -x "$bin" ] || need+=("$pkg")
done
# The microvm backend: QEMU, a Debian cloud kernel (its modules go into
# the guest's initramfs) and mkfs.ext4 for the writable disk.
# The driver unpacks the kernel's vmlinux (zstd in 6.12, lz4 in 6.1) and
# xz-compressed modules once on the host.
for pkg_file in qemu-system-x86:/usr/bin/qemu-system-x86_64 e2fsprogs:/usr/sbin/mkfs.ext4 zstd:/usr/bin/zstd \
    lz4:/usr/bin/lz4 xz-utils:/usr/bin/xz; do
    pkg=${pkg_file%%:*}; file=${pkg_file#*:}
    [ -e "$file" ] || need+=("$pkg")
done
# The guest kernel must be 6.12 or newer: its Landlock (ABI 6) is what a
# microVM's phases with protected paths need. Debian 12 has it in
# bookworm-backports (a Debian suite; nothing else is fetched).
guest_kernel_ok() {
    local k newest
    newest=$(for k in /boot/vmlinuz-*-cloud-amd64; do [ -e "$k" ] && basename "$k" | sed 's/^vmlinuz-//'; done | sort -V | tail -n 1 || true)
    [ -n "$newest" ] && [ "$(printf '%s\n6.12\n' "$newest" | sort -V | head -n 1)" = 6.12 ]
}
# shellcheck disable=SC1091
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
backports=
use_backports() {
    [ -e /etc/apt/sources.list.d/warren-backports.sources ] || printf '%s\n' 'Types: deb' \
        'URIs: http://deb.debian.org/debian' 'Suites: bookworm-backports' 'Components: main' \
        'Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg' >/etc/apt/sources.list.d/warren-backports.sources
    backports=bookworm-backports
}
# Packages apt must take from bookworm-backports, in one install of their own.
from_backports=()
if ! guest_kernel_ok; then
    if [ "$codename" = bookworm ]; then
        use_backports
        from_backports+=(linux-image-cloud-amd64)
    else
        need+=(linux-image-cloud-amd64)
    fi
fi
# QEMU's packages must share one version: a host whose qemu-utils came from
# bookworm-backports (some machine images ship it) cannot take bookworm's
# qemu-system-x86 beside it (qemu-utils Breaks the older qemu-system-common).
if [[ " ${need[*]} " == *" qemu-system-x86 "* && "$codename" = bookworm ]] &&
    dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null | grep -q 'bpo'; then
    use_backports
    from_backports+=(qemu-system-x86)
    for i in "${!need[@]}"; do [ "${need[$i]}" = qemu-system-x86 ] && unset 'need[i]'; done
    need=("${need[@]}")
fi
# The cluster state store: warren-store-etcd's build compiles etcd's protos
# (protoc), and its tests start real etcd members (Debian's etcd-server).
for pkg_file in protobuf-compiler:/usr/bin/protoc etcd-server:/usr/bin/etcd; do
    pkg=${pkg_file%%:*}; file=${pkg_file#*:}
    [ -e "$file" ] || need+=("$pkg")
done
if [ "${WARREN_BENCH:-0}" = 1 ]; then
    [ -x /usr/bin/hyperfine ] || need+=(hyperfine)
fi
if [ ${#need[@]} -gt 0 ] || [ ${#from_backports[@]} -gt 0 ]; then
    echo "setup: installing ${need[*]} ${backports:+${from_backports[*]} from $backports}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # docker-registry's package would start a registry on :5000; the tests
    # start their own per test on loopback. Mask its unit for systemd, and
    # deny service starts for the install where no policy exists yet.
    # etcd-server's package likewise starts a member on :2379; the tests run
    # their own clusters on free loopback ports.
    if [[ " ${need[*]} " == *" docker-registry "* || " ${need[*]} " == *" etcd-server "* ]]; then
        mkdir -p /etc/systemd/system
        [ -e /etc/systemd/system/docker-registry.service ] || ln -s /dev/null /etc/systemd/system/docker-registry.service
        [ -e /etc/systemd/system/etcd.service ] || ln -s /dev/null /etc/systemd/system/etcd.service
        if [ ! -e /usr/sbin/policy-rc.d ]; then
            printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
            warren_policy_rc=1
        fi
    fi
    if [ ${#need[@]} -gt 0 ]; then apt-get install -y -qq "${need[@]}" >/dev/null; fi
    if [ ${#from_backports[@]} -gt 0 ]; then
        apt-get install -y -qq -t "$backports" "${from_backports[@]}" >/dev/null
    fi
    if [ "${warren_policy_rc:-0}" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
fi
if ! command -v cargo >/dev/null; then
    if [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    else
        echo "setup: no Rust toolchain found (cargo); install rustup's stable toolchain" >&2
        exit 1
    fi
fi
