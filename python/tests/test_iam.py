"""API keys against a real ``warren serve --auth on``: no key raises
Unauthorized, ``api_key=`` and ``$WARREN_API_KEY`` are sent as the bearer
token, another project's sandbox is NotFound, and a create past the
project's quota raises QuotaExceeded naming the quota."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

import warren
from conftest import IMAGE, Server, running_server


@pytest.fixture(scope="module")
def auth_server() -> Iterator[Server]:
    with running_server("auth", "--auth", "on") as srv:
        yield srv


def _project_key(server: Server, name: str, quota: dict[str, object]) -> tuple[str, str]:
    """A new project (made with the admin key) and a key of it."""
    made = httpx.post(
        f"{server.url}/v1/projects", json={"name": name, "quota": quota}, headers=server.headers, timeout=60
    )
    assert made.status_code == 201, made.text
    project = made.json()["id"]
    key = httpx.post(f"{server.url}/v1/projects/{project}/keys", json={}, headers=server.headers, timeout=60)
    assert key.status_code == 201, key.text
    return project, key.json()["secret"]


def test_no_key_raises_unauthorized(auth_server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WARREN_API_KEY", raising=False)
    with pytest.raises(warren.Unauthorized) as e:
        warren.Sandbox.create(IMAGE, url=auth_server.url, memory_mib=64)
    assert (e.value.code, e.value.status) == ("unauthorized", 401)
    with pytest.raises(warren.Unauthorized):
        warren.Sandbox.list(url=auth_server.url, api_key="wrn_not_a_key")


def test_api_key_argument_and_environment_act_as_the_keys_project(
    auth_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WARREN_API_KEY", raising=False)
    url = auth_server.url
    mine, my_key = _project_key(auth_server, "sdk-mine", {})
    _, their_key = _project_key(auth_server, "sdk-theirs", {})
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=64, api_key=my_key) as sb:
        assert sb.last_info.project == mine
        assert sb.exec("true").ok
        with pytest.raises(warren.NotFound):
            warren.Sandbox.connect(sb.id, url=url, api_key=their_key)
        assert sb.id not in [s.id for s in warren.Sandbox.list(url=url, api_key=their_key)]
        # The environment variable is the default key.
        monkeypatch.setenv("WARREN_API_KEY", my_key)
        assert warren.Sandbox.connect(sb.id, url=url).id == sb.id
        with warren.Client(url) as client:
            assert [s.id for s in warren.Sandbox.list(client=client)] == [sb.id]


async def test_a_create_past_the_quota_raises_quota_exceeded(
    auth_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WARREN_API_KEY", raising=False)
    project, key = _project_key(auth_server, "sdk-small", {"sandboxes": 1})
    async with warren.AsyncClient(auth_server.url, api_key=key) as client:
        async with await warren.AsyncSandbox.create(IMAGE, memory_mib=64, client=client):
            with pytest.raises(warren.QuotaExceeded) as e:
                await warren.AsyncSandbox.create(IMAGE, memory_mib=64, client=client)
            assert (e.value.code, e.value.field, e.value.status) == ("quota_exceeded", "quota.sandboxes", 429)
            assert e.value.body["project"] == project
        # Room again once it is gone.
        async with await warren.AsyncSandbox.create(IMAGE, memory_mib=64, client=client) as sb:
            assert (await sb.exec("true")).ok
