"""Errors from the real server arrive as typed exceptions with the server's
code, message and field."""

from __future__ import annotations

import asyncio
import uuid

import pytest

import warren
from conftest import IMAGE, running_server


def test_out_of_range_parameters_name_their_field(url: str) -> None:
    with pytest.raises(warren.InvalidRequest) as e:
        warren.Sandbox.create(IMAGE, url=url, memory_mib=1)
    assert e.value.field == "memory_mib" and e.value.code == "invalid_request" and e.value.status == 400
    with pytest.raises(warren.InvalidRequest) as e:
        warren.Sandbox.create(IMAGE, url=url, env={"A=B": "x"})
    assert e.value.field == "env.A=B"
    with pytest.raises(warren.InvalidRequest) as e:
        warren.Sandbox.create(IMAGE, url=url, idle_timeout=0)
    assert e.value.field == "idle_timeout_secs"


async def test_bad_exec_parameters_name_their_field(url: str) -> None:
    async with await warren.AsyncSandbox.create(IMAGE, url=url, memory_mib=64) as sb:
        with pytest.raises(warren.InvalidRequest) as e:
            await sb.exec("true", cwd="relative")
        assert e.value.field == "cwd"
        with pytest.raises(warren.InvalidRequest) as e:
            await sb.exec("true", timeout=-1)
        assert e.value.field == "timeout_secs"
        with pytest.raises(warren.InvalidRequest) as e:
            await sb.exec(["/no/such/program"])
        assert e.value.field == "argv"


def test_unknown_ids_raise_not_found(url: str) -> None:
    with pytest.raises(warren.NotFound) as e:
        warren.Sandbox.connect("sb-does-not-exist", url=url)
    assert e.value.code == "not_found" and e.value.status == 404
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=64) as sb:
        with pytest.raises(warren.FileNotFound) as fe:
            sb.files.read("/no/such/file")
        assert fe.value.field == "path"
        with pytest.raises(warren.NotFound):
            sb.exec_result("ex-nope")
        with pytest.raises(warren.NotFound):
            sb.sessions.run("se-nope", "true")


def test_unknown_images_are_refused_naming_the_image_field(url: str) -> None:
    # The server checks the image at create time: a bad request, not a missing resource.
    with pytest.raises(warren.InvalidRequest) as e:
        warren.Sandbox.create("no-such-image", url=url)
    assert e.value.field == "image"


async def test_a_deleted_sandbox_raises_sandbox_gone_with_the_reason(url: str) -> None:
    sb = await warren.AsyncSandbox.create(IMAGE, url=url, memory_mib=64)
    final = await sb.delete()
    assert final.state == warren.SandboxState.ENDED and final.end_reason == warren.EndReason.DELETED
    with pytest.raises(warren.SandboxGone) as e:
        await sb.exec("true")
    assert e.value.reason == warren.EndReason.DELETED and e.value.status == 410
    with pytest.raises(warren.SandboxGone):
        await sb.files.write("/tmp/x", "x")
    # Deleting again is harmless: it answers with the final record.
    assert (await sb.delete()).end_reason == warren.EndReason.DELETED


def test_backends_the_server_cannot_run_raise_unsupported_naming_them() -> None:
    # This host runs every backend: a server of its own is told not to offer two.
    with running_server("novms", "--disable-backend", "microvm", "--disable-backend", "vm") as srv:
        for backend in ("microvm", "vm"):
            with pytest.raises(warren.Unsupported) as e:
                warren.Sandbox.create(IMAGE, url=srv.url, backend=backend)
            assert e.value.backend == backend and e.value.code == "unsupported_backend"


def test_an_idempotency_key_reused_with_other_parameters_conflicts(url: str) -> None:
    key = f"k-{uuid.uuid4()}"
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=64, idempotency_key=key):
        with pytest.raises(warren.Conflict) as e:
            warren.Sandbox.create(IMAGE, url=url, memory_mib=96, idempotency_key=key)
        assert e.value.field == "idempotency_key"


def test_an_unreachable_server_raises_a_connection_error_after_retries() -> None:
    # Port 9 on loopback (discard): nothing listens there in the test machine.
    client = warren.Client("http://127.0.0.1:9", retry=warren.RetryPolicy(attempts=2, base_delay=0.01))
    with pytest.raises(warren.WarrenConnectionError):
        warren.Sandbox.list(client=client)
    client.close()


async def test_an_idle_sandbox_ends_and_raises_sandbox_gone_with_idle_timeout(url: str) -> None:
    sb = await warren.AsyncSandbox.create(IMAGE, url=url, memory_mib=64, idle_timeout=1)
    # Bounded wait for the reaper (no timing assertion: only that it happens).
    for _ in range(600):
        if (await sb.info()).state == warren.SandboxState.ENDED:
            break
        await asyncio.sleep(0.1)
    assert sb.last_info.end_reason == warren.EndReason.IDLE_TIMEOUT
    with pytest.raises(warren.SandboxGone) as e:
        await sb.exec("true")
    assert e.value.reason == warren.EndReason.IDLE_TIMEOUT
