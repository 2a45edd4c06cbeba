"""The trajectory log's records: a sandbox's mutating calls as numbered
steps (``sb.trajectory()``), and the report of a replay (``warren.replay``).

Every mutating call (exec, session create and command, file write, remove
and mkdir, phase and network change) carries a step number in the
``Warren-Step`` header; a handle numbers its calls itself. A step the server
has already logged with the same request is answered from the log without
running again; the same step with a different request raises
:class:`~warren.TrajectoryDiverged`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: The request (and answer) header carrying a call's trajectory step.
STEP_HEADER = "Warren-Step"


@dataclass(frozen=True)
class StepResult:
    """What a logged call did. Execs: ``exec_id``, ``status``,
    ``exit_code``, timings and the ``sha256:`` digests of the captured
    output; other calls: ``response`` (the call's JSON answer)."""

    exec_id: str | None = None
    status: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    wall_time: float | None = None
    cpu_time: float | None = None
    peak_memory_bytes: int | None = None
    stdout_sha256: str | None = None
    stderr_sha256: str | None = None
    stdout_bytes: int | None = None
    stderr_bytes: int | None = None
    output_ref: str | None = None
    response: Any = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StepResult:
        return cls(
            exec_id=d.get("exec_id"),
            status=d.get("status"),
            exit_code=d.get("exit_code"),
            signal=d.get("signal"),
            wall_time=d.get("wall_time_secs"),
            cpu_time=d.get("cpu_time_secs"),
            peak_memory_bytes=d.get("peak_memory_bytes"),
            stdout_sha256=d.get("stdout_sha256"),
            stderr_sha256=d.get("stderr_sha256"),
            stdout_bytes=d.get("stdout_bytes"),
            stderr_bytes=d.get("stderr_bytes"),
            output_ref=d.get("output_ref"),
            response=d.get("response"),
        )


@dataclass(frozen=True)
class TrajectoryStep:
    """One logged call: ``kind`` is ``exec``, ``session_create``,
    ``session_exec``, ``file_write``, ``file_remove``, ``mkdir``, ``phase``
    or ``network``; ``request`` is the request as hashed (uploads: their
    ``sha256`` and ``size_bytes``, not the bytes); ``state`` is ``running``
    or ``done``."""

    step: int
    kind: str
    request: Any
    request_hash: str
    state: str
    client_step: bool
    started_at_ms: int
    ended_at_ms: int | None
    result: StepResult | None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TrajectoryStep:
        result = d.get("result")
        return cls(
            step=int(d["step"]),
            kind=d["kind"],
            request=d.get("request"),
            request_hash=d["request_hash"],
            state=d["state"],
            client_step=bool(d.get("client_step", False)),
            started_at_ms=int(d.get("started_at_ms", 0)),
            ended_at_ms=d.get("ended_at_ms"),
            result=StepResult.from_json(result) if result is not None else None,
        )


@dataclass(frozen=True)
class Trajectory:
    """A sandbox's log: what it was made from (``origin``: image,
    resources, env, ...) and its steps in order. Kept after the sandbox
    ended, for the server's ``--trajectory-retention-secs``."""

    sandbox_id: str
    origin: Mapping[str, Any]
    ended_at_ms: int | None
    steps: list[TrajectoryStep] = field(default_factory=list)

    @property
    def last_step(self) -> int:
        return max((s.step for s in self.steps), default=0)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Trajectory:
        return cls(
            sandbox_id=d["sandbox_id"],
            origin=dict(d.get("origin") or {}),
            ended_at_ms=d.get("ended_at_ms"),
            steps=[TrajectoryStep.from_json(s) for s in d.get("steps") or []],
        )


@dataclass(frozen=True)
class ReplayStep:
    """How one step came out in the replay: ``outcome`` is ``match``,
    ``mismatch`` (``differences`` names the fields, e.g. ``exit_code``,
    ``stdout_sha256``), ``skipped`` or ``failed`` (``message`` says why)."""

    step: int
    kind: str
    outcome: str
    differences: list[str]
    message: str | None
    result: StepResult | None

    @property
    def matched(self) -> bool:
        return self.outcome == "match"

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ReplayStep:
        result = d.get("result")
        return cls(
            step=int(d["step"]),
            kind=d["kind"],
            outcome=d["outcome"],
            differences=list(d.get("differences") or []),
            message=d.get("message"),
            result=StepResult.from_json(result) if result is not None else None,
        )


@dataclass(frozen=True)
class ReplayReport:
    """The replay of ``source_id``'s trajectory in the fresh sandbox
    ``sandbox_id``: one :class:`ReplayStep` per logged step; ``matched``
    when every one matched."""

    source_id: str
    sandbox_id: str
    steps: list[ReplayStep]
    matched: bool

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ReplayReport:
        return cls(
            source_id=d["source_id"],
            sandbox_id=d["sandbox_id"],
            steps=[ReplayStep.from_json(s) for s in d.get("steps") or []],
            matched=bool(d.get("matched", False)),
        )
