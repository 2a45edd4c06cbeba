"""warren.run_code / warren.async_run_code against a real server with a
function pool of the busybox image (which has ``sh`` only), and a
``backend="function"`` sandbox through ``Sandbox``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

import warren
from conftest import IMAGE, Server, running_server


@pytest.fixture(scope="module")
def fn_server() -> Iterator[Server]:
    pool = f"image={IMAGE},min=1,max=2,queue=8,memory_mib=64,disk_mib=16,pids=128"
    with running_server("functions", "--function-pool", pool) as srv:
        yield srv


def test_run_code_returns_output_files_and_timings(fn_server: Server) -> None:
    r = warren.run_code(
        "read x; echo got $x; cat in.txt; echo made > out.bin; exit 4",
        language="sh",
        image=IMAGE,
        stdin="7\n",
        files={"in.txt": "text in\n"},
        fetch=["out.bin", "absent"],
        url=fn_server.url,
    )
    assert isinstance(r, warren.FunctionResult)
    assert r.stdout == "got 7\ntext in\n"
    assert r.exit_code == 4 and r.status == warren.ExecStatus.OK and not r.ok
    assert r.files == {"out.bin": b"made\n", "absent": None}
    assert r.file_status == {"out.bin": "ok", "absent": "missing"}
    assert r.timings.total >= r.timings.run > 0


def test_run_code_takes_commands_and_binary_files(fn_server: Server) -> None:
    r = warren.run_code(
        command=["od", "-An", "-tx1", "blob"], image=IMAGE, files={"blob": b"\x00\xff"}, url=fn_server.url
    )
    assert r.stdout.split() == ["00", "ff"]
    shell = warren.run_code(command="echo $A", env={"A": "b"}, image=IMAGE, url=fn_server.url)
    assert shell.stdout == "b\n"


def test_run_code_errors_are_typed(fn_server: Server) -> None:
    with pytest.raises(warren.InvalidRequest) as e:
        warren.run_code("print(1)", language="python", image=IMAGE, url=fn_server.url)
    assert e.value.field == "language" and "python" in e.value.message
    with pytest.raises(warren.InvalidRequest) as e:
        warren.run_code("true", language="sh", image=IMAGE, timeout=-1, url=fn_server.url)
    assert e.value.field == "timeout_secs"
    timed = warren.run_code("sleep 60", language="sh", image=IMAGE, timeout=1, url=fn_server.url)
    assert timed.status == warren.ExecStatus.TIMED_OUT


def test_async_run_code_leaves_nothing_for_the_next_call(fn_server: Server) -> None:
    async def go() -> list[warren.FunctionResult]:
        await warren.async_run_code("echo s > /root/s", language="sh", image=IMAGE, url=fn_server.url)
        check = "cat /root/s 2>/dev/null || echo clean"
        calls = [warren.async_run_code(check, language="sh", image=IMAGE, url=fn_server.url) for _ in range(3)]
        return await asyncio.gather(*calls)

    assert [r.stdout for r in asyncio.run(go())] == ["clean\n"] * 3


def test_a_function_sandbox_is_stateless_and_refuses_sessions(fn_server: Server) -> None:
    with warren.Sandbox.create(IMAGE, backend="function", memory_mib=64, url=fn_server.url) as sb:
        assert sb.exec("echo kept > /root/f").ok
        assert sb.exec("cat /root/f 2>/dev/null || echo gone").stdout == "gone\n"
        with pytest.raises(warren.Unsupported) as e:
            sb.sessions.create()
        assert "function" in e.value.message
