"""The async API: ``AsyncClient``, ``AsyncSandbox`` and its sessions and files.

This file is the source of ``_sync.py``: ``python/tools/gen_sync.py``
rewrites it (``async``/``await`` removed, ``Async`` names dropped, ``_io_async``
swapped for ``_io_sync``) and a test checks the two are in step. Edit this
file, then run ``python3 python/tools/gen_sync.py``.
"""

from __future__ import annotations

import builtins
import json
import os
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import httpx

from . import _io_async as io
from . import errors
from ._core import (
    CHUNK_BYTES,
    DEFAULT_OUTPUT_CAP_BYTES,
    ExecStream,
    Request,
    RetryPolicy,
    StreamCut,
    __version__,
    batch_item_error,
    batch_request,
    create_request,
    error_from_answer,
    exec_request,
    exec_result_from_json,
    file_params,
    filter_labels,
    function_result_from_json,
    json_body,
    list_request,
    queued_create,
    resolve_api_key,
    resolve_url,
    run_function_request,
    sandbox_path,
    transport_error,
    upload_headers,
    with_step,
)
from .trajectory import ReplayReport, Trajectory
from .types import (
    ExecFrame,
    ExecResult,
    FileStat,
    FunctionResult,
    Health,
    Output,
    QueuePosition,
    SandboxInfo,
    SecurityEvents,
    SessionInfo,
    StreamName,
)

OutputCallback = Callable[[str], Any]


def _give_up(e: Exception, request: Request) -> errors.WarrenError:
    if isinstance(e, httpx.TransportError):
        return transport_error(e, request)
    return errors.WarrenConnectionError(f"{request.method} {request.path}: {e}", code="connection_error")


class AsyncClient:
    """A connection pool to one Warren server, with the retry policy.

    Sandboxes made without ``client=`` share one client per server URL (and,
    for the async API, per event loop). Make your own to change the timeout
    or the retry policy, and close it with ``aclose()`` or ``async with``.

    ``api_key`` (else ``$WARREN_API_KEY``) is sent as ``Authorization:
    Bearer`` on every call; a server running ``--auth on`` needs one.

    ``timeout`` (seconds) bounds each ordinary call; command streams and file
    transfers have no read timeout (a command may stay silent for an hour).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        timeout: float = 60.0,
        retry: RetryPolicy | None = None,
        max_connections: int = 1024,
        trust_env: bool = False,
        api_key: str | None = None,
    ) -> None:
        self.url = resolve_url(url)
        headers = {"User-Agent": f"warren-python/{__version__}"}
        key = resolve_api_key(api_key)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self.timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        self.retry = retry or RetryPolicy()
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=self.timeout,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=64),
            trust_env=trust_env,
            headers=headers,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def send(self, request: Request) -> httpx.Response:
        """Sends one call (retrying what the policy allows) and returns the
        read answer, or raises the error it carries."""
        attempt = 0
        while True:
            try:
                response = await self._http.request(**request.httpx_args(self.timeout))
            except httpx.TransportError as e:
                if not self.retry.should_retry(request, e, attempt):
                    raise transport_error(e, request) from e
                await io.sleep(self.retry.delay(attempt))
                attempt += 1
                continue
            if response.status_code >= 400:
                raise error_from_answer(response.status_code, response.content)
            return response

    async def call(self, request: Request) -> Any:
        """Like :meth:`send`, returning the answer's JSON (None when empty)."""
        return json_body(await self.send(request))

    async def health(self) -> Health:
        return Health.from_json(await self.call(Request("GET", "/v1/health", idempotent=True)))

    async def download(self, request: Request, local_path: str | os.PathLike[str]) -> int:
        """Streams an answer's body into ``local_path`` (replaced only once
        complete); returns the number of bytes. A broken transfer starts over."""
        local_path = os.fspath(local_path)
        part = f"{local_path}.warren-part"
        attempt = 0
        while True:
            try:
                with open(part, "wb") as f:
                    async with self._http.stream(**request.httpx_args(self.timeout)) as response:
                        if response.status_code >= 400:
                            await response.aread()
                            raise error_from_answer(response.status_code, response.content)
                        expected = response.headers.get("content-length")
                        written = 0
                        async for chunk in response.aiter_bytes(CHUNK_BYTES):
                            await io.write(f, chunk)
                            written += len(chunk)
                if expected is not None and written != int(expected):
                    raise StreamCut(f"got {written} of {expected} bytes")
                os.replace(part, local_path)
                return written
            except (httpx.TransportError, StreamCut) as e:
                _remove_quietly(part)
                if not self.retry.should_retry(request, e, attempt):
                    raise _give_up(e, request) from e
                await io.sleep(self.retry.delay(attempt))
                attempt += 1
            except BaseException:
                _remove_quietly(part)
                raise

    async def batch_frames(self, request: Request) -> AsyncGenerator[dict[str, Any], None]:
        """The frames of a batch create, up to its ``done`` frame. A connection
        that breaks sends the whole batch again (its items carry idempotency
        keys): items already made answer with the same sandboxes."""
        attempt = 0
        while True:
            try:
                async with self._http.stream(**request.httpx_args(self.timeout)) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        raise error_from_answer(response.status_code, response.content)
                    async for line in response.aiter_lines():
                        if not line.strip():
                            continue
                        frame = json.loads(line)
                        yield frame
                        if frame.get("type") == "done":
                            return
                raise StreamCut("the batch stream ended before its `done` frame")
            except (httpx.TransportError, StreamCut) as e:
                if not self.retry.should_retry(request, e, attempt):
                    raise _give_up(e, request) from e
                await io.sleep(self.retry.delay(attempt))
                attempt += 1

    async def exec_frames(self, request: Request, stream: ExecStream) -> AsyncGenerator[ExecFrame, None]:
        """The frames of an exec stream. A connection that breaks after the
        exec started resumes from the byte offsets already seen (the command
        is never run twice); one that breaks before is retried only when the
        request provably never left."""
        attempt = 0
        while True:
            try:
                async with self._http.stream(**request.httpx_args(self.timeout)) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        raise error_from_answer(response.status_code, response.content)
                    async for line in response.aiter_lines():
                        for frame in stream.feed(line):
                            attempt = 0
                            yield frame
                        if stream.done:
                            return
                raise StreamCut("the exec stream ended before its `end` frame")
            except (httpx.TransportError, StreamCut) as e:
                if stream.can_resume:
                    request = stream.resume_request()
                if not self.retry.should_retry(request, e, attempt):
                    raise _give_up(e, request) from e
                await io.sleep(self.retry.delay(attempt))
                attempt += 1


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


# One shared client per server URL (per event loop in the async API): sandboxes
# then share one connection pool.
_shared: dict[Any, AsyncClient] = {}


def _client(url: str | None, client: AsyncClient | None, api_key: str | None = None) -> AsyncClient:
    if client is not None:
        return client
    # The loop stays second: `forget_closed_loops` looks for it there.
    key = (resolve_url(url), io.loop_key(), resolve_api_key(api_key))
    found = _shared.get(key)
    if found is None:
        io.forget_closed_loops(_shared)
        found = _shared[key] = AsyncClient(key[0], api_key=key[2])
    return found


async def _run_exec(
    client: AsyncClient,
    request: Request,
    stream: ExecStream,
    on_stdout: OutputCallback | None,
    on_stderr: OutputCallback | None,
) -> ExecResult:
    callbacks = {StreamName.STDOUT: on_stdout, StreamName.STDERR: on_stderr}
    # aclosing: a callback that raises closes the stream's connection at once.
    async with aclosing(client.exec_frames(request, stream)) as frames:
        async for frame in frames:
            if isinstance(frame, Output) and callbacks[frame.stream] is not None:
                await io.invoke(callbacks[frame.stream], stream.decode(frame))
    for name, callback in callbacks.items():
        if callback is not None:
            await io.invoke(callback, stream.flush_text(name))
    if stream.result is None:
        raise errors.ServerError("the exec stream ended without a result", code="bad_answer")
    return stream.result


async def run_code(
    code: str | None = None,
    *,
    language: str | None = None,
    command: str | Sequence[str] | None = None,
    image: str | None = None,
    args: Sequence[str] = (),
    stdin: str | bytes | None = None,
    files: Mapping[str, str | bytes] | None = None,
    fetch: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    timeout: float | None = None,
    memory_mib: int | None = None,
    cpus: float | None = None,
    output_cap_bytes: int | None = None,
    url: str | None = None,
    client: AsyncClient | None = None,
    api_key: str | None = None,
) -> FunctionResult:
    """Runs ``code`` in ``language`` (``python``, ``bash``, ``sh``, ``c``,
    ``cpp``, ``javascript``) - or ``command`` (a shell string, or an argv
    list) - once, in a fresh worker of the function backend that is
    destroyed afterwards: nothing of one call reaches the next.

    ``files`` (path -> text or bytes; relative paths are under ``cwd``,
    default ``/work``) are written first; ``fetch`` names paths read back
    into ``result.files``. ``timeout`` (seconds, default 30) kills the whole
    run, compilation included (``status == "timed_out"``); past
    ``memory_mib`` the run ends ``oom``. An image without the language's
    toolchain raises :class:`~warren.InvalidRequest` with ``field ==
    "language"``; when every worker is busy and the server's queue is full,
    :class:`~warren.QuotaExceeded` (``code == "queue_full"``).
    """
    c = _client(url, client, api_key)
    request = run_function_request(
        code,
        language=language,
        command=command,
        image=image,
        args=args,
        stdin=stdin,
        files=files,
        fetch=fetch,
        env=env,
        cwd=cwd,
        timeout=timeout,
        memory_mib=memory_mib,
        cpus=cpus,
        output_cap_bytes=output_cap_bytes,
    )
    return function_result_from_json(await c.call(request))


async def replay(
    sandbox_id: str,
    *,
    keep: bool = False,
    url: str | None = None,
    client: AsyncClient | None = None,
    api_key: str | None = None,
) -> ReplayReport:
    """Re-runs sandbox ``sandbox_id``'s trajectory (also one deleted within
    the server's trajectory retention) step by step in a fresh sandbox made
    from the same image, resources and env, and reports for each step
    whether its result matches (execs: status, exit code and output
    digests). The fresh sandbox is deleted afterwards unless ``keep``."""
    c = _client(url, client, api_key)
    request = Request("POST", sandbox_path(sandbox_id, "/trajectory/replay"), json={"keep": keep}, long=True)
    return ReplayReport.from_json(await c.call(request))


class AsyncSandbox:
    """A handle on one sandbox. Make one with :meth:`create` or
    :meth:`connect`; ``async with`` deletes the sandbox on exit.

    ``sb.files`` and ``sb.sessions`` hold the file and shell-session calls.
    """

    def __init__(self, info: SandboxInfo, client: AsyncClient, *, last_step: int = 0) -> None:
        self._info = info
        self.client = client
        self.files = AsyncFiles(self)
        self.sessions = AsyncSessions(self)
        #: The trajectory step of this handle's last mutating call.
        self.last_step = last_step

    def _take_step(self, step: int | None) -> int:
        """The step of the next mutating call: ``step`` when given (later
        calls continue after it), else the one after the last."""
        self.last_step = self.last_step + 1 if step is None else step
        return self.last_step

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self._info.image} {self._info.state}>"

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.delete()
        except (errors.NotFound, errors.SandboxGone):
            pass

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def last_info(self) -> SandboxInfo:
        """The record as of the last call that returned it (no request)."""
        return self._info

    @classmethod
    async def create(
        cls,
        image: str | None = None,
        *,
        backend: str = "container",
        cpus: float | None = None,
        memory_mib: int | None = None,
        disk_mib: int | None = None,
        pids: int | None = None,
        idle_timeout: float | None = None,
        lifetime: float | None = None,
        env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        network: str | None = None,
        network_policy: Mapping[str, Any] | None = None,
        phases: Mapping[str, Any] | None = None,
        phase: str | None = None,
        idempotency_key: str | None = None,
        project: str | None = None,
        queue: bool = False,
        url: str | None = None,
        client: AsyncClient | None = None,
        api_key: str | None = None,
    ) -> AsyncSandbox:
        """Makes a sandbox and returns once it runs.

        Unset parameters take the server's defaults (image ``default``, 1
        CPU, 512 MiB memory, 1024 MiB disk, 15 min idle timeout, 6 h
        lifetime, no network). ``idle_timeout`` and ``lifetime`` are seconds.
        ``backend`` is one of ``container``, ``function``, ``microvm``,
        ``vm``; one the server cannot run raises :class:`~warren.Unsupported`.

        Every create carries an idempotency key (a fresh uuid4 unless given),
        so a create resent after a broken connection answers with the same
        sandbox instead of making a second. Reusing a key with different
        parameters raises :class:`~warren.Conflict`.

        A full node raises :class:`~warren.QuotaExceeded` at once, unless
        ``queue=True``: the call then waits its turn in the node's admission
        queue (``code == "queue_full"`` when that is full too). The same holds
        for the project's quotas (``code == "quota_exceeded"``). ``project``
        puts the sandbox in a project below the key's own (default: the
        key's project).
        """
        c = _client(url, client, api_key)
        request = create_request(
            image=image,
            backend=backend,
            cpus=cpus,
            memory_mib=memory_mib,
            disk_mib=disk_mib,
            pids=pids,
            idle_timeout=idle_timeout,
            lifetime=lifetime,
            env=env,
            labels=labels,
            network=network,
            network_policy=network_policy,
            phases=phases,
            phase=phase,
            idempotency_key=idempotency_key,
            project=project,
        )
        if queue:
            request = queued_create(request)
        return cls(SandboxInfo.from_json(await c.call(request)), c)

    @classmethod
    async def create_many(
        cls,
        n: int,
        image: str | None = None,
        *,
        batch_key: str | None = None,
        queue: bool = True,
        on_queued: Callable[[QueuePosition], Any] | None = None,
        url: str | None = None,
        client: AsyncClient | None = None,
        api_key: str | None = None,
        **params: Any,
    ) -> builtins.list[AsyncSandbox | errors.WarrenError]:
        """Makes ``n`` sandboxes alike (``params`` as for :meth:`create`) with
        one call to the server's batch endpoint, and returns one entry per
        sandbox in order: the sandbox, or the error that item met (a failed
        item does not fail the others).

        When the node is full the batch waits in its admission queue (unless
        ``queue=False``: the items that do not fit then fail with
        :class:`~warren.QuotaExceeded`); ``on_queued`` receives a
        :class:`~warren.QueuePosition` each time the position changes (with
        the async API it may be a coroutine function). A full queue raises
        :class:`~warren.QuotaExceeded` (``code == "queue_full"``).

        Item ``i`` is created with the idempotency key ``{batch_key}-{i}``:
        calling again with the same ``batch_key`` (e.g. after the training job
        was preempted, or after a broken connection, which is retried this
        way) answers with the same sandboxes instead of new ones.
        """
        if isinstance(n, int) and not isinstance(n, bool) and n == 0:
            return []
        request = batch_request(n, image, params, batch_key or str(uuid.uuid4()), queue)
        c = _client(url, client, api_key)
        results: builtins.list[AsyncSandbox | errors.WarrenError | None] = [None] * n
        async with aclosing(c.batch_frames(request)) as frames:
            async for frame in frames:
                kind = frame.get("type")
                if kind == "queued" and on_queued is not None:
                    await io.notify(on_queued, QueuePosition.from_json(frame))
                elif kind == "item":
                    sandbox = frame.get("sandbox")
                    made = cls(SandboxInfo.from_json(sandbox), c) if sandbox else None
                    results[int(frame["index"])] = made or batch_item_error(frame.get("error") or {})
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise errors.ServerError(f"the batch answered no result for items {missing}", code="bad_answer")
        return [r for r in results if r is not None]

    @classmethod
    async def connect(
        cls,
        sandbox_id: str,
        *,
        resume: bool = False,
        url: str | None = None,
        client: AsyncClient | None = None,
        api_key: str | None = None,
    ) -> AsyncSandbox:
        """A handle on an existing sandbox (raises :class:`~warren.NotFound`).

        With ``resume=True`` the handle numbers its calls from step 1 again:
        a driver restarted after a crash or preemption re-issues its calls,
        and those already in the sandbox's trajectory are answered from the
        log without running again (a call that differs from the logged one
        raises :class:`~warren.TrajectoryDiverged`); the first call past the
        log runs for real. Without it, numbering continues after the log's
        last step."""
        c = _client(url, client, api_key)
        data = await c.call(Request("GET", sandbox_path(sandbox_id), idempotent=True))
        last_step = 0
        if not resume:
            trajectory = await c.call(Request("GET", sandbox_path(sandbox_id, "/trajectory"), idempotent=True))
            last_step = Trajectory.from_json(trajectory).last_step
        return cls(SandboxInfo.from_json(data), c, last_step=last_step)

    @classmethod
    async def list(
        cls,
        *,
        labels: Mapping[str, str] | None = None,
        state: str | None = None,
        url: str | None = None,
        client: AsyncClient | None = None,
        api_key: str | None = None,
    ) -> builtins.list[SandboxInfo]:
        """Sandboxes carrying every label in ``labels`` (and in ``state``, e.g.
        ``running``), as records; :meth:`connect` makes a handle from an id."""
        c = _client(url, client, api_key)
        data = await c.call(list_request(labels, state))
        return filter_labels([SandboxInfo.from_json(d) for d in data["sandboxes"]], labels)

    async def info(self) -> SandboxInfo:
        """The sandbox's record now: state, resources, usage, end reason."""
        data = await self.client.call(Request("GET", sandbox_path(self.id), idempotent=True))
        self._info = SandboxInfo.from_json(data)
        return self._info

    refresh = info

    async def trajectory(self) -> Trajectory:
        """The sandbox's trajectory log: its origin and every mutating call
        as a step, with the request's hash and the result."""
        data = await self.client.call(Request("GET", sandbox_path(self.id, "/trajectory"), idempotent=True))
        return Trajectory.from_json(data)

    async def replay(self, *, keep: bool = False) -> ReplayReport:
        """:func:`~warren.replay` of this sandbox's trajectory."""
        return await replay(self.id, keep=keep, client=self.client)

    async def pause(self, *, to_disk: bool = False) -> SandboxInfo:
        """Freezes the sandbox: its processes stop where they are and make no
        progress until :meth:`resume`, or until the next exec, session
        command or file call, which resumes it. Its lifetime keeps counting,
        its idle timeout does not. ``to_disk=True`` (``microvm``, ``vm``) writes the
        guest's memory to disk and stops its QEMU until the resume; execs
        running at the pause end."""
        params = {"to_disk": "true"} if to_disk else None
        data = await self.client.call(Request("POST", sandbox_path(self.id, "/pause"), params=params, idempotent=True))
        self._info = SandboxInfo.from_json(data)
        return self._info

    async def resume(self) -> SandboxInfo:
        """Lets a paused sandbox run again (a no-op on a running one)."""
        data = await self.client.call(Request("POST", sandbox_path(self.id, "/resume"), idempotent=True))
        self._info = SandboxInfo.from_json(data)
        return self._info

    async def delete(self) -> SandboxInfo:
        """Ends the sandbox (a no-op for one that already ended) and returns
        its final record."""
        data = await self.client.call(Request("DELETE", sandbox_path(self.id), idempotent=True))
        self._info = SandboxInfo.from_json(data)
        return self._info

    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | bytes | None = None,
        timeout: float | None = None,
        output_cap_bytes: int | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        step: int | None = None,
    ) -> ExecResult:
        """Runs a command to its end and returns its result.

        ``cmd`` is a shell string (run with ``/bin/sh -c``) or an argv list.
        ``timeout`` (seconds) is enforced by the server, which kills the whole
        process tree: the result then has ``status == "timed_out"`` (no
        exception). ``on_stdout`` / ``on_stderr`` receive the output as text
        while it arrives (with the async API they may be coroutine
        functions). A broken
        connection resumes the stream where it stopped; the command runs once.
        ``step`` sets the call's trajectory step (default: the next one).
        """
        stream = ExecStream(self.id, output_cap_bytes or DEFAULT_OUTPUT_CAP_BYTES)
        request = exec_request(
            self.id, cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, output_cap_bytes=output_cap_bytes
        )
        request = with_step(request, self._take_step(step))
        return await _run_exec(self.client, request, stream, on_stdout, on_stderr)

    def exec_stream(
        self,
        cmd: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | bytes | None = None,
        timeout: float | None = None,
        output_cap_bytes: int | None = None,
        step: int | None = None,
    ) -> AsyncGenerator[ExecFrame, None]:
        """Runs a command and yields its frames as they come:
        :class:`~warren.Started`, :class:`~warren.Output` (bytes of one
        stream at an offset), :class:`~warren.Gap` (bytes the capture cap
        dropped), then :class:`~warren.End` with the whole result. Stopping
        early leaves the command running (it ends by itself or by its
        ``timeout``); close the iterator (``aclosing``) to free the connection
        at once."""
        stream = ExecStream(self.id, output_cap_bytes or DEFAULT_OUTPUT_CAP_BYTES)
        request = exec_request(
            self.id, cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, output_cap_bytes=output_cap_bytes
        )
        return self.client.exec_frames(with_step(request, self._take_step(step)), stream)

    async def exec_result(self, exec_id: str) -> ExecResult:
        """An exec's result by id (``status == "running"`` while it runs), with
        its captured output: works after the client that started it went away."""
        data = await self.client.call(Request("GET", sandbox_path(self.id, f"/exec/{exec_id}"), idempotent=True))
        return exec_result_from_json(data)

    async def kill_exec(self, exec_id: str) -> ExecResult:
        """Kills a running exec's process tree; it ends ``killed``."""
        data = await self.client.call(Request("POST", sandbox_path(self.id, f"/exec/{exec_id}/kill")))
        return exec_result_from_json(data)

    async def events(self, after_seq: int = 0) -> SecurityEvents:
        """Security events (refused system calls, file accesses, connections,
        phase changes) with a larger ``seq`` than ``after_seq``."""
        request = Request(
            "GET", sandbox_path(self.id, "/events"), params={"after_seq": str(after_seq)}, idempotent=True
        )
        return SecurityEvents.from_json(await self.client.call(request))

    async def set_phase(self, name: str, *, kill_running: bool = True, step: int | None = None) -> SandboxInfo:
        """Switches to one of the phases the sandbox was created with
        (``PUT /v1/sandboxes/{id}/phase``). With ``kill_running`` (the
        default) every process of earlier phases is killed; with ``False``
        they keep the Landlock domain of the phase they started in, though
        on the container backend the node still refuses them (EPERM, a
        ``tamper`` event) what the new phase protects. Returns the
        sandbox's record."""
        body = {"name": name, "kill_running": kill_running}
        request = Request("PUT", sandbox_path(self.id, "/phase"), json=body)
        data = await self.client.call(with_step(request, self._take_step(step)))
        self._info = SandboxInfo.from_json(data)
        return self._info

    async def set_network(
        self,
        policy: Mapping[str, Any] | None = None,
        *,
        presets: Sequence[str] | None = None,
        rules: Sequence[Mapping[str, Any]] | None = None,
        step: int | None = None,
    ) -> SandboxInfo:
        """Replaces the egress policy of an ``allowlist`` sandbox
        (``PUT /v1/sandboxes/{id}/network``): either a whole ``policy``
        ``{"presets": [...], "rules": [...]}`` or its parts, e.g.
        ``rules=[{"domain": "pypi.org", "ports": [443]}]``. Returns the
        sandbox's record."""
        body = dict(policy) if policy is not None else {}
        if presets is not None:
            body["presets"] = list(presets)
        if rules is not None:
            body["rules"] = [dict(r) for r in rules]
        request = Request("PUT", sandbox_path(self.id, "/network"), json=body)
        data = await self.client.call(with_step(request, self._take_step(step)))
        self._info = SandboxInfo.from_json(data)
        return self._info

    async def pack(self, image: str, *, scrub: Sequence[str] = ()) -> dict[str, Any]:
        """``pack_diff``: the sandbox's writable layer becomes a new image
        named ``image`` (minus the ``scrub`` paths). Returns the image record."""
        body = {"image": image, "scrub": list(scrub)}
        data: dict[str, Any] = await self.client.call(Request("POST", sandbox_path(self.id, "/pack"), json=body))
        return data


class AsyncSessions:
    """Shell sessions: the working directory and exported variables of one
    command carry over to the next (``sb.sessions``)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    async def create(
        self, *, cwd: str | None = None, env: Mapping[str, str] | None = None, step: int | None = None
    ) -> AsyncSession:
        """Starts a session in ``cwd`` (default ``/``) with ``env`` added."""
        body: dict[str, Any] = {"env": dict(env or {})}
        if cwd is not None:
            body["cwd"] = cwd
        sb = self._sandbox
        request = Request("POST", sandbox_path(sb.id, "/sessions"), json=body)
        data = await sb.client.call(with_step(request, sb._take_step(step)))
        return AsyncSession(sb, SessionInfo.from_json(data))

    async def list(self) -> builtins.list[SessionInfo]:
        sb = self._sandbox
        data = await sb.client.call(Request("GET", sandbox_path(sb.id, "/sessions"), idempotent=True))
        return [SessionInfo.from_json(d) for d in data["sessions"]]

    async def run(self, session_id: str, command: str, **kw: Any) -> ExecResult:
        """Runs a shell command in a session; see :meth:`AsyncSession.run`."""
        return await AsyncSession(self._sandbox, None, session_id).run(command, **kw)

    async def delete(self, session_id: str) -> None:
        sb = self._sandbox
        await sb.client.call(Request("DELETE", sandbox_path(sb.id, f"/sessions/{session_id}"), idempotent=True))


class AsyncSession:
    """One shell session; ``async with`` deletes it on exit."""

    def __init__(self, sandbox: AsyncSandbox, info: SessionInfo | None, session_id: str | None = None) -> None:
        self._sandbox = sandbox
        #: The session as created (``cwd``, ``env``); commands change it later.
        self.info = info
        self.id: str = info.id if info is not None else str(session_id)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} in {self._sandbox.id}>"

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.delete()
        except (errors.NotFound, errors.SandboxGone):
            pass

    async def run(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | bytes | None = None,
        timeout: float | None = None,
        output_cap_bytes: int | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        step: int | None = None,
    ) -> ExecResult:
        """Runs a shell command in the session (as :meth:`AsyncSandbox.exec`);
        ``cd`` and ``export`` in it last for the session's next commands."""
        sb = self._sandbox
        stream = ExecStream(sb.id, output_cap_bytes or DEFAULT_OUTPUT_CAP_BYTES)
        request = exec_request(
            sb.id,
            command,
            session_id=self.id,
            cwd=cwd,
            env=env,
            stdin=stdin,
            timeout=timeout,
            output_cap_bytes=output_cap_bytes,
        )
        request = with_step(request, sb._take_step(step))
        return await _run_exec(sb.client, request, stream, on_stdout, on_stderr)

    def run_stream(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        step: int | None = None,
    ) -> AsyncGenerator[ExecFrame, None]:
        """Like :meth:`run`, yielding the frames as they come."""
        sb = self._sandbox
        request = exec_request(sb.id, command, session_id=self.id, cwd=cwd, env=env, timeout=timeout)
        return sb.client.exec_frames(with_step(request, sb._take_step(step)), ExecStream(sb.id))

    async def delete(self) -> None:
        await self._sandbox.sessions.delete(self.id)


class AsyncFiles:
    """Files inside the sandbox (``sb.files``). Paths are absolute paths in
    the sandbox; the server resolves them inside its root."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    def _request(self, method: str, rest: str = "", **kw: Any) -> Request:
        return Request(method, sandbox_path(self._sandbox.id, "/files" + rest), **kw)

    async def read(self, path: str) -> bytes:
        """The whole file in memory; use :meth:`download` for large files."""
        request = self._request("GET", params=file_params(path), idempotent=True, long=True)
        return (await self._sandbox.client.send(request)).content

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def write(
        self, path: str, data: bytes | str, *, mode: int | None = None, step: int | None = None
    ) -> FileStat:
        """Writes ``data`` to ``path`` (replaced atomically once complete);
        ``mode`` is the permission bits of a new file, e.g. ``0o755``."""
        payload = data.encode() if isinstance(data, str) else bytes(data)
        request = self._request(
            "PUT",
            params=file_params(path, mode=mode),
            idempotent=True,
            long=True,
            body=lambda: payload,
            headers=upload_headers(len(payload)),
        )
        request = with_step(request, self._sandbox._take_step(step))
        return FileStat.from_json(await self._sandbox.client.call(request))

    async def upload(
        self, local_path: str | os.PathLike[str], remote: str, *, mode: int | None = None, step: int | None = None
    ) -> FileStat:
        """Streams a local file of any size to ``remote``, one chunk in memory
        at a time. A broken upload is sent again from the start; the remote
        file is replaced only by a complete upload."""
        size = os.path.getsize(local_path)
        request = self._request(
            "PUT",
            params=file_params(remote, mode=mode),
            idempotent=True,
            long=True,
            body=lambda: io.file_chunks(local_path),
            headers=upload_headers(size),
        )
        request = with_step(request, self._sandbox._take_step(step))
        return FileStat.from_json(await self._sandbox.client.call(request))

    async def download(self, remote: str, local_path: str | os.PathLike[str]) -> int:
        """Streams ``remote`` into a local file, one chunk in memory at a
        time; returns the number of bytes."""
        request = self._request("GET", params=file_params(remote), idempotent=True, long=True)
        return int(await self._sandbox.client.download(request, local_path))

    async def stat(self, path: str) -> FileStat:
        request = self._request("GET", "/stat", params=file_params(path), idempotent=True)
        return FileStat.from_json(await self._sandbox.client.call(request))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except errors.FileNotFound:
            return False
        return True

    async def mkdir(
        self, path: str, *, parents: bool = True, mode: int | None = None, step: int | None = None
    ) -> FileStat:
        body: dict[str, Any] = {"path": path, "parents": parents}
        if mode is not None:
            body["mode"] = format(mode, "o")
        request = with_step(self._request("POST", "/mkdir", json=body), self._sandbox._take_step(step))
        return FileStat.from_json(await self._sandbox.client.call(request))

    async def remove(self, path: str, *, recursive: bool = False, step: int | None = None) -> None:
        request = self._request("DELETE", params=file_params(path, recursive=recursive))
        await self._sandbox.client.send(with_step(request, self._sandbox._take_step(step)))

    async def list(self, path: str) -> builtins.list[FileStat]:
        request = self._request("GET", "/list", params=file_params(path), idempotent=True)
        data = await self._sandbox.client.call(request)
        return [FileStat.from_json(d) for d in data["entries"]]
