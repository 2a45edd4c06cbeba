"""The API's records as typed, immutable Python values.

Field names follow the wire format (``crates/warren-api``) except that
durations are seconds as ``float`` without the ``_secs`` suffix. Enums are
``str`` enums, so ``info.state == "running"`` works too; a value this
version does not know is kept as a plain string rather than refused.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

E = TypeVar("E", bound=enum.Enum)


def _enum(cls: type[E], value: Any) -> E:
    try:
        return cls(value)
    except ValueError:
        return value  # type: ignore[no-any-return]


class Backend(enum.StrEnum):
    FUNCTION = "function"
    CONTAINER = "container"
    MICROVM = "microvm"
    VM = "vm"


class NetworkMode(enum.StrEnum):
    NONE = "none"
    LOOPBACK = "loopback"
    ALLOWLIST = "allowlist"


class SandboxState(enum.StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    #: Frozen by ``pause()``; the next exec, session command or file call resumes it.
    PAUSED = "paused"
    ENDING = "ending"
    ENDED = "ended"


class EndReason(enum.StrEnum):
    DELETED = "deleted"
    IDLE_TIMEOUT = "idle_timeout"
    LIFETIME = "lifetime"
    OOM = "oom"
    INIT_DIED = "init_died"
    NODE_RESTARTED = "node_restarted"
    CREATE_FAILED = "create_failed"
    SHUTDOWN = "shutdown"


class ExecStatus(enum.StrEnum):
    RUNNING = "running"
    #: The process exited, or was killed by a signal of its own making.
    OK = "ok"
    #: The deadline passed; the server killed the whole process tree.
    TIMED_OUT = "timed_out"
    #: Killed by the platform (sandbox ended, kill requested, server restarted).
    KILLED = "killed"
    OOM = "oom"


class StreamName(enum.StrEnum):
    STDOUT = "stdout"
    STDERR = "stderr"


class FileKind(enum.StrEnum):
    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"
    OTHER = "other"


@dataclass(frozen=True)
class Resources:
    cpus: float
    memory_mib: int
    disk_mib: int
    pids: int

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Resources:
        return cls(cpus=d["cpus"], memory_mib=d["memory_mib"], disk_mib=d["disk_mib"], pids=d["pids"])


@dataclass(frozen=True)
class Usage:
    memory_bytes: int
    memory_peak_bytes: int
    cpu_time: float
    pids: int
    disk_bytes: int

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Usage:
        return cls(
            memory_bytes=d.get("memory_bytes", 0),
            memory_peak_bytes=d.get("memory_peak_bytes", 0),
            cpu_time=d.get("cpu_time_secs", 0.0),
            pids=d.get("pids", 0),
            disk_bytes=d.get("disk_bytes", 0),
        )


@dataclass(frozen=True)
class SandboxInfo:
    """``GET /v1/sandboxes/{id}``: what the server knows about a sandbox."""

    id: str
    backend: Backend
    image: str
    state: SandboxState
    resources: Resources
    network: NetworkMode
    labels: dict[str, str]
    idle_timeout: float
    lifetime: float
    created_at_ms: int
    last_activity_at_ms: int
    from_pool: bool
    started_at_ms: int | None = None
    ended_at_ms: int | None = None
    end_reason: EndReason | None = None
    end_message: str | None = None
    usage: Usage | None = None
    phase: str | None = None
    phases: dict[str, Any] = field(default_factory=dict)
    network_policy: dict[str, Any] | None = None
    idempotency_key: str | None = None
    #: VM backends: what runs the guest (``"kvm"``, or ``"tcg"`` where KVM cannot run it).
    accelerator: str | None = None
    #: ``microvm``: ``"cold"`` (booted) or ``"snapshot"`` (restored from the
    #: node's snapshot of a booted guest, ``warren serve --vm-snapshots on``).
    boot: str | None = None
    #: The project it belongs to (``root`` when the server runs without IAM).
    project: str = "root"
    #: The record exactly as the server sent it (fields newer than this package included).
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SandboxInfo:
        reason = d.get("end_reason")
        usage = d.get("usage")
        return cls(
            id=d["id"],
            backend=_enum(Backend, d["backend"]),
            image=d["image"],
            state=_enum(SandboxState, d["state"]),
            resources=Resources.from_json(d["resources"]),
            network=_enum(NetworkMode, d.get("network", "none")),
            labels=dict(d.get("labels", {})),
            idle_timeout=float(d["idle_timeout_secs"]),
            lifetime=float(d["lifetime_secs"]),
            created_at_ms=d["created_at_ms"],
            last_activity_at_ms=d["last_activity_at_ms"],
            from_pool=d.get("from_pool", False),
            started_at_ms=d.get("started_at_ms"),
            ended_at_ms=d.get("ended_at_ms"),
            end_reason=_enum(EndReason, reason) if reason is not None else None,
            end_message=d.get("end_message"),
            usage=Usage.from_json(usage) if usage else None,
            phase=d.get("phase"),
            phases=dict(d.get("phases", {})),
            network_policy=d.get("network_policy"),
            idempotency_key=d.get("idempotency_key"),
            accelerator=d.get("accelerator"),
            boot=d.get("boot"),
            project=d.get("project", "root"),
            raw=dict(d),
        )


@dataclass(frozen=True)
class ExecResult:
    """The result of one command: how it ended, its output, what it used.

    ``stdout``/``stderr`` are the kept bytes decoded as UTF-8 (invalid
    sequences replaced); ``stdout_bytes``/``stderr_bytes`` are the bytes
    exactly. Past the capture cap (``output_cap_bytes``, 1 MiB per stream by
    default) the middle of a stream is dropped and counted in
    ``stdout_dropped_bytes``/``stderr_dropped_bytes``; the head and tail are
    kept.
    """

    exec_id: str
    status: ExecStatus
    exit_code: int | None
    signal: int | None
    stdout_bytes: bytes
    stderr_bytes: bytes
    wall_time: float
    cpu_time: float
    peak_memory_bytes: int
    started_at_ms: int
    ended_at_ms: int | None = None
    session_id: str | None = None
    stdout_total_bytes: int = 0
    stderr_total_bytes: int = 0
    stdout_dropped_bytes: int = 0
    stderr_dropped_bytes: int = 0
    #: The node no longer keeps this exec's output (an older exec of a
    #: sandbox past the server's ``--exec-output-retention-mib``).
    output_expired: bool = False

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        """True when the command ran to its end and exited 0."""
        return self.status == ExecStatus.OK and self.exit_code == 0

    @property
    def dropped_bytes(self) -> int:
        return self.stdout_dropped_bytes + self.stderr_dropped_bytes


@dataclass(frozen=True)
class Started:
    """First frame of an exec stream: the durable exec id."""

    exec_id: str


@dataclass(frozen=True)
class Output:
    """Bytes of one stream, starting at byte ``offset`` of that stream."""

    stream: StreamName
    offset: int
    data: bytes

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Gap:
    """Bytes ``offset .. offset + dropped_bytes`` of a stream were not kept
    (the server's capture cap)."""

    stream: StreamName
    offset: int
    dropped_bytes: int


@dataclass(frozen=True)
class End:
    """Last frame: the whole result, with the output the stream carried."""

    result: ExecResult


ExecFrame = Started | Output | Gap | End


@dataclass(frozen=True)
class FileStat:
    """A file, directory or link inside the sandbox; ``mode`` is the
    permission bits (e.g. ``0o644``)."""

    path: str
    kind: FileKind
    size_bytes: int
    mode: int
    modified_at_ms: int
    symlink_target: str | None = None

    @property
    def is_dir(self) -> bool:
        return self.kind == FileKind.DIR

    @property
    def is_file(self) -> bool:
        return self.kind == FileKind.FILE

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FileStat:
        return cls(
            path=d["path"],
            kind=_enum(FileKind, d["kind"]),
            size_bytes=d["size_bytes"],
            mode=d["mode"],
            modified_at_ms=d["modified_at_ms"],
            symlink_target=d.get("symlink_target"),
        )


@dataclass(frozen=True)
class SessionInfo:
    """A shell session: where it is and what its commands exported."""

    id: str
    cwd: str
    #: Variables the session's commands exported, beyond the sandbox's own.
    env: dict[str, str]
    created_at_ms: int
    commands_run: int

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SessionInfo:
        return cls(
            id=d["id"],
            cwd=d["cwd"],
            env=dict(d.get("env", {})),
            created_at_ms=d["created_at_ms"],
            commands_run=d.get("commands_run", 0),
        )


@dataclass(frozen=True)
class SecurityEvent:
    """Something the sandbox tried that the platform refused (or a phase change)."""

    seq: int
    time_ms: int
    pid: int
    comm: str
    kind: str
    syscall: str
    detail: str

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SecurityEvent:
        return cls(
            seq=d["seq"],
            time_ms=d["time_ms"],
            pid=d["pid"],
            comm=d.get("comm", ""),
            kind=d["kind"],
            syscall=d.get("syscall", ""),
            detail=d.get("detail", ""),
        )


@dataclass(frozen=True)
class SecurityEvents:
    """``GET /v1/sandboxes/{id}/events``: poll again with ``after_seq=next_seq - 1``."""

    events: list[SecurityEvent]
    #: Events lost to the sandbox's bounded event ring since ``after_seq``.
    dropped: int
    next_seq: int
    #: Events of each kind since the sandbox started, dropped ones included.
    counts: dict[str, int]

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SecurityEvents:
        return cls(
            events=[SecurityEvent.from_json(e) for e in d.get("events", [])],
            dropped=d.get("dropped", 0),
            next_seq=d.get("next_seq", 0),
            counts=dict(d.get("counts", {})),
        )


@dataclass(frozen=True)
class Health:
    status: str
    version: str
    sandboxes_running: int

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Health:
        return cls(status=d["status"], version=d["version"], sandboxes_running=d.get("sandboxes_running", 0))


@dataclass(frozen=True)
class FunctionTimings:
    """Where a function call's time went, in seconds: waiting for a free
    worker (``queue``), claiming one and writing the files in (``setup``),
    the run itself (``run``), reading files back (``fetch``), and the whole
    call on the server (``total``)."""

    queue: float
    setup: float
    run: float
    fetch: float
    total: float

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FunctionTimings:
        return cls(
            queue=d.get("queue_secs", 0.0),
            setup=d.get("setup_secs", 0.0),
            run=d.get("run_secs", 0.0),
            fetch=d.get("fetch_secs", 0.0),
            total=d.get("total_secs", 0.0),
        )


@dataclass(frozen=True)
class FunctionResult:
    """The result of :func:`warren.run_code`: the run's :class:`ExecResult`
    (``exec``), the fetched files (``files``: path as asked -> bytes, or
    ``None`` when it was missing, not a regular file or too large;
    ``file_status`` says which), the timings, and whether the worker came
    warm from the pool. ``stdout``, ``stderr``, ``exit_code``, ``status``
    and ``ok`` are the exec's."""

    exec: ExecResult
    files: dict[str, bytes | None]
    file_status: dict[str, str]
    timings: FunctionTimings
    warm_worker: bool

    @property
    def stdout(self) -> str:
        return self.exec.stdout

    @property
    def stderr(self) -> str:
        return self.exec.stderr

    @property
    def exit_code(self) -> int | None:
        return self.exec.exit_code

    @property
    def status(self) -> ExecStatus:
        return self.exec.status

    @property
    def ok(self) -> bool:
        return self.exec.ok


@dataclass(frozen=True)
class QueuePosition:
    """Progress of a ``create_many`` that waits in the node's admission
    queue: its first waiting sandbox is at ``position`` (1 is admitted
    next), and ``items_waiting`` of its sandboxes are not admitted yet."""

    position: int
    items_waiting: int

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> QueuePosition:
        return cls(position=int(d["position"]), items_waiting=int(d["items_waiting"]))
