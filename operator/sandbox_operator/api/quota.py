"""The SandboxQuota resource: per-namespace limits on sandboxes for shared clusters.

A namespaced object, like a Kubernetes ResourceQuota, so a cluster operator
applies one per tenant namespace from Git. Several SandboxQuotas in one
namespace all apply: a Sandbox or Execution must fit every one of them.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field

from sandbox_operator.api.common import Bounds, Model, Quantity, cel, validations


class QuotaReason(StrEnum):
    """The reason a refused Sandbox or Execution carries (Ready / its phase)."""

    QUOTA_EXCEEDED = "QuotaExceeded"


class ComputeLimits(Model):
    """CPU and memory of the sandbox pods (both containers), summed over the namespace."""

    cpu: Annotated[Quantity | None, Bounds.quantity("cpu", "0", "1000000")] = Field(
        default=None, description="Total CPU."
    )
    memory: Annotated[Quantity | None, Bounds.quantity("memory", "0", "1Ei")] = Field(
        default=None, description="Total memory."
    )


class SandboxQuotaSpec(Model):
    """The limits; an unset one is not limited."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "has(self.sandboxes) || has(self.runningExecutions) || has(self.requests)"
                " || has(self.limits) || has(self.workspaceStorage)",
                "set at least one of sandboxes, runningExecutions, requests, limits,"
                " workspaceStorage",
            )
        )
    )

    sandboxes: Annotated[int | None, Field(ge=0, le=1_000_000)] = Field(
        default=None,
        description="How many Sandboxes the namespace may hold (one-shot sandboxes of"
        " Executions included). Paused ones count: they keep their workspace.",
    )
    running_executions: Annotated[int | None, Field(ge=0, le=1_000_000)] = Field(
        default=None,
        description="How many Executions may run at once in the namespace; more wait"
        " Queued (reason QuotaExceeded) and start as running ones finish.",
    )
    requests: ComputeLimits | None = Field(
        default=None,
        description="Total CPU and memory requests of the namespace's Sandboxes (their"
        " pods' containers). A Sandbox holds its share from admission until it is"
        " deleted, paused or not.",
    )
    limits: ComputeLimits | None = Field(
        default=None,
        description="Total CPU and memory limits of the namespace's Sandboxes.",
    )
    workspace_storage: Annotated[
        Quantity | None, Bounds.quantity("workspaceStorage", "0", "1Ei")
    ] = Field(
        default=None,
        description="Total size of the persistent workspaces (ephemeral ones count nothing).",
    )


class QuotaUsage(Model):
    """What the namespace's admitted Sandboxes and running Executions hold."""

    sandboxes: int = Field(default=0, description="Admitted Sandboxes.")
    running_executions: int = Field(default=0, description="Executions running now.")
    requests: ComputeLimits = Field(
        default_factory=ComputeLimits, description="CPU and memory requests held."
    )
    limits: ComputeLimits = Field(
        default_factory=ComputeLimits, description="CPU and memory limits held."
    )
    workspace_storage: Quantity | None = Field(default=None, description="Workspace storage held.")


class SandboxQuotaStatus(Model):
    """Observed usage, written only by the operator."""

    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = Field(
        default=None, description="The spec generation the usage was last compared against."
    )
    used: QuotaUsage | None = Field(
        default=None, description="Current usage in the namespace (all of it, not per quota)."
    )
    waiting: int | None = Field(
        default=None,
        description="Sandboxes and Executions of the namespace waiting for this quota.",
    )
