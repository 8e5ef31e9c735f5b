"""SandboxTemplate and ClusterSandboxTemplate: what sandboxes of one kind share.

A template holds defaults for the Sandbox spec (a Sandbox's own fields win),
and optional `setup` steps whose resulting workspace becomes the template's
base snapshot. Templates are also the catalog: `kubectl get
sandboxtemplates,clustersandboxtemplates` lists what can be started.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field

from sandbox_operator.api.common import (
    DNS_LABEL_PATTERN,
    DNS_SUBDOMAIN_PATTERN,
    Bounds,
    Condition,
    Duration,
    Model,
    cel,
    validations,
)
from sandbox_operator.api.sandbox import SandboxSpec, TemplateKind

MAX_SETUP_STEPS = 32
MAX_SCRIPT_CHARACTERS = 65536


class TemplateCondition(StrEnum):
    """Ready: sandboxes of the template can start (its base snapshot, when it has
    setup steps, is ready)."""

    READY = "Ready"


class TemplateReason(StrEnum):
    READY = "TemplateReady"
    NO_SETUP = "NoSetup"
    BUILDING = "Building"
    SETUP_FAILED = "SetupFailed"
    SNAPSHOT_FAILED = "SnapshotFailed"
    INVALID_SPEC = "InvalidSpec"


class SetupStep(Model):
    """One setup command, run with /bin/sh in /workspace of the build sandbox."""

    name: Annotated[str, Field(pattern=DNS_LABEL_PATTERN, max_length=40)] = Field(
        description="The step's name (unique in the template); failures name it."
    )
    script: Annotated[str, Field(min_length=1, max_length=MAX_SCRIPT_CHARACTERS)] = Field(
        description="A shell script. Only /workspace is kept in the base snapshot, so"
        " install into it (e.g. `python3 -m venv /workspace/.venv`)."
    )
    timeout: Annotated[Duration, Bounds.duration("timeout", "1s", "2h")] = Field(
        default="10m", description="Fail the step (and the build) after this long."
    )


_TEMPLATE_RULES = (
    cel(
        "!has(self.sandbox) || (!has(self.sandbox.templateRef) && !has(self.sandbox.poolRef)"
        " && !(has(self.sandbox.paused) && self.sandbox.paused))",
        "sandbox.templateRef, sandbox.poolRef and sandbox.paused cannot be set in a template",
    ),
    cel(
        "!has(self.sandbox) || !has(self.sandbox.workspace)"
        " || !has(self.sandbox.workspace.fromSnapshot)",
        "sandbox.workspace.fromSnapshot cannot be set in a template (use setup steps)",
    ),
    cel(
        "!has(self.setup) || size(self.setup) == 0 || !has(self.sandbox)"
        " || !has(self.sandbox.workspace) || !has(self.sandbox.workspace.ephemeral)"
        " || !self.sandbox.workspace.ephemeral",
        "setup steps need a persistent workspace (not workspace.ephemeral)",
    ),
)


class SandboxTemplateSpec(Model):
    """Desired state of a SandboxTemplate or ClusterSandboxTemplate."""

    model_config = ConfigDict(json_schema_extra=validations(*_TEMPLATE_RULES))

    description: Annotated[str, Field(max_length=256)] = Field(
        default="", description="What the template is for, shown by `kubectl get`."
    )
    sandbox: SandboxSpec = Field(
        default_factory=SandboxSpec,
        description="Defaults for the spec of Sandboxes of this template; a Sandbox's own"
        " fields win (env, nodeSelector, pod labels and annotations are merged by key).",
    )
    default_pool: Annotated[str | None, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)] = (
        Field(
            default=None,
            description="A SandboxPool, in the namespace of each Sandbox of this template, that"
            " such Sandboxes claim a warm member from, as if they named it in spec.poolRef."
            " Where no such pool of this template exists, they start cold.",
        )
    )
    setup: Annotated[list[SetupStep], Field(max_length=MAX_SETUP_STEPS)] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="Commands run once, in order, in a sandbox of the template; the"
        " resulting workspace becomes the base snapshot every new Sandbox of the template"
        " starts from. Changing them (or the sandbox fields they run with) builds a new"
        " base. Namespaced SandboxTemplates only: snapshots do not cross namespaces.",
    )


class ClusterSandboxTemplateSpec(SandboxTemplateSpec):
    """Desired state of a ClusterSandboxTemplate (no setup: snapshots are namespaced)."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            *_TEMPLATE_RULES,
            cel(
                "!has(self.setup) || size(self.setup) == 0",
                "setup needs a namespaced SandboxTemplate: snapshots cannot be restored"
                " across namespaces",
            ),
        )
    )


class SandboxTemplateStatus(Model):
    """Observed state, written only by the operator."""

    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = Field(
        default=None, description="The spec generation this status was computed from."
    )
    conditions: list[Condition] = Field(default_factory=list, description="Ready.")
    setup_hash: str | None = Field(
        default=None, description="Digest of the setup steps and the sandbox fields they ran with."
    )
    base_snapshot: str | None = Field(
        default=None,
        description="The Snapshot new Sandboxes of the template start from (the latest"
        " successful build).",
    )
    build_sandbox: str | None = Field(
        default=None, description="The Sandbox the current build runs in."
    )
    build_log: Annotated[str | None, Field(max_length=8192)] = Field(
        default=None, description="The tail of the last build's output."
    )


__all__ = [
    "ClusterSandboxTemplateSpec",
    "SandboxTemplateSpec",
    "SandboxTemplateStatus",
    "SetupStep",
    "TemplateCondition",
    "TemplateKind",
    "TemplateReason",
]
