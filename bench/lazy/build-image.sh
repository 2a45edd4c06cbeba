#!/bin/sh
# Builds the three layer directories of the lazy-loading benchmark (>= 1 GB
# together) into OUT (default /var/cache/warren/lazy-bench):
#
#   OUT/base       -> the default image: a debootstrap Debian bookworm
#                     minbase with python3, pytest, git, gcc
#                     (scripts/make-default-image.sh, built when missing)
#   OUT/toolkit    python packages from PyPI (numpy, pandas, sympy, pytest,
#                  requests, scipy, scikit-learn, matplotlib, pyarrow) as cp311
#                  manylinux wheels in /usr/local/lib/python3.11/dist-packages,
#                  where the base's python3 finds them
#   OUT/workspace  /work/repo: a small Python package and its pytest tests
#
# Cached: a layer whose OUT/<layer>.complete exists is not rebuilt.
# Usage: build-image.sh [OUT]   (root; needs the network for apt and PyPI)
set -eu

OUT=${1:-/var/cache/warren/lazy-bench}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BASE=/var/cache/warren/default-rootfs
TOOLKIT_PACKAGES="numpy pandas sympy pytest requests scipy scikit-learn matplotlib pyarrow"

mkdir -p "$OUT"
if [ ! -e "$BASE/.warren-complete" ]; then
    "$ROOT/scripts/make-default-image.sh" "$BASE"
fi
ln -sfn "$BASE" "$OUT/base"

if [ ! -e "$OUT/toolkit.complete" ]; then
    rm -rf "$OUT/toolkit"
    site="$OUT/toolkit/usr/local/lib/python3.11/dist-packages"
    mkdir -p "$site"
    # Wheels only, for the image's interpreter (CPython 3.11, x86_64
    # glibc), whatever python runs pip here.
    python3 -m pip install --quiet --no-cache-dir --no-compile --target "$site" \
        --only-binary=:all: --implementation cp --python-version 3.11 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        $TOOLKIT_PACKAGES
    touch "$OUT/toolkit.complete"
fi

if [ ! -e "$OUT/workspace.complete" ]; then
    rm -rf "$OUT/workspace"
    repo="$OUT/workspace/work/repo"
    mkdir -p "$repo/stats" "$repo/tests"
    cat > "$repo/stats/__init__.py" <<'PY'
"""A small task repository: summary statistics over numpy and pandas."""
from .summary import describe, zscores
PY
    cat > "$repo/stats/summary.py" <<'PY'
import numpy as np
import pandas as pd


def describe(values):
    s = pd.Series(values, dtype="float64")
    return {"mean": float(s.mean()), "std": float(s.std(ddof=0)), "n": int(s.size)}


def zscores(values):
    a = np.asarray(values, dtype="float64")
    return (a - a.mean()) / a.std()
PY
    cat > "$repo/tests/test_summary.py" <<'PY'
import numpy as np
import pytest

from stats import describe, zscores


def test_describe():
    d = describe([1, 2, 3, 4])
    assert d["n"] == 4 and d["mean"] == pytest.approx(2.5)


def test_zscores_are_centred():
    z = zscores(np.arange(10))
    assert abs(z.mean()) < 1e-12 and z.std() == pytest.approx(1.0)


@pytest.mark.parametrize("n", [1, 10, 100])
def test_sizes(n):
    assert describe(range(n))["n"] == n
PY
    printf '[pytest]\ntestpaths = tests\n' > "$repo/pytest.ini"
    touch "$OUT/workspace.complete"
fi

du -sLh "$OUT/base" "$OUT/toolkit" "$OUT/workspace" 2>/dev/null || true
