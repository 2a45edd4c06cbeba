"""A full node: QuotaExceeded from a real server started with
``--max-sandboxes 2``, create_many waiting in the admission queue with its
position reported, and pause/resume."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

import warren
from conftest import IMAGE, Server, running_server


@pytest.fixture(scope="module")
def small_server() -> Iterator[Server]:
    # Its port is found past the main server's (taken) one: EADDRINUSE is retried.
    with running_server("small", "--max-sandboxes", "2") as srv:
        yield srv


def test_a_full_node_raises_quota_exceeded(small_server: Server) -> None:
    url = small_server.url
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=64), warren.Sandbox.create(IMAGE, url=url, memory_mib=64):
        with pytest.raises(warren.QuotaExceeded) as e:
            warren.Sandbox.create(IMAGE, url=url, memory_mib=64)
        assert e.value.code == "capacity_exceeded" and e.value.status == 503
    # Room again once they are gone.
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=64) as sb:
        assert sb.exec("true").ok


async def test_create_many_without_queue_reports_the_items_that_did_not_fit(small_server: Server) -> None:
    made = await warren.AsyncSandbox.create_many(4, IMAGE, url=small_server.url, memory_mib=64, queue=False)
    fitted = [s for s in made if isinstance(s, warren.AsyncSandbox)]
    refused = [e for e in made if isinstance(e, warren.QuotaExceeded)]
    assert len(fitted) == 2 and len(refused) == 2, made
    assert all(e.code == "capacity_exceeded" and e.status == 503 for e in refused)
    for sb in fitted:
        await sb.delete()


async def test_async_create_many_waits_in_the_queue_and_reports_its_position(small_server: Server) -> None:
    url = small_server.url
    holders = [await warren.AsyncSandbox.create(IMAGE, url=url, memory_mib=64) for _ in range(2)]
    positions: list[warren.QueuePosition] = []
    queued = asyncio.Event()

    async def on_queued(p: warren.QueuePosition) -> None:
        positions.append(p)
        queued.set()

    batch = asyncio.create_task(
        warren.AsyncSandbox.create_many(2, IMAGE, url=url, memory_mib=64, on_queued=on_queued)
    )
    await asyncio.wait_for(queued.wait(), 60)
    assert positions[0] == warren.QueuePosition(position=1, items_waiting=2), positions
    # Room appears: the queued items are admitted.
    for sb in holders:
        await sb.delete()
    made = await asyncio.wait_for(batch, 120)
    assert all(isinstance(s, warren.AsyncSandbox) for s in made), made
    assert [r.stdout for r in await asyncio.gather(*(s.exec("echo in") for s in made))] == ["in\n", "in\n"]
    for sb in made:
        await sb.delete()


def test_sync_create_many_waits_in_the_queue(small_server: Server) -> None:
    url = small_server.url
    holder = warren.Sandbox.create(IMAGE, url=url, memory_mib=64)
    other = warren.Sandbox.create(IMAGE, url=url, memory_mib=64)
    seen: list[warren.QueuePosition] = []
    # The holder goes once the batch reported it waits.
    queued = threading.Event()

    def on_queued(p: warren.QueuePosition) -> None:
        seen.append(p)
        queued.set()

    def free_room() -> None:
        if queued.wait(60):
            holder.delete()

    t = threading.Thread(target=free_room)
    t.start()
    try:
        made = warren.Sandbox.create_many(1, IMAGE, url=url, memory_mib=64, on_queued=on_queued)
    finally:
        t.join()
    assert seen and seen[0].position == 1, seen
    assert isinstance(made[0], warren.Sandbox), made
    assert made[0].exec("echo ok").stdout == "ok\n"
    made[0].delete()
    other.delete()


def test_pause_freezes_and_the_next_exec_resumes(small_server: Server) -> None:
    with warren.Sandbox.create(IMAGE, url=small_server.url, memory_mib=64) as sb:
        sb.exec("echo 1 > /tmp/n")
        info = sb.pause()
        assert info.state == warren.SandboxState.PAUSED
        assert sb.info().state == "paused"
        assert sb.pause().state == "paused"
        # The exec resumes it.
        assert sb.exec("cat /tmp/n").stdout == "1\n"
        assert sb.info().state == "running"
        sb.pause()
        assert sb.resume().state == "running"


def test_pause_to_disk_is_sent_and_a_container_refuses_it(small_server: Server) -> None:
    # Only a microVM pauses to disk: the server reads the flag and the
    # container backend answers `unsupported` (the VM suites test the rest).
    with warren.Sandbox.create(IMAGE, url=small_server.url, memory_mib=64) as sb:
        with pytest.raises(warren.Unsupported) as e:
            sb.pause(to_disk=True)
        assert e.value.code == "unsupported" and e.value.status == 501
        assert sb.info().state == "running"
        assert sb.info().boot is None


async def test_async_pause_and_resume(small_server: Server) -> None:
    async with await warren.AsyncSandbox.create(IMAGE, url=small_server.url, memory_mib=64) as sb:
        assert (await sb.pause()).state == "paused"
        assert (await sb.resume()).state == "running"
        await sb.pause()
        await sb.files.write("/tmp/x", "y")
        assert (await sb.info()).state == "running"


async def test_a_single_create_may_wait_in_the_queue(small_server: Server) -> None:
    url = small_server.url
    holders = [await warren.AsyncSandbox.create(IMAGE, url=url, memory_mib=64) for _ in range(2)]
    waiting = asyncio.create_task(warren.AsyncSandbox.create(IMAGE, url=url, memory_mib=64, queue=True))
    # It waits (the node is full) until a holder goes.
    done, _ = await asyncio.wait({waiting}, timeout=1.0)
    assert not done, "a queued create on a full node answered before room appeared"
    await holders[0].delete()
    sb = await asyncio.wait_for(waiting, 60)
    assert (await sb.exec("echo q")).stdout == "q\n"
    await sb.delete()
    await holders[1].delete()
