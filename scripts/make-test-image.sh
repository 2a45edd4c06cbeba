#!/bin/sh
# Builds a tiny busybox rootfs for tests into DIR (created if missing).
#
# Usage: make-test-image.sh DIR
#
# The result has /bin/busybox with applet symlinks, /bin/sh, the usual empty
# mount points, a root-only /etc/passwd and /etc/group, and /tmp mode 1777.
# Takes a few milliseconds; safe to re-run on the same DIR.
set -eu

die() { echo "make-test-image: $*" >&2; exit 1; }

[ $# -eq 1 ] || die "usage: $0 DIR"
DIR=${1%/}
[ -n "$DIR" ] || die "DIR must not be /"

if [ ! -x /bin/busybox ]; then
    echo "make-test-image: installing busybox-static" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq busybox-static
fi
# A dynamic busybox would need the host's libc inside the image.
if command -v file >/dev/null 2>&1 && ! file -L /bin/busybox | grep -q 'statically linked'; then
    die "/bin/busybox is not statically linked; install busybox-static"
fi

mkdir -p "$DIR/bin" "$DIR/proc" "$DIR/sys" "$DIR/dev" "$DIR/etc" "$DIR/root" "$DIR/tmp"
cp -f /bin/busybox "$DIR/bin/busybox"
chmod 0755 "$DIR/bin/busybox"
# --install -s links each applet to the path busybox was started as, so run
# it chrooted: the links then say /bin/busybox and resolve inside the
# sandbox's root rather than to this host path. Without root, link one by one
# (slower: a fork per applet).
if [ "$(id -u)" -eq 0 ] && command -v chroot >/dev/null 2>&1; then
    chroot "$DIR" /bin/busybox --install -s /bin
else
    for applet in $("$DIR/bin/busybox" --list); do
        [ "$applet" = busybox ] || ln -sfn busybox "$DIR/bin/$applet"
    done
fi
ln -sfn busybox "$DIR/bin/sh"

chmod 0555 "$DIR/proc" "$DIR/sys"
chmod 0755 "$DIR/dev" "$DIR/etc"
chmod 0700 "$DIR/root"
chmod 1777 "$DIR/tmp"

printf 'root:x:0:0:root:/root:/bin/sh\n' >"$DIR/etc/passwd"
printf 'root:x:0:\n' >"$DIR/etc/group"
chmod 0644 "$DIR/etc/passwd" "$DIR/etc/group"
