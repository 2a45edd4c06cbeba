#!/usr/bin/env python3
"""SWE-style rollouts with the Python SDK, many at once under asyncio.

Each rollout gets its own sandbox: it writes a buggy program and its test,
runs the test (fails), "lets the agent" patch the program, runs the test
again and turns the outcome into a reward. The sandboxes are made together
with ``create_many`` under one batch key, so re-running this script with the
same ``--batch`` after a crash reuses them instead of making new ones.

Only ``/bin/sh`` is needed inside the image, so it runs on the tests'
busybox image as well as on ``default``:

    pip install ./python
    WARREN_URL=http://127.0.0.1:7070 python3 examples/sdk_rollout.py --n 8 --image default
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import warren

BUGGY = "#!/bin/sh\n# add A B\necho $(( $1 - $2 ))\n"
FIXED = "#!/bin/sh\n# add A B\necho $(( $1 + $2 ))\n"
TEST = '#!/bin/sh\nout=$(/work/add.sh 2 3)\n[ "$out" = 5 ] && echo PASS || { echo "FAIL: got $out"; exit 1; }\n'


async def rollout(sb: warren.AsyncSandbox, n: int) -> float:
    """One episode; returns its reward (1.0 when the fix makes the test pass)."""
    await sb.files.mkdir("/work")
    await sb.files.write("/work/add.sh", BUGGY, mode=0o755)
    await sb.files.write("/work/test.sh", TEST, mode=0o755)
    before = await sb.exec(["/work/test.sh"], cwd="/work", timeout=60)
    if before.ok:
        return 0.0  # the bug did not show: nothing to learn from this episode
    # The "agent": one edit to the file, as a model's tool call would make it.
    source = await sb.files.read_text("/work/add.sh")
    await sb.files.write("/work/add.sh", source.replace("-", "+"), mode=0o755)
    lines: list[str] = []
    after = await sb.exec(["/work/test.sh"], cwd="/work", timeout=60, on_stdout=lines.append)
    print(f"rollout {n:3}: {sb.id} before={before.stdout.strip()!r} after={''.join(lines).strip()!r}", flush=True)
    return 1.0 if after.ok else 0.0


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8, help="rollouts to run at once")
    ap.add_argument("--image", default="default")
    ap.add_argument("--batch", default=None, help="batch key: re-use the sandboxes of an earlier run")
    args = ap.parse_args()

    t0 = time.monotonic()
    made = await warren.AsyncSandbox.create_many(
        args.n, args.image, memory_mib=128, idle_timeout=600, labels={"example": "sdk_rollout"}, batch_key=args.batch
    )
    failed = [e for e in made if isinstance(e, warren.WarrenError)]
    sandboxes = [s for s in made if isinstance(s, warren.AsyncSandbox)]
    for e in failed:
        print(f"create failed: {e!r}", file=sys.stderr)
    try:
        rewards = await asyncio.gather(*(rollout(sb, i) for i, sb in enumerate(sandboxes)))
    finally:
        await asyncio.gather(*(sb.delete() for sb in sandboxes), return_exceptions=True)
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    print(f"{len(sandboxes)} rollouts, mean reward {mean:.2f}, {time.monotonic() - t0:.2f}s")
    return 0 if sandboxes and not failed and mean == 1.0 else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
