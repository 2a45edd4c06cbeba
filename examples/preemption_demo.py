#!/usr/bin/env python3
"""Preemption without re-execution: a driver killed mid-trajectory is
restarted, re-issues every call from the start, and nothing runs twice.

The demo makes a sandbox and starts a *driver* process that takes it
through a SWE-style trajectory (write a buggy program and its test, run the
test, "agent" edit, run the test again, compute the reward). Every command
of the trajectory also appends its name to ``/work/ran``: a side-effect
counter inside the sandbox. While the slow "agent edit" command runs, the
demo SIGKILLs the driver, as a preempted training job dies. It then starts
the driver again with ``Sandbox.connect(id, resume=True)``: the driver
re-issues the whole trajectory from step 1; the steps already in the
sandbox's trajectory log are answered from it (the one still running is
joined), and only the rest run. At the end the counter file must name every
command exactly once:

    re-executions = 0

Only ``/bin/sh`` is needed inside the image (the tests use busybox):

    pip install ./python
    WARREN_URL=http://127.0.0.1:7070 python3 examples/preemption_demo.py --image default
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import time

import warren

BUGGY = "#!/bin/sh\n# add A B\necho $(( $1 - $2 ))\n"
TEST = '#!/bin/sh\nout=$(/work/add.sh 2 3)\n[ "$out" = 5 ] && echo PASS || { echo "FAIL: got $out"; exit 1; }\n'
COUNTER = "/work/ran"
# The command the demo kills the driver in the middle of.
SLOW = "agent-edit"


def trajectory(sb: warren.Sandbox) -> float:
    """The rollout; every command appends its name to the counter file."""

    def run(name: str, command: str) -> warren.ExecResult:
        print(f"driver: {name} ...", flush=True)
        r = sb.exec(f"echo {name} >> {COUNTER}; {command}", cwd="/work", timeout=120)
        print(f"driver: {name} -> exit {r.exit_code}: {r.stdout.strip()!r}", flush=True)
        return r

    sb.files.mkdir("/work")
    sb.files.write("/work/add.sh", BUGGY, mode=0o755)
    sb.files.write("/work/test.sh", TEST, mode=0o755)
    run("test-before", "./test.sh")
    session = sb.sessions.create(cwd="/work")
    session.run(f"echo explore >> {COUNTER}; ls > /dev/null")
    # The agent thinks for a while, then edits the file.
    run(SLOW, "sleep 2; sed -i 's/-/+/' add.sh")
    after = run("test-after", "./test.sh")
    reward = 1.0 if after.ok else 0.0
    run("reward", f"echo reward={reward}")
    return reward


def drive(sandbox_id: str, resume: bool) -> int:
    sb = warren.Sandbox.connect(sandbox_id, resume=resume)
    reward = trajectory(sb)
    print(f"driver: done, reward {reward}", flush=True)
    return 0 if reward == 1.0 else 1


def wait_for_line(sb: warren.Sandbox, name: str, within: float) -> None:
    """Waits until the command ``name`` has started inside the sandbox."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if name in sb.files.read_text(COUNTER).split():
                return
        except warren.FileNotFound:
            pass
        time.sleep(0.05)
    raise SystemExit(f"the driver never reached {name!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image", default="default")
    ap.add_argument("--drive", metavar="SANDBOX_ID", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive:
        return drive(args.drive, args.resume)

    driver = [sys.executable, os.path.abspath(__file__), "--drive"]
    with warren.Sandbox.create(args.image, memory_mib=128, idle_timeout=600, labels={"example": "preemption"}) as sb:
        print(f"sandbox {sb.id}", flush=True)
        first = subprocess.Popen([*driver, sb.id])
        wait_for_line(sb, SLOW, within=120)
        first.send_signal(signal.SIGKILL)
        first.wait()
        logged = len(sb.trajectory().steps)
        print(f"killed the driver (SIGKILL) during {SLOW!r}; {logged} steps were in the log", flush=True)

        second = subprocess.run([*driver, sb.id, "--resume"], timeout=300)
        if second.returncode != 0:
            print(f"the resumed driver failed ({second.returncode})", flush=True)
            return 1

        ran = collections.Counter(sb.files.read_text(COUNTER).split())
        expected = ["test-before", "explore", SLOW, "test-after", "reward"]
        reexecutions = sum(n - 1 for n in ran.values() if n > 1)
        missing = [name for name in expected if ran[name] == 0]
        steps = sb.trajectory().steps
        print(f"counter file: {dict(ran)}")
        print(f"trajectory: {len(steps)} steps, {logged} answered from the log after the restart")
        print(f"re-executions = {reexecutions}")
        if missing:
            print(f"never ran: {missing}")
        return 0 if reexecutions == 0 and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
