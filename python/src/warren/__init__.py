"""Python SDK for Warren, the sandbox platform for AI agents.

>>> from warren import Sandbox
>>> with Sandbox.create(image="default", memory_mib=512) as sb:
...     print(sb.exec("python3 -c 'print(6*7)'").stdout)
42

``Sandbox`` blocks; ``AsyncSandbox`` has the same calls as coroutines. The
server is found at ``url=``, else ``$WARREN_URL``, else http://127.0.0.1:7070.
"""

from ._async import AsyncClient, AsyncFiles, AsyncSandbox, AsyncSession, AsyncSessions
from ._core import DEFAULT_URL, RetryPolicy, __version__
from ._sync import Client, Files, Sandbox, Session, Sessions
from .errors import (
    Conflict,
    FileNotFound,
    ImageNotFound,
    InvalidRequest,
    NoSpace,
    NotFound,
    QuotaExceeded,
    SandboxGone,
    ServerError,
    Timeout,
    Unsupported,
    WarrenConnectionError,
    WarrenError,
)
from .types import (
    Backend,
    End,
    EndReason,
    ExecFrame,
    ExecResult,
    ExecStatus,
    FileKind,
    FileStat,
    Gap,
    Health,
    NetworkMode,
    Output,
    Resources,
    SandboxInfo,
    SandboxState,
    SecurityEvent,
    SecurityEvents,
    SessionInfo,
    Started,
    StreamName,
    Usage,
)

__all__ = [
    "AsyncClient",
    "AsyncFiles",
    "AsyncSandbox",
    "AsyncSession",
    "AsyncSessions",
    "Backend",
    "Client",
    "Conflict",
    "DEFAULT_URL",
    "End",
    "EndReason",
    "ExecFrame",
    "ExecResult",
    "ExecStatus",
    "FileKind",
    "FileNotFound",
    "FileStat",
    "Files",
    "Gap",
    "Health",
    "ImageNotFound",
    "InvalidRequest",
    "NetworkMode",
    "NoSpace",
    "NotFound",
    "Output",
    "QuotaExceeded",
    "Resources",
    "RetryPolicy",
    "Sandbox",
    "SandboxGone",
    "SandboxInfo",
    "SandboxState",
    "SecurityEvent",
    "SecurityEvents",
    "ServerError",
    "Session",
    "SessionInfo",
    "Sessions",
    "Started",
    "StreamName",
    "Timeout",
    "Unsupported",
    "Usage",
    "WarrenConnectionError",
    "WarrenError",
    "__version__",
]
