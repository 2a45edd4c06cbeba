"""Commands: streaming (callbacks and async iteration), deadlines, capture
caps, results by id."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

import warren
from conftest import IMAGE

# Prints `ready`, then waits (bounded by the exec timeout) for a file only the
# test writes once it has *received* `ready`: it can finish only if output
# streams while the command runs.
HANDSHAKE = "echo ready; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo done; echo bye >&2"


@pytest.fixture
def sb(url: str) -> Iterator[warren.Sandbox]:
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=128) as sb:
        yield sb


def test_callbacks_receive_output_while_the_command_runs(sb: warren.Sandbox) -> None:
    got: list[tuple[str, str]] = []

    def on_stdout(text: str) -> None:
        got.append(("out", text))
        if "ready" in text:
            sb.files.write("/tmp/go", "")

    r = sb.exec(HANDSHAKE, timeout=60, on_stdout=on_stdout, on_stderr=lambda t: got.append(("err", t)))
    assert r.status == warren.ExecStatus.OK, "the command never saw /tmp/go: output did not stream"
    assert r.stdout == "ready\ndone\n" and r.stderr == "bye\n"
    assert "".join(t for k, t in got if k == "out") == r.stdout
    assert [t for k, t in got if k == "err"] == ["bye\n"]


async def test_async_iteration_yields_frames_while_the_command_runs(url: str) -> None:
    async with await warren.AsyncSandbox.create(IMAGE, url=url, memory_mib=128) as sb:
        frames = []
        async for frame in sb.exec_stream(HANDSHAKE, timeout=60):
            frames.append(frame)
            if isinstance(frame, warren.Output) and b"ready" in frame.data:
                await sb.files.write("/tmp/go", "")
        assert isinstance(frames[0], warren.Started) and isinstance(frames[-1], warren.End)
        result = frames[-1].result
        assert result.exec_id == frames[0].exec_id
        assert result.status == warren.ExecStatus.OK and result.stdout == "ready\ndone\n"
        stdout = [f for f in frames if isinstance(f, warren.Output) and f.stream == warren.StreamName.STDOUT]
        offsets = [f.offset for f in stdout]
        assert offsets == sorted(offsets) and offsets[0] == 0
        assert b"".join(f.data for f in stdout) == b"ready\ndone\n"
        # The exec is durable: its result can be fetched by id afterwards.
        fetched = await sb.exec_result(result.exec_id)
        assert (fetched.status, fetched.stdout, fetched.stderr) == (result.status, result.stdout, result.stderr)


async def test_async_callbacks_may_be_coroutines(url: str) -> None:
    async with await warren.AsyncSandbox.create(IMAGE, url=url, memory_mib=128) as sb:
        seen: list[str] = []

        async def on_stdout(text: str) -> None:
            await asyncio.sleep(0)
            seen.append(text)

        r = await sb.exec("seq 1 5", on_stdout=on_stdout)
        assert "".join(seen) == r.stdout == "1\n2\n3\n4\n5\n"


def test_a_command_past_its_timeout_is_killed_and_reported(sb: warren.Sandbox) -> None:
    r = sb.exec("echo started; sleep 600", timeout=0.5)
    assert r.status == warren.ExecStatus.TIMED_OUT and not r.ok
    assert r.stdout == "started\n", "output before the deadline is kept"
    assert r.exit_code is None or r.exit_code != 0
    # The whole tree is gone: nothing is left sleeping.
    assert "sleep 600" not in sb.exec("ps").stdout


def test_output_past_the_cap_keeps_head_and_tail(sb: warren.Sandbox) -> None:
    cmd = "i=0; while [ $i -lt 2000 ]; do echo line$i; i=$((i+1)); done"
    r = sb.exec(cmd, output_cap_bytes=200)
    assert r.stdout.startswith("line0\nline1\n") and r.stdout.endswith("line1999\n")
    assert len(r.stdout_bytes) == 200 and r.stdout_dropped_bytes > 0
    assert r.stdout_total_bytes == len(r.stdout_bytes) + r.stdout_dropped_bytes
    frames = list(sb.exec_stream(cmd, output_cap_bytes=200))
    end = frames[-1]
    assert isinstance(end, warren.End) and end.result.stdout_bytes == r.stdout_bytes


def test_exit_status_signal_and_resources_are_reported(sb: warren.Sandbox) -> None:
    r = sb.exec("kill -9 $$")
    assert r.status == warren.ExecStatus.OK and r.signal == 9 and r.exit_code is None
    r = sb.exec(["sh", "-c", "exit 7"])
    assert r.exit_code == 7 and r.wall_time >= 0 and r.cpu_time >= 0 and r.peak_memory_bytes > 0


def test_kill_ends_a_running_exec(sb: warren.Sandbox) -> None:
    stream = sb.exec_stream("echo up; sleep 600", timeout=120)
    started = next(stream)
    assert isinstance(started, warren.Started)
    for frame in stream:
        if isinstance(frame, warren.Output):
            sb.kill_exec(started.exec_id)
        if isinstance(frame, warren.End):
            assert frame.result.status == warren.ExecStatus.KILLED
            break
    else:
        pytest.fail("no end frame")
