"""Results the SDK returns (besides the generated models it passes on)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, Literal

from sandbox_sdk.models import agent

# Called with each chunk of output text as it arrives.
OutputCallback = Callable[[str], object]
# Called with (bytes done, bytes in all or None when unknown) during transfers.
Progress = Callable[[int, int | None], object]
# Where streamed output goes: a callback, or a text file (sys.stdout, open(...)).
Sink = OutputCallback | IO[str]


@dataclass(frozen=True)
class CommandResult:
    """The outcome of a command: exit code, output, and the agent's full record."""

    id: str
    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    duration_seconds: float | None
    timed_out: bool
    signal: str | None
    stdout_truncated: bool
    stderr_truncated: bool
    execution: agent.Execution = field(repr=False)

    @property
    def ok(self) -> bool:
        """The command ran to the end and exited 0."""
        return self.status == "completed" and self.exit_code == 0

    @property
    def lost(self) -> bool:
        """The command never reached an exit code (an agent or runner restart
        under it, or it could not be started): `execution.error` says why."""
        return self.status in ("lost", "failed")

    @classmethod
    def of(cls, execution: agent.Execution) -> CommandResult:
        return cls(
            id=execution.id,
            status=execution.status,
            exit_code=execution.exit_code,
            stdout=execution.stdout or "",
            stderr=execution.stderr or "",
            duration_seconds=execution.duration_seconds,
            timed_out=bool(execution.timed_out),
            signal=execution.signal_name
            or (None if execution.signal is None else str(execution.signal)),
            stdout_truncated=bool(execution.stdout_truncated),
            stderr_truncated=bool(execution.stderr_truncated),
            execution=execution,
        )


@dataclass(frozen=True)
class OutputEvent:
    """One event of a streamed command: output of one stream, or its end (`exit`,
    with `result` set)."""

    kind: Literal["stdout", "stderr", "exit"]
    data: str = ""
    cursor: int | None = None
    result: CommandResult | None = None


@dataclass(frozen=True)
class Runtime:
    """A runtime of the operator's catalog (`spec.runtime`)."""

    name: str
    image: str
    description: str = ""
    default: bool = False


@dataclass(frozen=True)
class Template:
    """A SandboxTemplate of a namespace or a ClusterSandboxTemplate: an entry of the
    catalog a sandbox can be created from (`create(template=...)`)."""

    name: str
    kind: str  # SandboxTemplate or ClusterSandboxTemplate
    description: str = ""
    runtime: str | None = None
    image: str | None = None
    # Whether sandboxes of it can start now (a base snapshot still building: False).
    ready: bool = True
    base_snapshot: str | None = None


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event about a sandbox (Paused, Resumed, PodReplaced, ...)."""

    type: str
    reason: str
    message: str
    time: str
    count: int = 1
    source: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


def write_sink(sink: Sink | None, text: str) -> None:
    if sink is None or not text:
        return
    if callable(sink):
        sink(text)
    else:
        sink.write(text)
        sink.flush()
