"""The sans-IO core on its own: error mapping, exec stream state, retries,
and that the sync API is the generated twin of the async one."""

from __future__ import annotations

import base64
import inspect
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import warren
from warren import _core

PYTHON_DIR = Path(__file__).resolve().parents[1]


def answer(status: int, **body: object) -> warren.WarrenError:
    return _core.error_from_answer(status, json.dumps(body).encode())


def test_every_server_error_code_has_its_class() -> None:
    """The server's error codes, from its checked-in OpenAPI document: a new
    code must get a class here, not fall through to a generic error."""
    spec = json.loads((PYTHON_DIR.parent / "docs" / "openapi.json").read_text())
    codes = set(spec["components"]["schemas"]["ErrorCode"]["enum"])
    assert codes - set(_core._BY_CODE) == set()


def test_error_codes_map_to_classes_with_the_servers_fields() -> None:
    e = answer(400, code="invalid_request", message="must be between 16 and 1048576", field="memory_mib")
    assert isinstance(e, warren.InvalidRequest) and e.field == "memory_mib" and e.status == 400
    assert isinstance(answer(404, code="file_not_found", message="x", field="path"), warren.NotFound)
    assert isinstance(answer(404, code="image_not_found", message="x"), warren.ImageNotFound)
    assert isinstance(answer(409, code="idempotency_conflict", message="x"), warren.Conflict)
    assert isinstance(answer(503, code="capacity_exceeded", message="node is full"), warren.QuotaExceeded)
    assert isinstance(answer(429, message="slow down"), warren.QuotaExceeded)
    assert isinstance(answer(507, code="no_space", message="full"), warren.QuotaExceeded)
    assert isinstance(answer(500, code="internal", message="boom"), warren.ServerError)
    assert isinstance(_core.error_from_answer(502, b"<html>bad gateway</html>"), warren.ServerError)


def test_ended_sandbox_errors_carry_the_end_reason() -> None:
    e = answer(410, code="sandbox_ended", message="sandbox sb-1 has ended (IdleTimeout)")
    assert isinstance(e, warren.SandboxGone)
    assert e.reason == warren.EndReason.IDLE_TIMEOUT
    structured = answer(410, code="sandbox_ended", message="gone", reason="oom")
    assert isinstance(structured, warren.SandboxGone) and structured.reason == warren.EndReason.OOM


def test_unsupported_errors_name_the_backend() -> None:
    e = answer(501, code="unsupported_backend", message="backend `microvm` is not supported by this node yet")
    assert isinstance(e, warren.Unsupported) and e.backend == "microvm"


def frame(**f: object) -> str:
    return json.dumps(f)


def out(stream: str, offset: int, data: bytes) -> str:
    return frame(type="output", stream=stream, offset=offset, data_b64=base64.b64encode(data).decode())


END = frame(
    type="end",
    result={
        "exec_id": "ex-1",
        "status": "ok",
        "exit_code": 0,
        "wall_time_secs": 0.5,
        "cpu_time_secs": 0.1,
        "peak_memory_bytes": 10,
        "started_at_ms": 1,
    },
)


def test_exec_stream_resumes_from_the_offsets_reached_and_drops_repeats() -> None:
    s = _core.ExecStream("sb-1")
    assert not s.can_resume
    s.feed(frame(type="started", exec_id="ex-1"))
    s.feed(out("stdout", 0, b"hello "))
    s.feed(out("stderr", 0, b"e"))
    resume = s.resume_request()
    assert resume.path == "/v1/sandboxes/sb-1/exec/ex-1/stream"
    assert resume.params == {"stdout_offset": "6", "stderr_offset": "1"} and resume.idempotent
    # A resumed stream that overlaps what was seen yields only the new bytes.
    frames = s.feed(out("stdout", 3, b"lo world"))
    assert frames == [warren.Output(warren.StreamName.STDOUT, 6, b"world")]
    assert s.feed(out("stdout", 0, b"hello")) == []
    [end] = s.feed(END)
    assert isinstance(end, warren.End) and s.done and not s.can_resume
    assert end.result.stdout == "hello world" and end.result.stderr == "e" and end.result.ok


def test_exec_capture_keeps_head_and_tail_within_the_cap() -> None:
    s = _core.ExecStream("sb-1", output_cap_bytes=10)
    for i in range(10):
        s.feed(out("stdout", i * 10, bytes([48 + i]) * 10))
    s.feed(frame(type="gap", stream="stdout", offset=100, dropped_bytes=50))
    s.feed(out("stdout", 150, b"END"))
    [end] = s.feed(END)
    r = end.result
    assert r.stdout_bytes == b"00000" + b"99END"
    assert r.stdout_total_bytes == 153 and r.stdout_dropped_bytes == 143


def test_utf8_split_across_frames_decodes_whole() -> None:
    s = _core.ExecStream("sb-1")
    snowman = "☃".encode()
    a, b = (
        warren.Output(warren.StreamName.STDOUT, 0, snowman[:1]),
        warren.Output(warren.StreamName.STDOUT, 1, snowman[1:]),
    )
    assert s.decode(a) + s.decode(b) == "☃"


def test_only_idempotent_calls_are_retried_after_the_request_left() -> None:
    policy = warren.RetryPolicy(attempts=3)
    post = _core.Request("POST", "/v1/sandboxes/x/sessions")
    get = _core.Request("GET", "/v1/sandboxes/x", idempotent=True)
    broken = httpx.RemoteProtocolError("Server disconnected")
    refused = httpx.ConnectError("refused")
    assert policy.should_retry(get, broken, 0) and not policy.should_retry(post, broken, 0)
    assert policy.should_retry(post, refused, 0), "a request that never left may always be sent again"
    assert not policy.should_retry(get, broken, 2), "attempts are bounded"
    delays = [policy.delay(n) for n in range(8)]
    assert all(policy.base_delay * 2**n / 2 <= d <= policy.base_delay * 2**n for n, d in enumerate(delays[:5]))
    assert max(delays) <= policy.max_delay


def test_creates_always_carry_an_idempotency_key_and_whole_seconds() -> None:
    kw = dict.fromkeys(inspect.signature(_core.create_request).parameters)
    r1 = _core.create_request(**{**kw, "idle_timeout": 0.2, "lifetime": 90.5})
    r2 = _core.create_request(**kw)
    assert r1.json["idempotency_key"] != r2.json["idempotency_key"] and r1.idempotent
    assert r1.json["idle_timeout_secs"] == 1 and r1.json["lifetime_secs"] == 91


def test_url_comes_from_the_argument_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WARREN_URL", raising=False)
    assert _core.resolve_url(None) == "http://127.0.0.1:7070"
    monkeypatch.setenv("WARREN_URL", "http://10.9.8.7:1/")
    assert _core.resolve_url(None) == "http://10.9.8.7:1"
    assert _core.resolve_url("http://h:2") == "http://h:2"


@pytest.mark.parametrize("tool", ["gen_sync.py", "gen_api_doc.py"])
def test_generated_files_are_up_to_date(tool: str) -> None:
    """_sync.py is generated from _async.py, the README's API reference from the docstrings."""
    done = subprocess.run([sys.executable, PYTHON_DIR / "tools" / tool, "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "sync_cls, async_cls",
    [
        (warren.Sandbox, warren.AsyncSandbox),
        (warren.Files, warren.AsyncFiles),
        (warren.Sessions, warren.AsyncSessions),
        (warren.Session, warren.AsyncSession),
        (warren.Client, warren.AsyncClient),
    ],
)
def test_sync_and_async_have_the_same_calls(sync_cls: type, async_cls: type) -> None:
    def calls(cls: type) -> dict[str, list[str]]:
        return {
            name: list(inspect.signature(fn).parameters)
            for name, fn in inspect.getmembers(cls, callable)
            if not name.startswith("_") and name not in ("aclose", "close")
        }

    assert calls(sync_cls) == calls(async_cls)
    for name, _ in inspect.getmembers(async_cls, inspect.iscoroutinefunction):
        if not name.startswith("_") and name != "aclose":
            assert not inspect.iscoroutinefunction(getattr(sync_cls, name)), name


def test_sandbox_info_carries_a_vms_accelerator() -> None:
    base = {
        "id": "sb-1", "backend": "microvm", "image": "i", "state": "running", "network": "none",
        "resources": {"cpus": 1.0, "memory_mib": 256, "disk_mib": 64, "pids": 64},
        "labels": {}, "idle_timeout_secs": 60, "lifetime_secs": 60, "created_at_ms": 1, "last_activity_at_ms": 1,
    }
    assert warren.SandboxInfo.from_json({**base, "accelerator": "tcg"}).accelerator == "tcg"
    assert warren.SandboxInfo.from_json({**base, "backend": "container"}).accelerator is None
