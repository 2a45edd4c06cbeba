#!/usr/bin/env python3
"""Hundreds of sandboxes at once from one asyncio loop.

One ``create_many`` call asks the server's batch endpoint for all of them;
when the node is full the batch waits in its admission queue and reports
its position (printed here) instead of failing. Each sandbox then runs one
small command, concurrently with all the others, and is deleted. Sandboxes
are kept small (16 MiB of memory, 16 MiB of disk) so that hundreds fit.

Re-running with the same ``--batch`` after a crash answers with the same
sandboxes instead of making new ones.

    pip install ./python
    WARREN_URL=http://127.0.0.1:7070 python3 examples/async_many.py --n 256 --image default
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import warren


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=256, help="sandboxes to run at once")
    ap.add_argument("--image", default="default")
    ap.add_argument("--batch", default=None, help="batch key: re-use the sandboxes of an earlier run")
    args = ap.parse_args()

    def on_queued(p: warren.QueuePosition) -> None:
        print(f"queued: position {p.position}, {p.items_waiting} sandboxes waiting", flush=True)

    t0 = time.monotonic()
    made = await warren.AsyncSandbox.create_many(
        args.n,
        args.image,
        memory_mib=16,
        disk_mib=16,
        pids=64,
        idle_timeout=300,
        labels={"example": "async_many"},
        batch_key=args.batch,
        on_queued=on_queued,
    )
    sandboxes = [s for s in made if isinstance(s, warren.AsyncSandbox)]
    failed = [e for e in made if isinstance(e, warren.WarrenError)]
    for e in failed:
        print(f"create failed: {e!r}", file=sys.stderr)
    created = time.monotonic()

    async def work(i: int, sb: warren.AsyncSandbox) -> bool:
        r = await sb.exec(f"echo $(( {i} * {i} ))", timeout=60)
        return r.ok and r.stdout == f"{i * i}\n"

    try:
        results = await asyncio.gather(*(work(i, sb) for i, sb in enumerate(sandboxes)), return_exceptions=True)
    finally:
        await asyncio.gather(*(sb.delete() for sb in sandboxes), return_exceptions=True)
    ok = sum(1 for r in results if r is True)
    print(
        f"{len(sandboxes)} sandboxes made in {created - t0:.2f}s, {ok} commands right, "
        f"{len(failed)} creates failed, {time.monotonic() - t0:.2f}s in all"
    )
    return 0 if ok == args.n and not failed else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
