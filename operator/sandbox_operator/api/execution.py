"""The Execution resource: one command in a sandbox, its outcome in status."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field

from sandbox_operator.api.common import (
    Condition,
    Duration,
    EnvVar,
    LocalObjectReference,
    Model,
    cel,
    immutable,
    validations,
)
from sandbox_operator.api.sandbox import SandboxSpec


class ExecutionPhase(StrEnum):
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

# Paths are relative to the workspace; the agent refuses escapes at run time,
# the schema refuses the obvious ones at admission.
RelativePath = Annotated[
    str,
    Field(
        min_length=1,
        max_length=4096,
        json_schema_extra=validations(
            cel(
                "!self.startsWith('/') && !self.split('/').exists(p, p == '..')",
                "must be a path relative to the workspace, without '..'",
            )
        ),
    ),
]


class InputFile(Model):
    path: RelativePath
    content: Annotated[str, Field(max_length=262144)]
    mode: Annotated[int | None, Field(ge=0, le=0o777)] = Field(
        default=None, description="File mode as a decimal integer, e.g. 493 for 0755."
    )


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
            ),
        )
    )

    sandbox_ref: LocalObjectReference | None = None
    sandbox_template: SandboxSpec | None = Field(
        default=None,
        description="One-shot: a disposable sandbox created for this run and deleted after it.",
    )
    command: Annotated[
        list[Annotated[str, Field(max_length=32768)]] | None, Field(min_length=1, max_length=1024)
    ] = None
    script: Annotated[str | None, Field(min_length=1, max_length=262144)] = Field(
        default=None, description="A shell script, run with /bin/sh -c in the sandbox."
    )
    env: Annotated[list[EnvVar], Field(max_length=128)] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    working_dir: RelativePath | None = None
    stdin: Annotated[str | None, Field(max_length=1048576)] = None
    files: Annotated[list[InputFile], Field(max_length=64)] = Field(
        default_factory=list, description="Files written into the workspace before the run."
    )
    timeout: Duration = Field(default="3m", description="Kill the command after this long.")
    ttl_seconds_after_finished: Annotated[int | None, Field(ge=0, le=31536000)] = None
    cancel: bool = Field(default=False, description="Set to true to kill the running command.")


class ExecutionStatus(Model):
    model_config = ConfigDict(extra="ignore")

    phase: ExecutionPhase | None = None
    reason: str | None = Field(
        default=None, description="Why the Execution waits or how it ended, in one word."
    )
    message: str | None = None
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
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
    exit_code: int | None = None
    signal: str | None = None
    start_time: str | None = None
    completion_time: str | None = None
    duration: str | None = None
    stdout: str | None = None
    stderr: str | None = None
    stdout_truncated: bool | None = None
    stderr_truncated: bool | None = None
    stdout_bytes: int | None = None
    stderr_bytes: int | None = None
