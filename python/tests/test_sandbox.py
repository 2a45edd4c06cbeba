"""Sandbox handles: context managers, listing, the server URL, sessions,
phases and egress policies."""

from __future__ import annotations

import asyncio

import pytest

import warren
from conftest import IMAGE


class Boom(Exception):
    pass


def test_with_deletes_the_sandbox_on_exit_also_after_an_error(url: str) -> None:
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=64) as sb:
        assert sb.info().state == warren.SandboxState.RUNNING
    assert warren.Sandbox.connect(sb.id, url=url).last_info.end_reason == warren.EndReason.DELETED
    with pytest.raises(Boom):
        with warren.Sandbox.create(IMAGE, url=url, memory_mib=64) as failing:
            raise Boom()
    assert failing.info().state == warren.SandboxState.ENDED


async def test_async_with_deletes_the_sandbox_on_exit_also_after_an_error(url: str) -> None:
    async with await warren.AsyncSandbox.create(IMAGE, url=url, memory_mib=64) as sb:
        pass
    assert (await sb.info()).end_reason == warren.EndReason.DELETED
    with pytest.raises(Boom):
        async with await warren.AsyncSandbox.create(IMAGE, url=url, memory_mib=64) as failing:
            raise Boom()
    assert (await failing.info()).state == warren.SandboxState.ENDED


def test_list_filters_on_every_label(url: str, label: dict[str, str]) -> None:
    with (
        warren.Sandbox.create(IMAGE, url=url, memory_mib=64, labels={**label, "role": "a"}) as a,
        warren.Sandbox.create(IMAGE, url=url, memory_mib=64, labels={**label, "role": "b"}) as b,
    ):
        assert sorted(i.id for i in warren.Sandbox.list(labels=label, url=url)) == sorted([a.id, b.id])
        assert [i.id for i in warren.Sandbox.list(labels={**label, "role": "b"}, url=url)] == [b.id]
        b.delete()
        running = warren.Sandbox.list(labels=label, state="running", url=url)
        assert [i.id for i in running] == [a.id]


def test_the_server_is_found_through_warren_url(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARREN_URL", url)
    with warren.Sandbox.create(IMAGE, memory_mib=64) as sb:
        assert sb.client.url == url
        assert warren.Client().health().status == "ok"


def test_sessions_keep_cwd_and_exports_but_not_across_sessions(url: str) -> None:
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=64, env={"BASE": "b"}) as sb:
        one = sb.sessions.create(cwd="/tmp", env={"S": "1"})
        two = sb.sessions.create()
        assert one.info is not None and one.info.cwd == "/tmp"
        one.run("mkdir -p work && cd work && export DEPTH=2")
        assert one.run("pwd; echo $BASE$S$DEPTH").stdout == "/tmp/work\nb12\n"
        assert two.run("pwd; echo x$DEPTH").stdout == "/root\nx\n", "a new session starts in HOME"
        # A command's own cwd and env apply to it; the directory it ends in sticks.
        assert one.run("pwd; echo $ONCE", cwd="/etc", env={"ONCE": "o"}).stdout == "/etc\no\n"
        assert sb.sessions.run(one.id, "pwd").stdout == "/etc\n"
        one.delete()
        with pytest.raises(warren.NotFound):
            one.run("true")
        assert [s.id for s in sb.sessions.list()] == [two.id]


def test_info_reports_resources_and_usage(url: str) -> None:
    with warren.Sandbox.create(IMAGE, url=url, cpus=0.5, memory_mib=96, disk_mib=64, pids=64, lifetime=120) as sb:
        info = sb.info()
        assert info.resources == warren.Resources(cpus=0.5, memory_mib=96, disk_mib=64, pids=64)
        assert info.lifetime == 120.0 and info.backend == warren.Backend.CONTAINER
        assert info.usage is not None and info.usage.pids >= 1


def _route_exists(e: warren.NotFound) -> bool:
    return e.message != "no such route"


def test_set_phase_switches_the_current_phase(url: str) -> None:
    phases = {"setup": {}, "grade": {"protected_paths": {"/answers": "read"}}}
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=64, phases=phases, phase="setup") as sb:
        assert sb.last_info.phase == "setup"
        try:
            switched = sb.set_phase("grade")
        except warren.NotFound as e:
            if _route_exists(e):
                raise
            pytest.skip("PUT /v1/sandboxes/{id}/phase is not on this server yet")
        assert switched.phase == "grade" and sb.info().phase == "grade"
        with pytest.raises(warren.InvalidRequest) as bad:
            sb.set_phase("no-such-phase")
        assert bad.value.field == "name"


def test_set_network_replaces_the_egress_policy(url: str) -> None:
    try:
        sb = warren.Sandbox.create(IMAGE, url=url, memory_mib=64, network="allowlist")
    except (warren.Unsupported, warren.InvalidRequest) as e:
        pytest.skip(f"allowlist networking is not on this server yet: {e}")
    with sb:
        rules = [{"cidr": "127.0.0.1/32", "ports": [8080]}]
        try:
            answered = sb.set_network(rules=rules)
        except warren.NotFound as e:
            if _route_exists(e):
                raise
            pytest.skip("PUT /v1/sandboxes/{id}/network is not on this server yet")
        assert answered.network_policy == sb.info().network_policy
        policy = answered.network_policy
        assert policy is not None and policy.get("rules") == [
            {"cidr": "127.0.0.1/32", "ports": [8080], "protocol": "tcp"}
        ]
        with pytest.raises(warren.InvalidRequest) as bad:
            sb.set_network(rules=[{"cidr": "not-an-address"}])
        assert bad.value.field is not None and bad.value.field.endswith("rules[0].cidr")


def test_create_many_reports_per_item_and_is_idempotent_per_batch(url: str, label: dict[str, str]) -> None:
    batch = f"batch-{label['test']}"
    # Item 2's key is already taken by a different request: that item fails, the others do not.
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=96, idempotency_key=f"{batch}-2") as squatter:
        made = warren.Sandbox.create_many(4, IMAGE, url=url, memory_mib=64, labels=label, batch_key=batch)
        assert isinstance(made[2], warren.Conflict)
        ok = [s for s in made if isinstance(s, warren.Sandbox)]
        assert len(ok) == 3 and len({s.id for s in ok}) == 3
        # Re-issued after a "preemption": the same sandboxes, no new ones.
        again = warren.Sandbox.create_many(4, IMAGE, url=url, memory_mib=64, labels=label, batch_key=batch)
        assert [s.id for s in again if isinstance(s, warren.Sandbox)] == [s.id for s in ok]
        assert sorted(i.id for i in warren.Sandbox.list(labels=label, url=url)) == sorted(s.id for s in ok)
        assert squatter.id not in {s.id for s in ok}
        for s in ok:
            s.delete()


async def test_async_create_many_makes_every_item(url: str, label: dict[str, str]) -> None:
    made = await warren.AsyncSandbox.create_many(6, IMAGE, url=url, memory_mib=64, labels=label)
    sandboxes = [s for s in made if isinstance(s, warren.AsyncSandbox)]
    assert len(sandboxes) == 6, made
    results = await asyncio.gather(*(s.exec(f"echo {i}") for i, s in enumerate(sandboxes)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]
    await asyncio.gather(*(s.delete() for s in sandboxes))
    assert await warren.AsyncSandbox.list(labels=label, state="running", url=url) == []


async def test_many_sandboxes_share_one_client_concurrently(url: str, label: dict[str, str]) -> None:
    n = 128
    made = await warren.AsyncSandbox.create_many(n, IMAGE, url=url, memory_mib=32, labels=label)
    sandboxes = [s for s in made if isinstance(s, warren.AsyncSandbox)]
    try:
        assert len(sandboxes) == n, [e for e in made if not isinstance(e, warren.AsyncSandbox)]
        assert len({id(s.client) for s in sandboxes}) == 1, "sandboxes made without client= share one pool"

        async def work(i: int, sb: warren.AsyncSandbox) -> str:
            await sb.files.write("/tmp/n", str(i))
            return (await sb.exec("cat /tmp/n; echo; sleep 0.2")).stdout

        outputs = await asyncio.gather(*(work(i, sb) for i, sb in enumerate(sandboxes)))
        assert outputs == [f"{i}\n" for i in range(n)]
    finally:
        await asyncio.gather(*(s.delete() for s in sandboxes))
