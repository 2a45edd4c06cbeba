"""``e2b.AsyncSandbox`` against Warren: the same front door, async."""

from __future__ import annotations

import pytest
from e2b import AsyncSandbox, CommandExitException


async def test_async_sandbox_runs_commands_and_files(label: dict[str, str]) -> None:
    sbx = await AsyncSandbox.create(timeout=120, metadata=label)
    try:
        r = await sbx.commands.run("echo async; echo e >&2")
        assert (r.stdout, r.stderr, r.exit_code) == ("async\n", "e\n", 0)
        with pytest.raises(CommandExitException) as e:
            await sbx.commands.run("exit 7")
        assert e.value.exit_code == 7
        handle = await sbx.commands.run("cat", background=True, stdin=True)
        await sbx.commands.send_stdin(handle.pid, "piped\n")
        await sbx.commands.close_stdin(handle.pid)
        assert (await handle.wait()).stdout == "piped\n"
        await sbx.files.write("/tmp/a.txt", "async file")
        assert await sbx.files.read("/tmp/a.txt") == "async file"
        assert await sbx.files.exists("/tmp/a.txt")
        await sbx.files.rename("/tmp/a.txt", "/tmp/b.txt")
        assert [e.name for e in await sbx.files.list("/tmp") if e.name.endswith(".txt")] == ["b.txt"]
        info = await sbx.get_info()
        assert info.metadata == label
        await sbx.set_timeout(600)
        await sbx.pause()
        again = await AsyncSandbox.connect(sbx.sandbox_id)
        assert await again.files.read("/tmp/b.txt") == "async file"
    finally:
        await sbx.kill()
    assert not await sbx.is_running()
