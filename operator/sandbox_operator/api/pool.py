"""SandboxPool: warm, fully started sandboxes of one template, claimed by new Sandboxes.

A Sandbox naming the pool (spec.poolRef, or its template's defaultPool) takes
a ready member instead of starting a pod, so it is Ready without a cold start.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field

from sandbox_operator.api.common import Condition, Model
from sandbox_operator.api.sandbox import TemplateRef

MAX_REPLICAS = 1000


class WhenEmpty(StrEnum):
    """What a claim does when no member is ready."""

    COLD_START = "ColdStart"
    WAIT = "Wait"


class PoolCondition(StrEnum):
    READY = "Ready"


class PoolReason(StrEnum):
    FULL = "PoolFull"
    FILLING = "Filling"
    TEMPLATE_NOT_FOUND = "TemplateNotFound"
    TEMPLATE_WITHOUT_PYTHON = "TemplateWithoutPython"
    # The template's own status says no Sandbox of it can run here (InvalidSpec).
    TEMPLATE_INVALID = "TemplateInvalid"
    MEMBER_FAILING = "MemberFailing"


class SandboxPoolSpec(Model):
    """Desired state of a SandboxPool."""

    template_ref: TemplateRef = Field(
        description="The template the members are started from: a SandboxTemplate of the"
        " pool's namespace or a ClusterSandboxTemplate."
    )
    replicas: Annotated[int, Field(ge=0, le=MAX_REPLICAS)] = Field(
        default=1,
        description="How many ready, unclaimed members to keep. Claimed members leave the"
        " pool and are replaced. `kubectl scale sandboxpool/NAME --replicas=N` sets it.",
    )
    max_creating: Annotated[int, Field(ge=1, le=100)] = Field(
        default=5,
        description="At most this many members being created at once, so a burst of"
        " claims refills at a pace the API server and the node can take.",
    )
    when_empty: WhenEmpty = Field(
        default=WhenEmpty.COLD_START,
        description="When no member is ready: ColdStart starts the Sandbox the ordinary"
        " way; Wait keeps it Ready=False (reason PoolEmpty) until a member is ready.",
    )


class SandboxPoolStatus(Model):
    """Observed state, written only by the operator."""

    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = Field(
        default=None, description="The spec generation this status was computed from."
    )
    replicas: int = Field(default=0, description="Unclaimed members (ready or being created).")
    ready: int = Field(default=0, description="Members ready to be claimed.")
    creating: int = Field(default=0, description="Members being started.")
    claimed: int = Field(
        default=0, description="Members now serving a Sandbox (they no longer count as replicas)."
    )
    template_generation: int | None = Field(
        default=None, description="The template generation new members are made from."
    )
    selector: str = Field(
        default="", description="Label selector of the unclaimed members (for an HPA)."
    )
    conditions: list[Condition] = Field(default_factory=list, description="Ready.")


__all__ = [
    "MAX_REPLICAS",
    "PoolCondition",
    "PoolReason",
    "SandboxPoolSpec",
    "SandboxPoolStatus",
    "WhenEmpty",
]
