"""The trajectory log through the SDK: a resumed handle re-issues its calls
and none runs twice; a different call at a logged step is refused; the log
lists the steps, outlives the sandbox, and replays in a fresh sandbox."""

from __future__ import annotations

import collections
import time

import pytest

import warren
from conftest import IMAGE, running_server

COUNTER = "/tmp/ran"


def _rollout(sb: warren.Sandbox) -> list[warren.ExecResult]:
    """A small SWE-style trajectory; each command appends its name to COUNTER."""
    sb.files.write("/tmp/add.sh", "echo $(( $1 - $2 ))\n", mode=0o755)
    first = sb.exec(f"echo one >> {COUNTER}; sh /tmp/add.sh 2 3")
    session = sb.sessions.create(cwd="/tmp")
    second = session.run(f"echo two >> {COUNTER}; sed -i s/-/+/ add.sh; export FIXED=1")
    third = session.run(f"echo three >> {COUNTER}; sh add.sh 2 3; echo $FIXED")
    return [first, second, third]


async def _rollout_async(sb: warren.AsyncSandbox) -> list[warren.ExecResult]:
    await sb.files.write("/tmp/add.sh", "echo $(( $1 - $2 ))\n", mode=0o755)
    first = await sb.exec(f"echo one >> {COUNTER}; sh /tmp/add.sh 2 3")
    session = await sb.sessions.create(cwd="/tmp")
    second = await session.run(f"echo two >> {COUNTER}; sed -i s/-/+/ add.sh; export FIXED=1")
    third = await session.run(f"echo three >> {COUNTER}; sh add.sh 2 3; echo $FIXED")
    return [first, second, third]


def _runs(text: str) -> dict[str, int]:
    return dict(collections.Counter(text.split()))


def test_resumed_handle_fast_forwards_with_zero_reexecutions(url: str) -> None:
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=64) as sb:
        original = _rollout(sb)
        assert [r.stdout for r in original] == ["-1\n", "", "5\n1\n"]
        assert sb.last_step == 5

        resumed = warren.Sandbox.connect(sb.id, url=url, resume=True)
        again = _rollout(resumed)
        assert [r.exec_id for r in again] == [r.exec_id for r in original]
        assert [r.stdout for r in again] == [r.stdout for r in original]
        assert _runs(sb.files.read_text(COUNTER)) == {"one": 1, "two": 1, "three": 1}, "a logged step ran again"

        # The first call past the log runs for real.
        past = resumed.exec(f"echo four >> {COUNTER}")
        assert past.exit_code == 0 and resumed.last_step == 6
        assert _runs(sb.files.read_text(COUNTER)) == {"one": 1, "two": 1, "three": 1, "four": 1}


async def test_resumed_async_handle_fast_forwards_with_zero_reexecutions(url: str) -> None:
    async with await warren.AsyncSandbox.create(IMAGE, url=url, memory_mib=64) as sb:
        original = await _rollout_async(sb)
        resumed = await warren.AsyncSandbox.connect(sb.id, url=url, resume=True)
        again = await _rollout_async(resumed)
        assert [(r.exec_id, r.stdout) for r in again] == [(r.exec_id, r.stdout) for r in original]
        assert _runs(await sb.files.read_text(COUNTER)) == {"one": 1, "two": 1, "three": 1}


def test_a_different_call_at_a_logged_step_raises_trajectory_diverged(url: str) -> None:
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=64) as sb:
        sb.exec(f"echo one >> {COUNTER}")
        resumed = warren.Sandbox.connect(sb.id, url=url, resume=True)
        with pytest.raises(warren.TrajectoryDiverged) as e:
            resumed.exec(f"echo other >> {COUNTER}")
        logged = sb.trajectory().steps[0]
        assert e.value.step == 1 and e.value.expected == logged.request_hash
        assert e.value.got != e.value.expected and e.value.got.startswith("sha256:")
        assert e.value.code == "trajectory_diverged" and e.value.status == 409
        assert isinstance(e.value, warren.Conflict)
        assert _runs(sb.files.read_text(COUNTER)) == {"one": 1}


def test_connect_without_resume_continues_after_the_log(url: str) -> None:
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=64) as sb:
        sb.files.mkdir("/tmp/d")
        sb.exec("true")
        later = warren.Sandbox.connect(sb.id, url=url)
        assert later.last_step == 2
        later.exec("echo next")
        steps = sb.trajectory().steps
        assert [(s.step, s.kind) for s in steps] == [(1, "mkdir"), (2, "exec"), (3, "exec")]
        assert steps[2].result is not None and steps[2].result.stdout_bytes == 5
        # An explicit step: later calls number on from it.
        later.exec("true", step=10)
        later.exec("true")
        assert [s.step for s in sb.trajectory().steps][-2:] == [10, 11]


def test_replay_reports_every_step(url: str) -> None:
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=64) as sb:
        _rollout(sb)
        report = warren.replay(sb.id, url=url)
        assert report.source_id == sb.id and report.sandbox_id != sb.id
        assert [s.kind for s in report.steps] == ["file_write", "exec", "session_create", "session_exec", "session_exec"]
        assert report.matched, report
        sb.exec("cat /proc/sys/kernel/random/uuid")
        report = sb.replay()
        assert not report.matched
        assert report.steps[-1].outcome == "mismatch" and report.steps[-1].differences == ["stdout_sha256"]


async def test_async_replay(url: str) -> None:
    async with await warren.AsyncSandbox.create(IMAGE, url=url, memory_mib=64) as sb:
        await sb.exec("echo hi")
        report = await warren.async_replay(sb.id, url=url)
        assert report.matched and report.steps[0].result is not None and report.steps[0].result.exit_code == 0


def test_trajectory_survives_the_sandbox() -> None:
    # Ended sandboxes are forgotten after 1 s here; their trajectories are not.
    with running_server("trajectory", "--ended-retention-secs", "1") as srv:
        sb = warren.Sandbox.create(IMAGE, url=srv.url, memory_mib=64)
        sb.exec("echo kept")
        sb.delete()
        deadline = time.monotonic() + 60
        while True:
            try:
                warren.Sandbox.connect(sb.id, url=srv.url, resume=True)
            except warren.NotFound:
                break
            assert time.monotonic() < deadline, "the ended sandbox's record was never forgotten"
            time.sleep(0.2)
        kept = sb.trajectory()
        assert [s.kind for s in kept.steps] == ["exec"] and kept.ended_at_ms is not None
        assert kept.origin["image"] == IMAGE
        assert warren.replay(sb.id, url=srv.url).matched

