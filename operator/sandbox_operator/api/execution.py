"""The Execution resource: one command in a sandbox, its outcome in status.

Besides the models, this module declares the status vocabulary: phases,
condition types and the reasons `status.reason` and the conditions carry.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field, model_validator

from sandbox_operator.api.common import (
    MAX_INPUT_CHARACTERS,
    Bounds,
    Condition,
    Duration,
    EnvVar,
    InputFile,
    LocalObjectReference,
    Model,
    RelativePath,
    cel,
    immutable,
    total_size_rule,
    validations,
)
from sandbox_operator.api.sandbox import MAX_ENV_CHARACTERS, SandboxSpec

# The longest command the sandbox agent accepts (its SANDBOX_AGENT_MAX_TIMEOUT,
# which the operator sets from this value).
MAX_TIMEOUT = "1h"


class ExecutionPhase(StrEnum):
    """The Execution's recorded state: Queued -> Running -> one of the final four."""

    QUEUED = "Queued"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    TIMED_OUT = "TimedOut"
    CANCELLED = "Cancelled"


TERMINAL_PHASES = frozenset(
    {
        ExecutionPhase.SUCCEEDED,
        ExecutionPhase.FAILED,
        ExecutionPhase.TIMED_OUT,
        ExecutionPhase.CANCELLED,
    }
)


class ExecutionCondition(StrEnum):
    """Ready, Scheduled and Complete always; Succeeded once the Execution is
    complete; Reconciling, Stalled (kstatus) only while True. Ready is True
    once the command succeeded, as for any kind a GitOps tool waits on."""

    READY = "Ready"
    SCHEDULED = "Scheduled"
    COMPLETE = "Complete"
    SUCCEEDED = "Succeeded"
    RECONCILING = "Reconciling"
    STALLED = "Stalled"


class ExecutionReason(StrEnum):
    """`status.reason` and the conditions' reasons: why it waits, or how it ended."""

    QUEUED = "Queued"
    SANDBOX_NOT_FOUND = "SandboxNotFound"
    SANDBOX_STARTING = "SandboxStarting"
    SANDBOX_PAUSED = "SandboxPaused"
    SANDBOX_RESUMING = "SandboxResuming"
    SANDBOX_FAILED = "SandboxFailed"
    SANDBOX_DELETED = "SandboxDeleted"
    # The named Sandbox is a SandboxPool's member: only the Sandbox claiming it runs commands.
    POOL_MEMBER = "PoolMember"
    SECRET_NOT_FOUND = "SecretNotFound"
    CONCURRENCY_LIMIT = "ConcurrencyLimit"
    # A SandboxQuota (running executions, or the one-shot sandbox) or a ResourceQuota.
    QUOTA_EXCEEDED = "QuotaExceeded"
    CREATE_FAILED = "CreateFailed"
    STARTED = "Started"
    SUCCEEDED = "Succeeded"
    NON_ZERO_EXIT = "NonZeroExit"
    SIGNALED = "Signaled"
    OOM_KILLED = "OOMKilled"
    TIMED_OUT = "TimedOut"
    CANCELLED = "Cancelled"
    LOST = "Lost"
    START_FAILED = "StartFailed"
    INVALID_SPEC = "InvalidSpec"


# CEL sizes (characters; 0 when unset) of an Execution's own inputs, and of the
# large fields of a one-shot's sandboxTemplate.
_OWN_INPUTS = {
    "script": "has(self.script) ? size(self.script) : 0",
    "command": "has(self.command) ? self.command.map(a, size(a)).sum() : 0",
    "stdin": "has(self.stdin) ? size(self.stdin) : 0",
    "files": "has(self.files) ? self.files.map(f, size(f.content)).sum() : 0",
    "env": "has(self.env) ? self.env.map(e, has(e.value) ? size(e.value) : 0).sum() : 0",
}
_TEMPLATE_INPUTS = {
    "sandboxTemplate.files": "has(self.sandboxTemplate) && has(self.sandboxTemplate.files)"
    " ? self.sandboxTemplate.files.map(f, size(f.content)).sum() : 0",
    "sandboxTemplate.env": "has(self.sandboxTemplate) && has(self.sandboxTemplate.env)"
    " ? self.sandboxTemplate.env.map(e, has(e.value) ? size(e.value) : 0).sum() : 0",
}
# The most a Sandbox's own env and files may hold together.
MAX_ONE_SHOT_CHARACTERS = MAX_INPUT_CHARACTERS + MAX_ENV_CHARACTERS


class ExecutionSpec(Model):
    """Desired state of an Execution. Immutable once created, except `cancel`."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "has(self.sandboxRef) != has(self.sandboxTemplate)",
                "exactly one of sandboxRef or sandboxTemplate must be set",
            ),
            cel(
                "has(self.command) != has(self.script)",
                "exactly one of command or script must be set",
            ),
            cel(
                "!has(self.sandboxTemplate) || !has(self.sandboxTemplate.paused)"
                " || !self.sandboxTemplate.paused",
                "sandboxTemplate.paused cannot be true: a one-shot sandbox is made to run"
                " this command now",
            ),
            immutable(
                "sandboxRef",
                "sandboxTemplate",
                "command",
                "script",
                "env",
                "workingDir",
                "stdin",
                "files",
                "timeout",
                "combinedOutput",
            ),
            total_size_rule(MAX_INPUT_CHARACTERS, _OWN_INPUTS, "the inputs"),
            # A one-shot's sandbox is part of the same object, and of the copy
            # `kubectl apply` keeps of it: together no larger than a Sandbox may be.
            total_size_rule(
                MAX_ONE_SHOT_CHARACTERS,
                {**_OWN_INPUTS, **_TEMPLATE_INPUTS},
                "the inputs with a one-shot's sandboxTemplate",
            ),
        )
    )

    sandbox_ref: LocalObjectReference | None = Field(
        default=None, description="The Sandbox to run in (same namespace)."
    )
    sandbox_template: SandboxSpec | None = Field(
        default=None,
        description="One-shot: a disposable sandbox created for this run and deleted after it.",
    )
    command: Annotated[
        list[Annotated[str, Field(max_length=32768)]] | None, Field(min_length=1, max_length=1024)
    ] = Field(default=None, description="The program and its arguments (no shell).")
    script: Annotated[str | None, Field(min_length=1, max_length=MAX_INPUT_CHARACTERS)] = Field(
        default=None, description="A shell script, run with /bin/sh in the sandbox."
    )
    env: Annotated[list[EnvVar], Field(max_length=128)] = Field(
        default_factory=list,
        description="Environment of this command, over the sandbox's own.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    working_dir: RelativePath | None = Field(
        default=None, description="Directory to run in, relative to /workspace."
    )
    stdin: Annotated[str | None, Field(max_length=MAX_INPUT_CHARACTERS)] = Field(
        default=None, description="Text fed to the command's standard input."
    )
    files: Annotated[list[InputFile], Field(max_length=64)] = Field(
        default_factory=list, description="Files written into the workspace before the run."
    )
    timeout: Annotated[Duration, Bounds.duration("timeout", "1s", MAX_TIMEOUT)] = Field(
        default="3m", description=f"Kill the command after this long (at most {MAX_TIMEOUT})."
    )
    combined_output: bool = Field(
        default=False,
        description="Send stderr into stdout's pipe, so that status.stdout keeps the true"
        " order of both (status.stderr stays empty). Without it, each stream keeps its own"
        " order only.",
    )
    ttl_seconds_after_finished: Annotated[int | None, Field(ge=0, le=31536000)] = Field(
        default=None, description="Delete the Execution this many seconds after it ends."
    )
    cancel: bool = Field(default=False, description="Set to true to kill the running command.")

    @model_validator(mode="after")
    def _inputs_fit(self) -> ExecutionSpec:
        total = (
            len(self.script or "")
            + sum(len(arg) for arg in self.command or [])
            + len(self.stdin or "")
            + sum(len(file.content) for file in self.files)
            + sum(len(var.value or "") for var in self.env)
        )
        if total > MAX_INPUT_CHARACTERS:
            raise ValueError(f"the inputs may hold at most {MAX_INPUT_CHARACTERS} characters")
        if self.sandbox_template is not None:
            total += sum(len(f.content) for f in self.sandbox_template.files)
            total += sum(len(var.value or "") for var in self.sandbox_template.env)
            if total > MAX_ONE_SHOT_CHARACTERS:
                raise ValueError(
                    "the inputs with a one-shot's sandboxTemplate may hold at most"
                    f" {MAX_ONE_SHOT_CHARACTERS} characters"
                )
        return self


class ExecutionStatus(Model):
    """Observed state, written only by the operator."""

    model_config = ConfigDict(extra="ignore")

    phase: ExecutionPhase | None = Field(default=None, description="Where the Execution is.")
    # A string, not the enum: a status written by a later release, with a reason
    # this one does not know yet, must still parse.
    reason: str | None = Field(
        default=None,
        description="Why the Execution waits or how it ended, in one word (ExecutionReason).",
    )
    message: str | None = Field(default=None, description="The same, for people.")
    observed_generation: int | None = Field(
        default=None, description="The spec generation this status was computed from."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Scheduled and Complete always; Succeeded once complete;"
        " Reconciling or Stalled while true.",
    )
    sandbox: str | None = Field(default=None, description="The sandbox the command runs in.")
    one_shot: bool | None = Field(
        default=None, description="The sandbox was created for this run and is deleted after it."
    )
    sandbox_resumed: bool | None = Field(
        default=None, description="The sandbox was paused and was resumed for this Execution."
    )
    pod_uid: str | None = Field(
        default=None,
        alias="podUID",
        description="The pod the command was started in (recorded before it is started).",
    )
    agent_execution_id: str | None = Field(
        default=None, description="The agent's id: full output is readable there by cursor."
    )
    exit_code: int | None = Field(default=None, description="The command's exit code.")
    signal: str | None = Field(default=None, description="The signal that ended the command.")
    start_time: str | None = Field(default=None, description="When the command was started.")
    completion_time: str | None = Field(default=None, description="When the Execution ended.")
    duration: str | None = Field(default=None, description="How long the command ran.")
    stdout: str | None = Field(default=None, description="The end of the command's stdout.")
    stderr: str | None = Field(default=None, description="The end of the command's stderr.")
    stdout_truncated: bool | None = Field(
        default=None, description="stdout holds only the end of the output."
    )
    stderr_truncated: bool | None = Field(
        default=None, description="stderr holds only the end of the output."
    )
    stdout_bytes: int | None = Field(default=None, description="Bytes the command wrote to stdout.")
    stderr_bytes: int | None = Field(default=None, description="Bytes the command wrote to stderr.")
