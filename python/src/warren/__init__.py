"""Python SDK for Warren, the sandbox platform for AI agents.

>>> from warren import Sandbox
>>> with Sandbox.create(image="default", memory_mib=512) as sb:
...     print(sb.exec("python3 -c 'print(6*7)'").stdout)
42

``Sandbox`` blocks; ``AsyncSandbox`` has the same calls as coroutines. The
server is found at ``url=``, else ``$WARREN_URL``, else http://127.0.0.1:7070.
"""

from ._async import AsyncClient, AsyncFiles, AsyncSandbox, AsyncSession, AsyncSessions
from ._async import replay as async_replay
from ._async import run_code as async_run_code
from ._core import DEFAULT_URL, RetryPolicy, __version__
from ._sync import Client, Files, Sandbox, Session, Sessions, replay, run_code
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
    TrajectoryDiverged,
    Unauthorized,
    Unsupported,
    WarrenConnectionError,
    WarrenError,
)
from .trajectory import ReplayReport, ReplayStep, StepResult, Trajectory, TrajectoryStep
from .types import (
    Backend,
    End,
    EndReason,
    ExecFrame,
    ExecResult,
    ExecStatus,
    FileKind,
    FileStat,
    FunctionResult,
    FunctionTimings,
    Gap,
    Health,
    NetworkMode,
    Output,
    QueuePosition,
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
    "FunctionResult",
    "FunctionTimings",
    "Gap",
    "Health",
    "ImageNotFound",
    "InvalidRequest",
    "NetworkMode",
    "NoSpace",
    "NotFound",
    "Output",
    "QueuePosition",
    "QuotaExceeded",
    "ReplayReport",
    "ReplayStep",
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
    "StepResult",
    "StreamName",
    "Timeout",
    "Trajectory",
    "TrajectoryDiverged",
    "TrajectoryStep",
    "Unauthorized",
    "Unsupported",
    "Usage",
    "WarrenConnectionError",
    "WarrenError",
    "__version__",
    "async_replay",
    "async_run_code",
    "replay",
    "run_code",
]
