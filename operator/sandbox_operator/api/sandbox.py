"""The Sandbox resource: an isolated, stateful pod with a workspace and an agent."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field
from pydantic.config import JsonDict

from sandbox_operator.api.common import (
    DNS_LABEL_PATTERN,
    DNS_SUBDOMAIN_PATTERN,
    POSITIVE_QUANTITY,
    Condition,
    Duration,
    EnvVar,
    Model,
    Quantity,
    cel,
    validations,
)

# `default: {}` on an optional object makes the API server fill in its fields
# defaults too, so what `kubectl get -o yaml` shows is what the operator uses.
_SERVER_DEFAULT: JsonDict = {"default": {}}


class OnIdle(StrEnum):
    DELETE = "Delete"
    PAUSE = "Pause"


class EgressPolicy(StrEnum):
    """What the sandbox may reach.

    Internet: public addresses only (no cluster-internal or metadata access).
    None: no egress at all. Cluster: anything, cluster services included.
    """

    INTERNET = "Internet"
    NONE = "None"
    CLUSTER = "Cluster"


class Resources(Model):
    """Limits of the sandbox container. Memory and ephemeral storage are also its
    requests; CPU is requested at the operator's `sandbox_cpu_request` (idle sandboxes
    should not hold whole cores)."""

    cpu: Annotated[
        Quantity | None,
        Field(
            json_schema_extra=validations(
                cel(POSITIVE_QUANTITY, "cpu must be a positive quantity such as 500m, 2 or 1Gi")
            )
        ),
    ] = None
    memory: Annotated[
        Quantity | None,
        Field(
            json_schema_extra=validations(
                cel(POSITIVE_QUANTITY, "memory must be a positive quantity such as 500m, 2 or 1Gi")
            )
        ),
    ] = None
    ephemeral_storage: Annotated[
        Quantity | None,
        Field(
            json_schema_extra=validations(
                cel(
                    POSITIVE_QUANTITY,
                    "ephemeralStorage must be a positive quantity such as 500m, 2 or 1Gi",
                )
            )
        ),
    ] = None


class Workspace(Model):
    """The sandbox's persistent working directory, mounted at /workspace."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!(has(self.ephemeral) && self.ephemeral && has(self.storageClassName))",
                "storageClassName cannot be set for an ephemeral workspace",
            ),
            cel(
                "!(has(self.ephemeral) && self.ephemeral && has(self.fromSnapshot))",
                "fromSnapshot needs a persistent workspace (not ephemeral)",
            ),
        )
    )

    ephemeral: bool = Field(
        default=False, description="Use an emptyDir instead of a PersistentVolumeClaim."
    )
    size: Annotated[
        Quantity | None,
        Field(
            json_schema_extra=validations(
                cel(POSITIVE_QUANTITY, "size must be a positive quantity such as 500m, 2 or 1Gi")
            )
        ),
    ] = Field(default=None, description="Workspace size; the operator default applies when unset.")
    storage_class_name: Annotated[
        str | None, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)
    ] = None
    from_snapshot: Annotated[str | None, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)] = (
        Field(
            default=None,
            description=(
                "A Snapshot (same namespace) the workspace starts from. Changing it on an"
                " existing Sandbox rolls the workspace back to that snapshot: the pod stops,"
                " the claim is replaced from the snapshot, the pod starts again."
            ),
        )
    )


class Lifecycle(Model):
    idle_timeout: Duration | None = Field(
        default=None,
        description="Tear down after this long without exec or file activity (agent-reported).",
    )
    max_lifetime: Duration | None = Field(
        default=None, description="Tear down this long after creation, whatever the activity."
    )
    on_idle: OnIdle = Field(default=OnIdle.DELETE, description="What idle timeout does.")
    snapshot_on_idle: bool = Field(
        default=False,
        description=(
            "Take a Snapshot of the workspace before the idle policy deletes or pauses the"
            " sandbox. The Snapshot is not owned by the Sandbox: it outlives it."
        ),
    )
    snapshot_timeout: Duration | None = Field(
        default=None,
        description=(
            "How long the idle policy waits for that Snapshot before it goes ahead anyway"
            " (the operator's default applies when unset)."
        ),
    )


class ExposedPort(Model):
    name: Annotated[str, Field(pattern=DNS_LABEL_PATTERN, max_length=15)]
    port: Annotated[int, Field(ge=1, le=65535)]
    protocol: Annotated[str, Field(pattern="^(TCP|UDP)$")] = "TCP"


class Network(Model):
    egress: EgressPolicy = EgressPolicy.INTERNET
    exposed_ports: Annotated[list[ExposedPort], Field(max_length=16)] = Field(
        default_factory=list,
        description="Ports of the sandbox container published through a Service.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["port"]},
    )


class SandboxSpec(Model):
    """Desired state of a Sandbox."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!(has(self.runtime) && has(self.image))",
                "set at most one of runtime or image",
            ),
            cel(
                "!(has(self.workspace) && has(self.workspace.ephemeral) && self.workspace.ephemeral"
                " && has(self.lifecycle) && has(self.lifecycle.onIdle)"
                " && self.lifecycle.onIdle == 'Pause')",
                "lifecycle.onIdle: Pause needs a persistent workspace (not workspace.ephemeral)",
            ),
            cel(
                "!(has(self.workspace) && has(self.workspace.ephemeral) && self.workspace.ephemeral"
                " && has(self.lifecycle) && has(self.lifecycle.snapshotOnIdle)"
                " && self.lifecycle.snapshotOnIdle)",
                "lifecycle.snapshotOnIdle needs a persistent workspace (not workspace.ephemeral)",
            ),
        )
    )

    runtime: Annotated[str | None, Field(pattern=DNS_LABEL_PATTERN, max_length=63)] = Field(
        default=None, description="A runtime from the operator's catalog, e.g. python or node."
    )
    image: Annotated[str | None, Field(min_length=1, max_length=512, pattern=r"^\S+$")] = Field(
        default=None, description="A container image with python3 >= 3.9 (instead of runtime)."
    )
    image_pull_policy: Annotated[str | None, Field(pattern="^(Always|IfNotPresent|Never)$")] = None
    resources: Resources = Field(default_factory=Resources, json_schema_extra=_SERVER_DEFAULT)
    workspace: Workspace = Field(default_factory=Workspace, json_schema_extra=_SERVER_DEFAULT)
    env: Annotated[list[EnvVar], Field(max_length=128)] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    paused: bool = Field(default=False, description="Delete the pod, keep the workspace.")
    lifecycle: Lifecycle = Field(default_factory=Lifecycle, json_schema_extra=_SERVER_DEFAULT)
    network: Network = Field(default_factory=Network, json_schema_extra=_SERVER_DEFAULT)
    runtime_class_name: Annotated[
        str | None, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)
    ] = Field(default=None, description="Passed through to the pod, e.g. gvisor or kata.")
    node_selector: Annotated[dict[str, str], Field(max_length=32)] = Field(default_factory=dict)


class SandboxStatus(Model):
    """Observed state, written only by the operator."""

    model_config = ConfigDict(extra="ignore")

    phase: str | None = None
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    pod_name: str | None = None
    pod_ip: str | None = Field(default=None, alias="podIP")
    pod_uid: str | None = Field(
        default=None,
        alias="podUID",
        description="The running pod's UID (tells a replaced pod from the one a command ran in).",
    )
    agent_endpoint: str | None = None
    workspace_claim: str | None = None
    image: str | None = None
    last_activity: str | None = None
    idle_deadline: str | None = None
    idle_paused_at: str | None = Field(
        default=None, description="Set when the idle policy paused the sandbox; cleared on resume."
    )
    expires_at: str | None = None
    workspace_snapshot: str | None = Field(
        default=None, description="The Snapshot the current workspace was restored from."
    )
    workspace_lineage: list[str] = Field(
        default_factory=list,
        description="That Snapshot, then the one its source was restored from, and so on.",
    )
    workspace_restore_request: str | None = Field(
        default=None,
        description="The restore-requested-at annotation value the last restore answered.",
    )
    idle_snapshot: str | None = Field(
        default=None, description="The Snapshot the idle policy took (or is taking)."
    )
    idle_snapshot_started_at: str | None = None
    active_executions: int | None = None
    restarts: int | None = None
    message: str | None = None
