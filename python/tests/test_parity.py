"""One rollout-shaped scenario run with the sync and with the async API
against the real server: both must see exactly the same results."""

from __future__ import annotations

from typing import Any

import warren
from conftest import IMAGE


def sync_scenario(url: str, labels: dict[str, str]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    with warren.Sandbox.create(
        IMAGE, url=url, memory_mib=128, idle_timeout=300, env={"GREETING": "hi"}, labels=labels
    ) as sb:
        info = sb.info()
        seen["info"] = (info.state, info.image, info.resources.memory_mib, info.idle_timeout, info.labels)
        r = sb.exec("echo $GREETING $EXTRA; echo oops >&2; exit 4", env={"EXTRA": "there"})
        seen["shell"] = (r.exit_code, r.stdout, r.stderr, r.status, r.ok)
        r = sb.exec(["cat"], stdin=b"\x00binary\xff")
        seen["argv_stdin"] = r.stdout_bytes
        r = sb.exec("pwd", cwd="/tmp")
        seen["cwd"] = r.stdout
        sb.files.mkdir("/work/src")
        seen["write"] = sb.files.write("/work/src/app.py", "print('x')\n", mode=0o755).mode
        seen["read"] = sb.files.read_text("/work/src/app.py")
        seen["list"] = sorted((e.path, e.kind) for e in sb.files.list("/work"))
        seen["stat"] = sb.files.stat("/work/src/app.py").size_bytes
        sb.files.remove("/work", recursive=True)
        seen["exists_after_remove"] = sb.files.exists("/work/src/app.py")
        with sb.sessions.create(cwd="/tmp", env={"A": "1"}) as s:
            s.run("cd /etc && export B=2")
            seen["session"] = s.run("pwd; echo $A$B").stdout
            seen["session_list"] = [(i.id == s.id, i.cwd, i.commands_run) for i in sb.sessions.list()]
        seen["sessions_after"] = sb.sessions.list()
        seen["events"] = sb.events().events
        seen["listed"] = [i.id == sb.id for i in warren.Sandbox.list(labels=labels, url=url)]
        again = warren.Sandbox.connect(sb.id, url=url)
        seen["connect"] = again.last_info.id == sb.id
    seen["after"] = (again.info().state, again.last_info.end_reason)
    return seen


async def async_scenario(url: str, labels: dict[str, str]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    async with await warren.AsyncSandbox.create(
        IMAGE, url=url, memory_mib=128, idle_timeout=300, env={"GREETING": "hi"}, labels=labels
    ) as sb:
        info = await sb.info()
        seen["info"] = (info.state, info.image, info.resources.memory_mib, info.idle_timeout, info.labels)
        r = await sb.exec("echo $GREETING $EXTRA; echo oops >&2; exit 4", env={"EXTRA": "there"})
        seen["shell"] = (r.exit_code, r.stdout, r.stderr, r.status, r.ok)
        r = await sb.exec(["cat"], stdin=b"\x00binary\xff")
        seen["argv_stdin"] = r.stdout_bytes
        r = await sb.exec("pwd", cwd="/tmp")
        seen["cwd"] = r.stdout
        await sb.files.mkdir("/work/src")
        seen["write"] = (await sb.files.write("/work/src/app.py", "print('x')\n", mode=0o755)).mode
        seen["read"] = await sb.files.read_text("/work/src/app.py")
        seen["list"] = sorted((e.path, e.kind) for e in await sb.files.list("/work"))
        seen["stat"] = (await sb.files.stat("/work/src/app.py")).size_bytes
        await sb.files.remove("/work", recursive=True)
        seen["exists_after_remove"] = await sb.files.exists("/work/src/app.py")
        async with await sb.sessions.create(cwd="/tmp", env={"A": "1"}) as s:
            await s.run("cd /etc && export B=2")
            seen["session"] = (await s.run("pwd; echo $A$B")).stdout
            seen["session_list"] = [(i.id == s.id, i.cwd, i.commands_run) for i in await sb.sessions.list()]
        seen["sessions_after"] = await sb.sessions.list()
        seen["events"] = (await sb.events()).events
        seen["listed"] = [i.id == sb.id for i in await warren.AsyncSandbox.list(labels=labels, url=url)]
        again = await warren.AsyncSandbox.connect(sb.id, url=url)
        seen["connect"] = again.last_info.id == sb.id
    seen["after"] = ((await again.info()).state, again.last_info.end_reason)
    return seen


EXPECTED = {
    "info": ("running", IMAGE, 128, 300.0, None),
    "shell": (4, "hi there\n", "oops\n", "ok", False),
    "argv_stdin": b"\x00binary\xff",
    "cwd": "/tmp\n",
    "write": 0o755,
    "read": "print('x')\n",
    "list": [("/work/src", "dir")],
    "stat": 11,
    "exists_after_remove": False,
    "session": "/etc\n12\n",
    "session_list": [(True, "/etc", 2)],
    "sessions_after": [],
    "events": [],
    "listed": [True],
    "connect": True,
    "after": ("ended", "deleted"),
}


def check(seen: dict[str, Any], labels: dict[str, str]) -> None:
    expected = dict(EXPECTED, info=EXPECTED["info"][:4] + (labels,))
    assert seen == expected


def test_sync_scenario(url: str, label: dict[str, str]) -> None:
    check(sync_scenario(url, label), label)


async def test_async_scenario_matches_sync(url: str, label: dict[str, str]) -> None:
    check(await async_scenario(url, label), label)
