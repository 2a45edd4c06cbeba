#!/usr/bin/env python3
"""Generates ``warren/_sync.py`` from ``warren/_async.py``.

The sync API is the async one with ``async``/``await`` removed, the
``Async`` prefix dropped from names and ``_io_async`` swapped for
``_io_sync``: one source, so the two cannot drift. ``--check`` exits 1 when
``_sync.py`` is stale (the test suite runs it).

Usage: python3 python/tools/gen_sync.py [--check]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "warren"

HEADER = '''"""The sync API: ``Client``, ``Sandbox`` and its sessions and files.

GENERATED from ``_async.py`` by ``python/tools/gen_sync.py``: do not edit;
edit ``_async.py`` and run the tool. Every call blocks until it is done.
"""
'''

# Order matters: longer, more specific patterns first.
RULES: list[tuple[str, str]] = [
    (r"\basync def\b", "def"),
    (r"\basync with\b", "with"),
    (r"\basync for\b", "for"),
    (r"\bawait ", ""),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\baiter_lines\b", "iter_lines"),
    (r"\baiter_bytes\b", "iter_bytes"),
    (r"\baread\b", "read"),
    (r"\baclose\b", "close"),
    (r"\baclosing\b", "closing"),
    (r"\bAsyncIterator\b", "Iterator"),
    (r"\bAsyncGenerator\[(.*?), None\]", r"Generator[\1, None, None]"),
    (r"\bAsyncGenerator\b", "Generator"),
    (r"\b_io_async\b", "_io_sync"),
    (r"\bAsync([A-Z]\w*)", r"\1"),
    (r"\(and,\n(\s*)for the async API, per event loop\)", r"(for the\n\1whole process)"),
]


def generate(source: str) -> str:
    # Drop the async module's docstring; the generated file has its own.
    body = re.sub(r'\A""".*?"""\n', "", source, count=1, flags=re.S)
    for pattern, replacement in RULES:
        body = re.sub(pattern, replacement, body)
    return HEADER + body


def main() -> int:
    source = (PACKAGE / "_async.py").read_text()
    target = PACKAGE / "_sync.py"
    text = generate(source)
    if "--check" in sys.argv[1:]:
        if not target.exists() or target.read_text() != text:
            print(f"{target} is stale: run python3 python/tools/gen_sync.py", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
