"""The synchronous ``e2b.Sandbox`` against Warren: lifecycle, commands,
files, listing, timeouts, pause and connect."""

from __future__ import annotations

import io
import time
import uuid
from datetime import datetime, timezone

import pytest
from e2b import CommandExitException, Sandbox
from e2b.exceptions import AuthenticationException, NotFoundException

from conftest import TEMPLATE, sdk_version


# ---- lifecycle --------------------------------------------------------------


def test_create_maps_template_metadata_envs_and_get_info_reads_them(label: dict[str, str]) -> None:
    sbx = Sandbox.create(timeout=120, metadata=label, envs={"GREETING": "hello"})
    try:
        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        assert info.template_id == TEMPLATE
        assert info.metadata == label
        assert info.state.value == "running"
        # The timeout is the lifetime: the end is about two minutes after the start.
        assert 100 <= (info.end_at - info.started_at).total_seconds() <= 140
        assert sbx.commands.run("echo $GREETING").stdout == "hello\n"
        assert sbx.is_running()
    finally:
        sbx.kill()
    assert not sbx.is_running()
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id)


def test_a_wrong_api_key_is_refused() -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="e2b_not_the_key")


def test_an_unknown_template_is_a_clear_error() -> None:
    with pytest.raises(Exception, match="no-such-template"):
        Sandbox.create(template="no-such-template")


def test_kill_by_id_and_twice(label: dict[str, str]) -> None:
    sbx = Sandbox.create(timeout=60, metadata=label)
    assert Sandbox.kill(sbx.sandbox_id) is True
    assert Sandbox.kill(sbx.sandbox_id) is False


def test_set_timeout_moves_the_end(sandbox: Sandbox) -> None:
    before = sandbox.get_info().end_at
    sandbox.set_timeout(1800)
    after = sandbox.get_info().end_at
    assert (after - before).total_seconds() > 1000
    remaining = (after - datetime.now(timezone.utc)).total_seconds()
    assert 1700 <= remaining <= 1810


def test_list_filters_by_metadata_and_pages_with_the_next_token(label: dict[str, str]) -> None:
    from e2b import SandboxQuery, SandboxState

    mine = [Sandbox.create(timeout=120, metadata=label) for _ in range(3)]
    other = Sandbox.create(timeout=120, metadata={"test": "someone-else"})
    try:
        paginator = Sandbox.list(query=SandboxQuery(metadata=label), limit=2)
        seen = []
        pages = 0
        while paginator.has_next:
            seen += [s.sandbox_id for s in paginator.next_items()]
            pages += 1
        assert pages == 2
        assert sorted(seen) == sorted(s.sandbox_id for s in mine)
        listed = Sandbox.list(query=SandboxQuery(metadata=label)).next_items()
        assert all(s.metadata == label and s.template_id == TEMPLATE for s in listed)
        by_template = Sandbox.list(query=SandboxQuery(metadata=label, template="other-template")).next_items()
        assert by_template == []
        running = Sandbox.list(query=SandboxQuery(metadata=label, state=[SandboxState.RUNNING])).next_items()
        assert len(running) == 3
    finally:
        for s in [*mine, other]:
            s.kill()
    assert Sandbox.list(query=SandboxQuery(metadata=label)).next_items() == []


# ---- commands ---------------------------------------------------------------


def test_foreground_command_returns_output_and_exit_code(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("echo out; echo err >&2")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)
    assert sandbox.commands.run("pwd").stdout == "/home/user\n"
    assert sandbox.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sandbox.commands.run("echo $A-$B", envs={"A": "1", "B": "2"}).stdout == "1-2\n"
    chunks: list[str] = []
    errors: list[str] = []
    sandbox.commands.run("echo one; echo two; echo three >&2", on_stdout=chunks.append, on_stderr=errors.append)
    assert ("".join(chunks), "".join(errors)) == ("one\ntwo\n", "three\n")


def test_failing_command_raises_command_exit_exception(sandbox: Sandbox) -> None:
    with pytest.raises(CommandExitException) as e:
        sandbox.commands.run("echo partial; echo bad >&2; exit 3")
    assert e.value.exit_code == 3
    assert e.value.stdout == "partial\n"
    assert e.value.stderr == "bad\n"


def test_background_command_waits_and_lists(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("sleep 0.5; echo done", background=True)
    assert handle.pid in [p.pid for p in sandbox.commands.list()]
    result = handle.wait()
    assert (result.stdout, result.exit_code) == ("done\n", 0)
    assert handle.pid not in [p.pid for p in sandbox.commands.list()]


def test_background_command_is_killed(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("sleep 600", background=True)
    listed = {p.pid: p for p in sandbox.commands.list()}
    assert listed[handle.pid].cmd == "/bin/bash"
    assert sandbox.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException) as e:
        handle.wait()
    assert e.value.exit_code != 0
    assert sandbox.commands.kill(handle.pid) is False


def test_stdin_is_sent_then_closed(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("cat; echo end", background=True, stdin=True)
    sandbox.commands.send_stdin(handle.pid, "hello ")
    sandbox.commands.send_stdin(handle.pid, "world\n")
    sandbox.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "hello world\nend\n"


def test_connect_to_a_running_command(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("sleep 0.5; echo late", background=True)
    again = sandbox.commands.connect(handle.pid)
    assert again.wait().stdout.endswith("late\n")


def test_command_timeout_kills_it(sandbox: Sandbox) -> None:
    with pytest.raises(Exception):
        sandbox.commands.run("sleep 30", timeout=1)


# ---- files ------------------------------------------------------------------


def test_write_read_text_bytes_and_streams(sandbox: Sandbox) -> None:
    info = sandbox.files.write("notes/hello.txt", "hi there")
    assert info.path == "/home/user/notes/hello.txt"
    assert sandbox.files.read("notes/hello.txt") == "hi there"
    blob = bytes(range(256)) * 64
    sandbox.files.write("/tmp/blob.bin", blob)
    assert sandbox.files.read("/tmp/blob.bin", format="bytes") == blob
    sandbox.files.write("/tmp/stream.bin", io.BytesIO(blob))
    streamed = b"".join(sandbox.files.read("/tmp/stream.bin", format="stream"))
    assert streamed == blob
    assert sandbox.commands.run("cat /home/user/notes/hello.txt").stdout == "hi there"


def test_write_many_files_in_one_request(sandbox: Sandbox) -> None:
    from e2b.sandbox.filesystem.filesystem import WriteEntry

    infos = sandbox.files.write_files(
        [WriteEntry(path="/tmp/many/a.txt", data="A"), WriteEntry(path="/tmp/many/b.txt", data=b"B")]
    )
    assert sorted(i.path for i in infos) == ["/tmp/many/a.txt", "/tmp/many/b.txt"]
    assert sandbox.files.read("/tmp/many/b.txt") == "B"


def test_list_exists_make_dir_rename_remove(sandbox: Sandbox) -> None:
    assert sandbox.files.make_dir("/tmp/d/sub") is True
    assert sandbox.files.make_dir("/tmp/d/sub") is False
    sandbox.files.write("/tmp/d/f.txt", "x")
    entries = {e.name: e for e in sandbox.files.list("/tmp/d")}
    assert set(entries) == {"sub", "f.txt"}
    assert entries["sub"].type.value == "dir"
    assert entries["f.txt"].type.value == "file"
    deep = {e.path for e in sandbox.files.list("/tmp", depth=2)}
    assert {"/tmp/d", "/tmp/d/sub", "/tmp/d/f.txt"} <= deep
    assert sandbox.files.exists("/tmp/d/f.txt")
    moved = sandbox.files.rename("/tmp/d/f.txt", "/tmp/d/g.txt")
    assert moved.path == "/tmp/d/g.txt"
    assert not sandbox.files.exists("/tmp/d/f.txt")
    assert sandbox.files.read("/tmp/d/g.txt") == "x"
    info = sandbox.files.get_info("/tmp/d/g.txt")
    assert (info.name, info.size, info.permissions) == ("g.txt", 1, "-rw-r--r--")
    assert abs((info.modified_time - datetime.now(timezone.utc)).total_seconds()) < 300
    sandbox.files.remove("/tmp/d")
    assert not sandbox.files.exists("/tmp/d")


def test_missing_files_raise_not_found(sandbox: Sandbox) -> None:
    from e2b.exceptions import NotFoundException as SdkNotFound

    with pytest.raises(SdkNotFound):
        sandbox.files.read("/nope/missing.txt")
    with pytest.raises(SdkNotFound):
        sandbox.files.list("/nope")
    assert sandbox.files.exists("/nope") is False


# ---- pause and connect --------------------------------------------------------


def test_pause_then_connect_resumes_with_files_and_processes(label: dict[str, str]) -> None:
    from e2b import SandboxQuery

    sbx = Sandbox.create(timeout=300, metadata=label)
    try:
        sbx.files.write("/tmp/kept.txt", "still here")
        marker = uuid.uuid4().hex
        bg = sbx.commands.run(f"sleep 600 # {marker}", background=True)
        sbx.pause()
        paused = Sandbox.list(query=SandboxQuery(metadata=label)).next_items()
        assert [s.state.value for s in paused] == ["paused"]
        same = Sandbox.connect(sbx.sandbox_id)
        assert same.get_info().state.value == "running"
        assert same.files.read("/tmp/kept.txt") == "still here"
        assert bg.pid in [p.pid for p in same.commands.list()]
        assert same.commands.run("echo alive").stdout == "alive\n"
    finally:
        sbx.kill()


def test_connect_to_a_running_sandbox_by_id(sandbox: Sandbox) -> None:
    same = Sandbox.connect(sandbox.sandbox_id)
    same.files.write("/tmp/via-connect", "ok")
    assert sandbox.files.read("/tmp/via-connect") == "ok"


def test_connect_to_a_killed_sandbox_fails(label: dict[str, str]) -> None:
    sbx = Sandbox.create(timeout=60, metadata=label)
    sbx.kill()
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id)


def test_the_sandbox_ends_at_its_timeout(label: dict[str, str]) -> None:
    sbx = Sandbox.create(timeout=1, metadata=label)
    deadline = time.monotonic() + 30
    while sbx.is_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not sbx.is_running()


@pytest.mark.skipif(sdk_version() < (2, 51), reason="the SDK sends Idempotency-Key from 2.51 on")
def test_create_with_an_idempotency_key_makes_one_sandbox(label: dict[str, str]) -> None:
    key = f"key-{uuid.uuid4().hex}"
    first = Sandbox.create(timeout=60, metadata=label, idempotency_key=key)
    try:
        again = Sandbox.create(timeout=60, metadata=label, idempotency_key=key)
        assert again.sandbox_id == first.sandbox_id
    finally:
        first.kill()


def test_sdk_calls_land_in_the_trajectory_log(sandbox: Sandbox, server) -> None:
    import httpx

    sandbox.commands.run("echo logged")
    sandbox.files.write("/tmp/t/log.txt", "x")
    sandbox.files.make_dir("/tmp/t/dir")
    sandbox.files.remove("/tmp/t/log.txt")
    log = httpx.get(f"{server.url}/v1/sandboxes/{sandbox.sandbox_id}/trajectory", timeout=60).json()
    kinds = [(s["kind"], s["request"].get("path") or s["request"].get("argv")) for s in log["steps"]]
    assert kinds == [
        ("mkdir", "/home/user"),
        ("exec", ["/bin/bash", "-l", "-c", "echo logged"]),
        ("mkdir", "/tmp/t"),
        ("file_write", "/tmp/t/log.txt"),
        ("mkdir", "/tmp/t/dir"),
        ("file_remove", "/tmp/t/log.txt"),
    ]
