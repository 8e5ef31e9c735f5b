"""Results the SDK returns (besides the generated models it passes on)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # only annotations: importing the models costs `kubectl sandbox` its start-up
    from sandbox_sdk.models import agent

# Called with each chunk of output text as it arrives.
OutputCallback = Callable[[str], object]
# Called with (bytes done, bytes in all or None when unknown) during transfers.
Progress = Callable[[int, int | None], object]
# Where streamed output goes: a callback, or a text file (sys.stdout, open(...)).
Sink = OutputCallback | IO[str]


@dataclass(frozen=True)
class CommandResult:
    """The outcome of a command: exit code, output, and the agent's full record.

    `stdout` and `stderr` hold at most the last 4 MiB of each stream (the
    agent's capture bound; less in a sandbox with a small agent memory budget,
    such as the `dense` profile): `stdout_truncated` / `stderr_truncated` say
    that the beginning is missing. To get all of a large output, stream it
    (`execute(..., stdout=file)`, `stream()`), or read a job's log from a cursor
    (`start()`, then `job.output()` / `job.logs()`): both see every byte, up to
    the on-disk log's own cap (`execution.log_truncated`).

    `execution` is the agent's record as a model (timing, resource use,
    `error`), built from `record` (its JSON) on first use."""

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
    # The agent's record as it came on the wire. `execution` validates it on
    # first use: most callers read only the fields above, and building the
    # agent's models is most of `kubectl sandbox exec`'s start-up.
    record: dict[str, Any] = field(repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """The command ran to the end and exited 0."""
        return self.status == "completed" and self.exit_code == 0

    @property
    def lost(self) -> bool:
        """The command never reached an exit code (an agent or runner restart
        under it, or it could not be started): `execution.error` says why."""
        return self.status in ("lost", "failed")

    @functools.cached_property
    def execution(self) -> agent.Execution:
        """The agent's full record (timing, resource use, `error`, ...)."""
        from sandbox_sdk.models import agent

        return agent.Execution.model_validate(self.record)

    @classmethod
    def of(cls, execution: agent.Execution | Mapping[str, Any]) -> CommandResult:
        """The result of the agent's record: its model, or its JSON as sent."""
        if isinstance(execution, Mapping):
            raw = dict(execution)
        else:
            raw = execution.model_dump(by_alias=True, mode="json")
        signal = raw.get("signal")
        result = cls(
            id=str(raw["id"]),
            status=str(raw["status"]),
            exit_code=raw.get("exitCode"),
            stdout=raw.get("stdout") or "",
            stderr=raw.get("stderr") or "",
            duration_seconds=raw.get("durationSeconds"),
            timed_out=bool(raw.get("timedOut")),
            signal=raw.get("signalName") or (None if signal is None else str(signal)),
            stdout_truncated=bool(raw.get("stdoutTruncated")),
            stderr_truncated=bool(raw.get("stderrTruncated")),
            record=raw,
        )
        if not isinstance(execution, Mapping):
            result.__dict__["execution"] = execution  # already a model: keep it
        return result


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


# -- code contexts (run_code) -------------------------------------------------------

_MIME = {
    "text": "text/plain",
    "html": "text/html",
    "markdown": "text/markdown",
    "svg": "image/svg+xml",
    "png": "image/png",
    "jpeg": "image/jpeg",
    "pdf": "application/pdf",
    "latex": "text/latex",
    "json": "application/json",
    "javascript": "application/javascript",
}


@dataclass(frozen=True)
class Result:
    """One rich result of a code run: the value of the last expression
    (`is_main`) or something the code displayed (a figure, a table). `data`
    holds every representation the object offered, by MIME type; the
    properties name the common ones (`png` and `jpeg` are base64 text, as
    Jupyter sends them; `json` is the decoded value)."""

    data: Mapping[str, Any]
    is_main: bool = False
    execution_count: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def _get(self, key: str) -> Any:
        return self.data.get(_MIME[key])

    @property
    def text(self) -> str | None:
        return self._get("text")  # type: ignore[no-any-return]

    @property
    def html(self) -> str | None:
        return self._get("html")  # type: ignore[no-any-return]

    @property
    def markdown(self) -> str | None:
        return self._get("markdown")  # type: ignore[no-any-return]

    @property
    def svg(self) -> str | None:
        return self._get("svg")  # type: ignore[no-any-return]

    @property
    def png(self) -> str | None:
        return self._get("png")  # type: ignore[no-any-return]

    @property
    def jpeg(self) -> str | None:
        return self._get("jpeg")  # type: ignore[no-any-return]

    @property
    def pdf(self) -> str | None:
        return self._get("pdf")  # type: ignore[no-any-return]

    @property
    def latex(self) -> str | None:
        return self._get("latex")  # type: ignore[no-any-return]

    @property
    def json(self) -> Any:
        return self._get("json")

    @property
    def javascript(self) -> str | None:
        return self._get("javascript")  # type: ignore[no-any-return]

    def formats(self) -> list[str]:
        """The names of the representations present (text, html, png, ...)."""
        return [name for name, mime in _MIME.items() if mime in self.data]


@dataclass(frozen=True)
class CodeError:
    """The exception a code run ended with: its class name, its message and
    the traceback the kernel formatted (lines, with terminal colours)."""

    name: str
    value: str
    traceback: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Logs:
    """What a code run printed, as the chunks came."""

    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Execution:
    """The outcome of `run_code`: its results, what it printed, and its error.

    `status` is ok, error, timed_out (interrupted at its timeout; the
    context's state stays, unless `restarted`), interrupted, or aborted (its
    kernel ended or was restarted under it). `restarted`: the context's
    kernel was started again during or right before this run, so variables
    from before are gone.
    """

    results: list[Result]
    logs: Logs
    error: CodeError | None
    status: str
    context_id: str
    execution_count: int | None = None
    duration_ms: int | None = None
    restarted: bool = False
    dropped_bytes: int = 0
    message: str | None = None

    @property
    def text(self) -> str | None:
        """The text of the last expression's value, if the code ended with one."""
        for result in self.results:
            if result.is_main:
                return result.text
        return None


ResultCallback = Callable[[Result], object]
ErrorCallback = Callable[[CodeError], object]
