"""Exceptions: one class per thing a caller can act on.

Every error the server answers carries its ``code``, ``message`` and
``field`` (the request field it is about, when there is one); the class is
chosen from the code in one place (:func:`warren._core.error_from_answer`).
"""

from __future__ import annotations

from typing import Any


class WarrenError(Exception):
    """Base of every error this package raises.

    ``code`` is the server's machine-readable code (``not_found``,
    ``invalid_request``, ...) or ``connection_error`` / ``timeout`` for
    failures on the way to the server; ``status`` is the HTTP status (0 when
    no answer came).
    """

    def __init__(
        self,
        message: str,
        *,
        code: str = "error",
        field: str | None = None,
        status: int = 0,
        body: Any = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.field = field
        self.status = status
        self.body = body

    def __str__(self) -> str:
        where = f" (field `{self.field}`)" if self.field else ""
        return f"{self.code}: {self.message}{where}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r}, field={self.field!r})"


class InvalidRequest(WarrenError, ValueError):
    """A parameter is malformed or out of range; ``field`` names it as the
    API spells it (e.g. ``memory_mib``, ``env.A=B``, ``idle_timeout_secs``)."""


class NotFound(WarrenError, LookupError):
    """No such sandbox, exec, session or route."""


class FileNotFound(NotFound):
    """A path inside the sandbox does not exist."""


class ImageNotFound(NotFound):
    """The image named in ``image`` does not exist on the server."""


class SandboxGone(WarrenError):
    """The sandbox has ended; ``reason`` says why (an :class:`~warren.EndReason`
    such as ``deleted``, ``idle_timeout``, ``lifetime``, ``oom``), or is
    ``None`` when the server did not say."""

    def __init__(self, message: str, *, reason: Any = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.reason = reason


class Conflict(WarrenError):
    """The request conflicts with what exists: an idempotency key reused with
    a different request, a path of the wrong type, an image in use."""


class TrajectoryDiverged(Conflict):
    """The call's trajectory step is already logged with a different
    request: ``step`` is the step, ``expected`` the logged request's hash and
    ``got`` this one's. A resumed driver that sends something else at a step
    it already took gets this instead of a second, different run."""

    def __init__(
        self, message: str, *, step: int | None = None, expected: str | None = None, got: str | None = None, **kw: Any
    ) -> None:
        super().__init__(message, **kw)
        self.step = step
        self.expected = expected
        self.got = got


class Unauthorized(WarrenError, PermissionError):
    """The server wants an API key and got none, an unknown or a revoked one
    (HTTP 401 ``unauthorized``), or the key's project may not use the route
    at all (403 ``forbidden``: node-wide administration is the root
    project's). Pass ``api_key=`` or set ``$WARREN_API_KEY``."""


class QuotaExceeded(WarrenError):
    """No room right now: the node is full (HTTP 503 ``capacity_exceeded``),
    its admission queue is full (429 ``queue_full``), the sandbox's project
    (or one above it) is at a quota (429 ``quota_exceeded``; ``field`` is
    ``quota.<name>`` and ``body`` names the project, limit and use),
    the sandbox's own pids limit is full (429 ``limit_reached``, ``field``
    names the limit) or a rate limit answered 429. Trying again later may
    succeed."""


class NoSpace(QuotaExceeded):
    """The sandbox's writable layer is full (``disk_mib``)."""


class Unsupported(WarrenError, NotImplementedError):
    """The backend cannot do this: ``unsupported_backend`` (the server cannot
    run that backend at all) or ``unsupported`` (the sandbox's backend cannot
    perform the operation). ``backend`` names it when known."""

    def __init__(self, message: str, *, backend: str | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.backend = backend


class ServerError(WarrenError):
    """The server failed (5xx ``internal``), or answered something this
    package cannot read."""


class WarrenConnectionError(WarrenError, ConnectionError):
    """The server could not be reached, or the connection broke, and the call
    could not be retried safely (or retries ran out)."""


class Timeout(WarrenError, TimeoutError):
    """An HTTP call to the server took longer than the client's ``timeout``
    (after retries, for idempotent calls). A command that outlives its own
    ``timeout`` is not an error: its result has ``status == "timed_out"``."""
