#!/bin/sh
# The lazy-loading benchmark: builds (or reuses) the >= 1 GB three-layer
# image, then measures cold / warm-node / hot starts, the eager baseline
# and plain local directories over a netem-shaped veth to the blob store,
# and writes bench/results/<date>-lazy-<rate>.md.
#
# Usage (root): bench/lazy/run.sh [--release] [--rate 1gbit] [--delay 1ms] [--chunk-size-bytes N]
#                                 [--piece-size-bytes N] [--readahead-kb N] [--warm-readahead-kb N] [--no-complete-after-use] [--fetched-only]
#                                 [--no-trace] [--warm-pairs N]
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
[ "$(id -u)" -eq 0 ] || { echo "run.sh: must run as root" >&2; exit 1; }

rate=1gbit
delay=1ms
chunk=
extra=
tag=
profile=debug
while [ $# -gt 0 ]; do
    case $1 in
        --rate) rate=$2; shift 2 ;;
        --delay) delay=$2; shift 2 ;;
        --chunk-size-bytes) chunk=$2; shift 2 ;;
        --piece-size-bytes) extra="$extra --piece-size-bytes $2"; tag="$tag-piece$2"; shift 2 ;;
        --readahead-kb) extra="$extra --readahead-kb $2"; tag="$tag-ra$2"; shift 2 ;;
        --warm-readahead-kb) extra="$extra --warm-readahead-kb $2"; tag="$tag-wra$2"; shift 2 ;;
        --fetched-only) extra="$extra --fetched-only"; tag="$tag-fetched"; shift ;;
        --no-trace) extra="$extra --no-trace"; shift ;;
        --no-complete-after-use) extra="$extra --no-complete-after-use"; tag="$tag-lazy"; shift ;;
        --warm-pairs) extra="$extra --warm-pairs $2"; shift 2 ;;
        --release) profile=release; shift ;;
        *) echo "usage: $0 [--release] [--rate R] [--delay D] [--chunk-size-bytes N] [--piece-size-bytes N] [--readahead-kb N] [--warm-readahead-kb N] [--no-complete-after-use] [--fetched-only] [--no-trace] [--warm-pairs N]" >&2; exit 2 ;;
    esac
done

cd "$ROOT"
if [ "$profile" = release ]; then
    cargo build --release -p warren -p warren-init
else
    cargo build -p warren -p warren-init
fi
export WARREN_BIN="${WARREN_BIN:-$ROOT/target/$profile/warren}"
[ -x target/tools/bin/s3s-fs ] || crates/warren-image/scripts/s3-server.sh install
"$HERE/build-image.sh"
out="bench/results/$(date -u +%Y-%m-%d)-lazy-$rate${chunk:+-chunk$chunk}$tag.md"
# shellcheck disable=SC2086 # $extra is a list of flags
python3 "$HERE/lazy_bench.py" --rate "$rate" --delay "$delay" ${chunk:+--chunk-size-bytes "$chunk"} $extra --out "$out"
echo "written: $out"
