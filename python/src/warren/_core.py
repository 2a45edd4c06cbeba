"""The sans-IO core shared by the sync and the async API.

Owns: building every request (paths, query, JSON bodies, unit conversion),
reading every answer (records, error bodies -> exception classes), the exec
stream's state (offsets to resume from, bounded output capture, the final
result) and the retry policy. It performs no I/O, so ``Sandbox`` and
``AsyncSandbox`` cannot drift: they only move these requests and answers.
"""

from __future__ import annotations

import base64
import inspect
import codecs
import dataclasses
import json
import math
import os
import random
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from . import errors
from .trajectory import STEP_HEADER
from .types import (
    End,
    EndReason,
    ExecFrame,
    ExecResult,
    ExecStatus,
    FunctionResult,
    FunctionTimings,
    Gap,
    Output,
    Started,
    StreamName,
    _enum,
)

__version__ = "0.1.0"
DEFAULT_URL = "http://127.0.0.1:7070"
URL_ENV = "WARREN_URL"
#: The API key every client sends when none is given (``--auth on`` servers need one).
API_KEY_ENV = "WARREN_API_KEY"
#: The server's per-stream capture cap when a request names none.
DEFAULT_OUTPUT_CAP_BYTES = 1 << 20
#: Upload and download chunk size: memory use of a transfer is about this.
CHUNK_BYTES = 1 << 20


def resolve_url(url: str | None) -> str:
    """``url=`` first, then ``$WARREN_URL``, then the embedded server's default."""
    return (url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")


def resolve_api_key(api_key: str | None) -> str | None:
    """``api_key=`` first, then ``$WARREN_API_KEY``; ``None`` sends no key."""
    return api_key or os.environ.get(API_KEY_ENV) or None


# ---- requests ----------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One HTTP call, before it is sent."""

    method: str
    path: str
    params: Mapping[str, str] | None = None
    json: Any = None
    #: Safe to send again after a broken connection (the server's answer is
    #: the same, or the call carries an idempotency key).
    idempotent: bool = False
    #: A long-lived answer (exec streams, transfers): no read timeout.
    long: bool = False
    #: Makes a fresh body for each attempt (uploads), so a retry re-reads it.
    body: Callable[[], Any] | None = None
    headers: Mapping[str, str] | None = None

    def httpx_args(self, timeout: httpx.Timeout) -> dict[str, Any]:
        args: dict[str, Any] = {"method": self.method, "url": self.path}
        if self.params:
            args["params"] = dict(self.params)
        if self.json is not None:
            args["json"] = self.json
        if self.body is not None:
            args["content"] = self.body()
        if self.headers:
            args["headers"] = dict(self.headers)
        args["timeout"] = httpx.Timeout(timeout.connect, read=None, write=None, pool=None) if self.long else timeout
        return args


def _secs(name: str, value: float | None) -> int | None:
    """Seconds (float) -> the API's whole seconds, rounded up so a short
    positive timeout never becomes 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise errors.InvalidRequest(f"`{name}` must be a number of seconds", code="invalid_request", field=name)
    return int(math.ceil(value)) if value > 0 else int(value)


def _enum_value(value: Any) -> Any:
    return value.value if hasattr(value, "value") else value


def sandbox_path(sandbox_id: str, rest: str = "") -> str:
    if not sandbox_id or "/" in sandbox_id:
        raise errors.InvalidRequest("a sandbox id is non-empty and has no `/`", code="invalid_request", field="id")
    return f"/v1/sandboxes/{sandbox_id}{rest}"


def create_request(
    *,
    image: str | None,
    backend: Any,
    cpus: float | None,
    memory_mib: int | None,
    disk_mib: int | None,
    pids: int | None,
    idle_timeout: float | None,
    lifetime: float | None,
    env: Mapping[str, str] | None,
    labels: Mapping[str, str] | None,
    network: Any,
    network_policy: Mapping[str, Any] | None,
    phases: Mapping[str, Any] | None,
    phase: str | None,
    idempotency_key: str | None,
    project: str | None = None,
) -> Request:
    body: dict[str, Any] = {"idempotency_key": idempotency_key or str(uuid.uuid4())}
    optional = {
        "image": image,
        "backend": _enum_value(backend),
        "cpus": cpus,
        "memory_mib": memory_mib,
        "disk_mib": disk_mib,
        "pids": pids,
        "idle_timeout_secs": _secs("idle_timeout", idle_timeout),
        "lifetime_secs": _secs("lifetime", lifetime),
        "env": dict(env) if env else None,
        "labels": dict(labels) if labels else None,
        "network": _enum_value(network),
        "network_policy": dict(network_policy) if network_policy is not None else None,
        "phases": dict(phases) if phases else None,
        "phase": phase,
        "project": project,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    # The key makes a resent create answer with the sandbox the first one made.
    return Request("POST", "/v1/sandboxes", json=body, idempotent=True)


def queued_create(request: Request) -> Request:
    """A create that waits in the node's admission queue while it is full:
    no read timeout, the wait may be long."""
    return dataclasses.replace(request, params={"queue": "true"}, long=True)


def batch_request(n: int, image: str | None, params: Mapping[str, Any], batch_key: str, queue: bool) -> Request:
    """``POST /v1/sandboxes/batch`` of ``n`` sandboxes made as ``create``
    would make one from ``image`` and ``params``. Item ``i`` gets the
    idempotency key ``{batch_key}-{i}``, so sending the batch again makes
    nothing new."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise errors.InvalidRequest("n must be a whole number >= 1", code="invalid_request", field="n")
    if "idempotency_key" in params:
        raise errors.InvalidRequest(
            "items take their keys from `batch_key`", code="invalid_request", field="idempotency_key"
        )
    fields = dict.fromkeys(inspect.signature(create_request).parameters)
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise TypeError(f"create_many() got unexpected keyword arguments {unknown}")
    fields.update(backend="container", **params, image=image)
    template = create_request(**fields).json
    body = {k: v for k, v in template.items() if k != "idempotency_key"}
    return Request(
        "POST",
        "/v1/sandboxes/batch",
        json={"count": n, "template": body, "batch_key": batch_key, "queue": queue},
        idempotent=True,
        long=True,
    )


# The HTTP status each error code answers with (a batch item's error has no status of its own).
_STATUS_OF_CODE: dict[str, int] = {
    "invalid_request": 400,
    "unsupported_backend": 501,
    "unsupported": 501,
    "not_found": 404,
    "image_not_found": 404,
    "sandbox_ended": 410,
    "idempotency_conflict": 409,
    "capacity_exceeded": 503,
    "queue_full": 429,
    "limit_reached": 429,
    "timed_out": 504,
    "internal": 500,
}


def batch_item_error(body: Mapping[str, Any]) -> errors.WarrenError:
    """The exception for a failed batch item, from its ``error`` object."""
    code = str(body.get("code") or "internal")
    return error_from_answer(_STATUS_OF_CODE.get(code, 500), json.dumps(dict(body)).encode())


def list_request(labels: Mapping[str, str] | None, state: Any) -> Request:
    params: dict[str, str] = {}
    # The server filters on one label; the others are checked by `filter_labels`.
    if labels:
        k, v = next(iter(labels.items()))
        params["label"] = f"{k}={v}"
    if state is not None:
        params["state"] = _enum_value(state)
    return Request("GET", "/v1/sandboxes", params=params, idempotent=True)


def filter_labels(infos: list[Any], labels: Mapping[str, str] | None) -> list[Any]:
    if not labels:
        return infos
    return [i for i in infos if all(i.labels.get(k) == v for k, v in labels.items())]


def exec_request(
    sandbox_id: str,
    cmd: str | Sequence[str],
    *,
    session_id: str | None = None,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    stdin: str | bytes | None = None,
    timeout: float | None = None,
    output_cap_bytes: int | None = None,
) -> Request:
    body: dict[str, Any] = {}
    if isinstance(cmd, str):
        body["command"] = cmd
    elif isinstance(cmd, (bytes, bytearray)):
        raise errors.InvalidRequest("give the command as str or a list of str", code="invalid_request", field="command")
    else:
        body["argv"] = [str(a) for a in cmd]
    if cwd is not None:
        body["cwd"] = cwd
    if env:
        body["env"] = dict(env)
    if isinstance(stdin, str):
        body["stdin"] = stdin
    elif stdin is not None:
        body["stdin_b64"] = base64.b64encode(bytes(stdin)).decode("ascii")
    if timeout is not None:
        body["timeout_secs"] = float(timeout)
    if output_cap_bytes is not None:
        body["output_cap_bytes"] = output_cap_bytes
    rest = f"/sessions/{session_id}/exec" if session_id else "/exec"
    return Request("POST", sandbox_path(sandbox_id, rest), json=body, long=True)


def run_function_request(
    code: str | None,
    *,
    language: Any,
    command: str | Sequence[str] | None,
    image: str | None,
    args: Sequence[str],
    stdin: str | bytes | None,
    files: Mapping[str, str | bytes] | None,
    fetch: Sequence[str],
    env: Mapping[str, str] | None,
    cwd: str | None,
    timeout: float | None,
    memory_mib: int | None,
    cpus: float | None,
    output_cap_bytes: int | None,
) -> Request:
    """``POST /v1/functions/run``. Not retried after a broken connection: the
    code would run twice."""
    body: dict[str, Any] = {}
    if code is not None:
        body["code"] = code
        if language is not None:
            body["language"] = _enum_value(language)
    elif language is not None:
        body["language"] = _enum_value(language)
    if isinstance(command, str):
        body["command"] = command
    elif command is not None:
        body["argv"] = [str(a) for a in command]
    if args:
        body["args"] = [str(a) for a in args]
    if isinstance(stdin, str):
        body["stdin"] = stdin
    elif stdin is not None:
        body["stdin_b64"] = base64.b64encode(bytes(stdin)).decode("ascii")
    for path, content in (files or {}).items():
        if isinstance(content, str):
            body.setdefault("files", {})[path] = content
        else:
            body.setdefault("files_b64", {})[path] = base64.b64encode(bytes(content)).decode("ascii")
    optional = {
        "image": image,
        "fetch": [str(p) for p in fetch] if fetch else None,
        "env": dict(env) if env else None,
        "cwd": cwd,
        "timeout_secs": float(timeout) if timeout is not None else None,
        "memory_mib": memory_mib,
        "cpus": cpus,
        "output_cap_bytes": output_cap_bytes,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    return Request("POST", "/v1/functions/run", json=body, long=True)


def function_result_from_json(r: Mapping[str, Any]) -> FunctionResult:
    files: dict[str, bytes | None] = {}
    status: dict[str, str] = {}
    for path, f in (r.get("files") or {}).items():
        status[path] = f.get("status", "missing")
        data = f.get("data_b64")
        files[path] = base64.b64decode(data) if data is not None else None
    return FunctionResult(
        exec=exec_result_from_json(r["exec"]),
        files=files,
        file_status=status,
        timings=FunctionTimings.from_json(r.get("timings") or {}),
        warm_worker=bool(r.get("warm_worker", False)),
    )


def resume_request(sandbox_id: str, exec_id: str, stdout_offset: int, stderr_offset: int) -> Request:
    return Request(
        "GET",
        sandbox_path(sandbox_id, f"/exec/{exec_id}/stream"),
        params={"stdout_offset": str(stdout_offset), "stderr_offset": str(stderr_offset)},
        idempotent=True,
        long=True,
    )


def file_params(path: str, **extra: Any) -> dict[str, str]:
    params = {"path": path}
    for k, v in extra.items():
        if v is None or v is False:
            continue
        params[k] = "true" if v is True else (format(v, "o") if k == "mode" and isinstance(v, int) else str(v))
    return params


def with_step(request: Request, step: int) -> Request:
    """``request`` as trajectory step ``step``. Safe to send again after a
    broken connection: the server answers a logged step from its log (and
    joins a running one) instead of running it twice."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise errors.InvalidRequest("a step is a whole number >= 1", code="invalid_request", field="step")
    headers = {**(request.headers or {}), STEP_HEADER: str(step)}
    return dataclasses.replace(request, headers=headers, idempotent=True)


def upload_headers(size: int | None) -> dict[str, str]:
    headers = {"Content-Type": "application/octet-stream"}
    if size is not None:
        headers["Content-Length"] = str(size)
    return headers


# ---- answers -----------------------------------------------------------------


def json_body(response: httpx.Response) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError as e:
        raise errors.ServerError(
            f"the server answered {response.status_code} with a body that is not JSON",
            code="bad_answer",
            status=response.status_code,
        ) from e


_BY_CODE: dict[str, type[errors.WarrenError]] = {
    "invalid_request": errors.InvalidRequest,
    "unsupported_backend": errors.Unsupported,
    "unsupported": errors.Unsupported,
    "not_found": errors.NotFound,
    "file_not_found": errors.FileNotFound,
    "image_not_found": errors.ImageNotFound,
    "sandbox_ended": errors.SandboxGone,
    "idempotency_conflict": errors.Conflict,
    "file_conflict": errors.Conflict,
    "image_in_use": errors.Conflict,
    "trajectory_diverged": errors.TrajectoryDiverged,
    "capacity_exceeded": errors.QuotaExceeded,
    "no_space": errors.NoSpace,
    "limit_reached": errors.QuotaExceeded,
    "queue_full": errors.QuotaExceeded,
    "quota_exceeded": errors.QuotaExceeded,
    "unauthorized": errors.Unauthorized,
    "forbidden": errors.Unauthorized,
    "registry_unavailable": errors.ServerError,
    # The registry's credentials (field `auth`), not this API's: the caller fixes the request.
    "registry_auth_required": errors.InvalidRequest,
    "registry_auth_failed": errors.InvalidRequest,
    "store_unavailable": errors.ServerError,
    "node_unavailable": errors.ServerError,
    "timed_out": errors.ServerError,
    "internal": errors.ServerError,
}

_BY_STATUS: dict[int, type[errors.WarrenError]] = {
    400: errors.InvalidRequest,
    401: errors.Unauthorized,
    403: errors.Unauthorized,
    404: errors.NotFound,
    409: errors.Conflict,
    410: errors.SandboxGone,
    429: errors.QuotaExceeded,
    501: errors.Unsupported,
    503: errors.QuotaExceeded,
    507: errors.NoSpace,
}


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def end_reason_of(message: str, body: Mapping[str, Any]) -> Any:
    """The end reason of a `sandbox_ended` answer: a structured `reason`
    when the server sends one, else the `(Reason)` its message ends with."""
    raw = body.get("reason") or body.get("end_reason")
    if raw is None:
        m = re.search(r"\((\w+)\)\s*$", message)
        raw = _snake(m.group(1)) if m else None
    return _enum(EndReason, raw) if raw is not None else None


def error_from_answer(status: int, content: bytes, *, backend: str | None = None) -> errors.WarrenError:
    """The exception for a non-2xx answer, from its `{code, message, field}` body."""
    try:
        body = json.loads(content) if content else {}
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    code = str(body.get("code") or f"http_{status}")
    message = str(body.get("message") or content[:500].decode("utf-8", errors="replace") or f"HTTP {status}")
    field_name = body.get("field")
    cls = _BY_CODE.get(code) or _BY_STATUS.get(status) or (errors.ServerError if status >= 500 else errors.WarrenError)
    kw: dict[str, Any] = {"code": code, "field": field_name, "status": status, "body": body}
    if cls is errors.SandboxGone:
        return errors.SandboxGone(message, reason=end_reason_of(message, body), **kw)
    if cls is errors.TrajectoryDiverged:
        d = body.get("divergence") if isinstance(body.get("divergence"), dict) else {}
        return errors.TrajectoryDiverged(message, step=d.get("step"), expected=d.get("expected"), got=d.get("got"), **kw)
    if cls is errors.Unsupported:
        named = re.search(r"backend `(\w+)`", message)
        return errors.Unsupported(message, backend=named.group(1) if named else backend, **kw)
    return cls(message, **kw)


def transport_error(e: httpx.TransportError, request: Request) -> errors.WarrenError:
    what = f"{request.method} {request.path}"
    if isinstance(e, httpx.TimeoutException):
        return errors.Timeout(f"{what} timed out: {e}", code="timeout")
    return errors.WarrenConnectionError(f"{what} failed: {type(e).__name__}: {e}", code="connection_error")


# ---- retries -----------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for broken connections.

    Idempotent calls (GET, PUT, DELETE, creates with their idempotency key,
    exec stream resumption, and every call with a trajectory step, which the
    server answers from its log when it sees the step again) are retried on
    any transport error; every call
    is retried when the connection could not even be opened (the request
    never left). Answers from the server (4xx, 5xx) are never retried.
    """

    attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 5.0

    def delay(self, attempt: int) -> float:
        ceiling = min(self.max_delay, self.base_delay * 2.0**attempt)
        # "Equal jitter": never less than half the ceiling, so a fleet of
        # clients spreads out without retrying at once.
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    def should_retry(self, request: Request, error: BaseException, attempt: int) -> bool:
        if attempt + 1 >= self.attempts:
            return False
        if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)):
            return True
        return request.idempotent and isinstance(error, (httpx.TransportError, StreamCut))


class StreamCut(Exception):
    """A stream's body ended before its last frame."""


# ---- exec streams ------------------------------------------------------------


class _Capture:
    """Head and rolling tail of one stream, like the server keeps: memory is
    bounded by ``cap`` whatever the command prints."""

    def __init__(self, cap: int) -> None:
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.dropped = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def append(self, data: bytes) -> None:
        self.total += len(data)
        if len(self.head) < self.head_cap:
            take = min(len(data), self.head_cap - len(self.head))
            self.head += data[:take]
            data = data[take:]
        self.tail += data
        over = len(self.tail) - self.tail_cap
        if over > 0:
            del self.tail[:over]
            self.dropped += over

    def skip(self, n: int) -> None:
        self.total += n
        self.dropped += n

    def kept(self) -> bytes:
        return bytes(self.head + self.tail)


@dataclass
class ExecStream:
    """The client's view of one exec stream, across reconnects.

    Feed it the stream's lines; it yields typed frames, remembers the byte
    offset reached in each stream (so a broken connection resumes there
    instead of running the command again) and builds the final result.
    """

    sandbox_id: str
    output_cap_bytes: int = DEFAULT_OUTPUT_CAP_BYTES
    exec_id: str | None = None
    offsets: dict[StreamName, int] = field(default_factory=lambda: {StreamName.STDOUT: 0, StreamName.STDERR: 0})
    result: ExecResult | None = None

    def __post_init__(self) -> None:
        self._captures = {s: _Capture(self.output_cap_bytes) for s in StreamName}

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def can_resume(self) -> bool:
        return self.exec_id is not None and not self.done

    def resume_request(self) -> Request:
        assert self.exec_id is not None
        return resume_request(
            self.sandbox_id, self.exec_id, self.offsets[StreamName.STDOUT], self.offsets[StreamName.STDERR]
        )

    def feed(self, line: str | bytes) -> list[ExecFrame]:
        """The frames one NDJSON line carries that the caller has not seen
        (an empty list for blank lines, unknown frame types and repeats)."""
        if isinstance(line, bytes):
            line = line.decode("utf-8", errors="replace")
        if not line.strip():
            return []
        try:
            raw = json.loads(line)
        except ValueError as e:
            raise errors.ServerError(f"bad exec frame: {line[:200]!r}", code="bad_answer") from e
        kind = raw.get("type")
        if kind == "started":
            self.exec_id = raw["exec_id"]
            return [Started(raw["exec_id"])]
        if kind == "output":
            return self._output(_enum(StreamName, raw["stream"]), raw["offset"], base64.b64decode(raw["data_b64"]))
        if kind == "gap":
            return self._gap(_enum(StreamName, raw["stream"]), raw["offset"], raw["dropped_bytes"])
        if kind == "end":
            self.result = self._finish(raw["result"])
            return [End(self.result)]
        return []

    def _output(self, stream: StreamName, offset: int, data: bytes) -> list[ExecFrame]:
        reached = self.offsets[stream]
        if offset + len(data) <= reached:
            return []
        frames: list[ExecFrame] = []
        if offset > reached:
            # Bytes the server no longer had when we (re)joined.
            frames += self._gap(stream, reached, offset - reached)
        elif offset < reached:
            data, offset = data[reached - offset :], reached
        self._captures[stream].append(data)
        self.offsets[stream] = offset + len(data)
        frames.append(Output(stream, offset, data))
        return frames

    def _gap(self, stream: StreamName, offset: int, dropped: int) -> list[ExecFrame]:
        reached = self.offsets[stream]
        end = offset + dropped
        if end <= reached:
            return []
        start = max(offset, reached)
        self._captures[stream].skip(end - start)
        self._captures[stream].decoder.reset()
        self.offsets[stream] = end
        return [Gap(stream, start, end - start)]

    def decode(self, frame: Output) -> str:
        """The frame's bytes as text, never splitting a UTF-8 sequence
        across two frames."""
        return self._captures[frame.stream].decoder.decode(frame.data)

    def flush_text(self, stream: StreamName) -> str:
        """What the decoder of ``stream`` still holds (an incomplete UTF-8
        sequence at the very end), replaced."""
        return self._captures[stream].decoder.decode(b"", final=True)

    def _finish(self, r: Mapping[str, Any]) -> ExecResult:
        out, err = self._captures[StreamName.STDOUT], self._captures[StreamName.STDERR]
        return ExecResult(
            exec_id=r["exec_id"],
            status=_enum(ExecStatus, r["status"]),
            exit_code=r.get("exit_code"),
            signal=r.get("signal"),
            stdout_bytes=out.kept(),
            stderr_bytes=err.kept(),
            wall_time=r.get("wall_time_secs", 0.0),
            cpu_time=r.get("cpu_time_secs", 0.0),
            peak_memory_bytes=r.get("peak_memory_bytes", 0),
            started_at_ms=r.get("started_at_ms", 0),
            ended_at_ms=r.get("ended_at_ms"),
            session_id=r.get("session_id"),
            stdout_total_bytes=out.total,
            stderr_total_bytes=err.total,
            stdout_dropped_bytes=out.dropped,
            stderr_dropped_bytes=err.dropped,
            output_expired=r.get("output_expired", False),
        )


def exec_result_from_json(r: Mapping[str, Any]) -> ExecResult:
    """``GET .../exec/{id}`` and ``?wait=true`` answers, which carry the
    captured output themselves."""
    output = r.get("output") or {}
    out, err = output.get("stdout") or {}, output.get("stderr") or {}
    return ExecResult(
        exec_id=r["exec_id"],
        status=_enum(ExecStatus, r["status"]),
        exit_code=r.get("exit_code"),
        signal=r.get("signal"),
        stdout_bytes=base64.b64decode(out.get("data_b64", "")),
        stderr_bytes=base64.b64decode(err.get("data_b64", "")),
        wall_time=r.get("wall_time_secs", 0.0),
        cpu_time=r.get("cpu_time_secs", 0.0),
        peak_memory_bytes=r.get("peak_memory_bytes", 0),
        started_at_ms=r.get("started_at_ms", 0),
        ended_at_ms=r.get("ended_at_ms"),
        session_id=r.get("session_id"),
        stdout_total_bytes=out.get("total_bytes", 0),
        stderr_total_bytes=err.get("total_bytes", 0),
        stdout_dropped_bytes=out.get("dropped_bytes", 0),
        stderr_dropped_bytes=err.get("dropped_bytes", 0),
        output_expired=r.get("output_expired", False),
    )
