#!/bin/sh
# Builds Warren's default image: a Debian bookworm rootfs with python3,
# pytest, git and a C and C++ toolchain, into DIR.
#
# Usage: make-default-image.sh DIR
#
# WARREN_IMAGE_PACKAGES replaces the package list (the full-VM tests build
# their systemd image with it: systemd-sysv,procps).
#
# Cached: if DIR/.warren-complete exists, nothing is done. The rootfs is built
# in DIR.tmp and renamed into place only when complete, so an interrupted run
# never leaves a DIR that looks finished. The mirror is the one apt uses on
# this host (first URIs:/deb line that is not a security mirror), else
# http://deb.debian.org/debian.
set -eu

SUITE=bookworm
PACKAGES=${WARREN_IMAGE_PACKAGES:-python3,python3-pytest,git,gcc,g++,libc6-dev,ca-certificates,procps}
DEFAULT_MIRROR=http://deb.debian.org/debian

die() { echo "make-default-image: $*" >&2; exit 1; }

[ $# -eq 1 ] || die "usage: $0 DIR"
[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap needs it)"
DIR=${1%/}
[ -n "$DIR" ] || die "DIR must not be /"
TMP=$DIR.tmp

if [ -e "$DIR/.warren-complete" ]; then
    echo "make-default-image: $DIR is complete, nothing to do"
    exit 0
fi

# Prints the host's Debian mirror. deb822 .sources first, then one-line lists.
host_mirror() {
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -r "$f" ] || continue
        awk 'tolower($1) == "uris:" { for (i = 2; i <= NF; i++) print $i }' "$f"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -r "$f" ] || continue
        # "deb [opts] URI suite comp..." - the URI is the first field after
        # "deb" that is not an [option] block.
        awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i !~ /\]$/) { print $i; break } }' "$f"
    done
}

MIRROR=$(host_mirror | grep -v -e security -e '^cdrom:' | grep -E '^(https?|file)://' | head -n 1 || true)
MIRROR=${MIRROR:-$DEFAULT_MIRROR}

if ! command -v debootstrap >/dev/null 2>&1; then
    echo "make-default-image: installing debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap
fi

# A crashed earlier run can leave proc/sys/dev mounted inside TMP; unmount
# them (deepest first) before deleting so rm never walks into host trees.
unmount_below() {
    findmnt -rn -o TARGET | awk -v p="$1/" 'index($0, p) == 1' | sort -r | while read -r m; do
        umount -l "$m" || true
    done
}

mkdir -p "$(dirname "$DIR")"
exec 9>"$DIR.lock"
flock 9
# Another run may have finished while we waited for the lock.
if [ -e "$DIR/.warren-complete" ]; then
    exit 0
fi

cleanup() {
    unmount_below "$TMP"
    rm -rf --one-file-system "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
cleanup

echo "make-default-image: debootstrap $SUITE from $MIRROR into $TMP"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$TMP" "$MIRROR"
unmount_below "$TMP"

# Images are built once and copied many times: drop what only apt needs.
rm -rf "$TMP"/var/cache/apt/archives/*.deb "$TMP"/var/cache/apt/*.bin "$TMP"/var/lib/apt/lists/*
mkdir -p "$TMP/var/lib/apt/lists/partial"
rm -rf "$TMP"/var/log/* "$TMP"/tmp/* "$TMP"/var/tmp/*
# The build host's identity must not leak into every sandbox.
printf 'warren\n' >"$TMP/etc/hostname"
: >"$TMP/etc/resolv.conf"

date -u +%Y-%m-%dT%H:%M:%SZ >"$TMP/.warren-complete"
sync -f "$TMP/.warren-complete"

# DIR may be a stale incomplete tree from an older layout: move it aside first.
if [ -e "$DIR" ]; then
    unmount_below "$DIR"
    rm -rf --one-file-system "$DIR"
fi
mv "$TMP" "$DIR"
trap - EXIT
echo "make-default-image: done: $DIR ($(du -sh "$DIR" | cut -f1))"
