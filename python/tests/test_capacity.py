"""A full node: QuotaExceeded from a real server started with
``--max-sandboxes 2``, and create_many's per-item results."""

from __future__ import annotations

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


async def test_create_many_on_a_full_node_reports_the_items_that_did_not_fit(small_server: Server) -> None:
    made = await warren.AsyncSandbox.create_many(4, IMAGE, url=small_server.url, memory_mib=64, concurrency=1)
    fitted = [s for s in made if isinstance(s, warren.AsyncSandbox)]
    refused = [e for e in made if isinstance(e, warren.QuotaExceeded)]
    assert len(fitted) == 2 and len(refused) == 2, made
    for sb in fitted:
        await sb.delete()
