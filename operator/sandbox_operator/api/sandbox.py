"""The Sandbox resource: an isolated, stateful pod with a workspace and an agent.

Besides the spec and status models, this module declares the status
vocabulary users and scripts match on: phases, condition types and reasons.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import ConfigDict, Field, model_validator
from pydantic.config import JsonDict

from sandbox_operator.api.common import (
    DNS_LABEL_PATTERN,
    DNS_SUBDOMAIN_PATTERN,
    MAX_INPUT_CHARACTERS,
    MOUNT_PATH_PATTERN,
    RESERVED_MOUNT_PATTERN,
    RFC3339_PATTERN,
    Bounds,
    Condition,
    Duration,
    EnvVar,
    InputFile,
    Model,
    Quantity,
    cel,
    total_size_rule,
    validations,
)

# `default: {}` on an optional object makes the API server fill in its fields
# defaults too, so what `kubectl get -o yaml` shows is what the operator uses.
_SERVER_DEFAULT: JsonDict = {"default": {}}

# Fields a template may set carry their defaults in the operator, not in the schema:
# a value the API server filled in would be indistinguishable from one the user
# wrote, and would always override the template's.
_OPERATOR_DEFAULT: JsonDict = {"x-operator-default": True}

# The characters all env values of one Sandbox may hold together (see total_size_rule).
MAX_ENV_CHARACTERS = 65536


class SandboxPhase(StrEnum):
    """The human summary (the PHASE column), derived from the Ready condition's reason."""

    PENDING = "Pending"
    STARTING = "Starting"
    RUNNING = "Running"
    PAUSED = "Paused"
    FAILED = "Failed"
    TERMINATING = "Terminating"
    RESTORING = "Restoring"


class SandboxCondition(StrEnum):
    """Condition types. Ready is always present; the others only while they apply:

    - WorkspaceReady: the spec is valid (the claim's state, or Ephemeral);
    - Paused: the spec is valid and the children could be created;
    - PodScheduled, AgentReady, RuntimeReady: a pod exists and the sandbox is
      neither paused nor being restored (AgentReady and RuntimeReady once it is
      scheduled and has not ended);
    - WorkspaceRestored: `spec.workspace.fromSnapshot` is set;
    - WorkspaceFull: only while True, from the agent's report of its workspace's
      filesystem (see builders.sandbox_status.workspace_full);
    - MemoryKept: with `lifecycle.pauseMode: Memory`, from a pause's save of
      the pod until the resumed pod is ready (see handlers.sandbox.memory);
    - PidLimitReached, CpuThrottled: only while True, from the sandbox
      container's cgroup counters as the agent reports them (see
      builders.sandbox_status.pid_limit_reached and cpu_throttled);
    - Reconciling, Stalled (kstatus): only while True, from Ready (see
      builders.conditions.progress).
    """

    READY = "Ready"
    WORKSPACE_READY = "WorkspaceReady"
    WORKSPACE_RESTORED = "WorkspaceRestored"
    WORKSPACE_FULL = "WorkspaceFull"
    PID_LIMIT_REACHED = "PidLimitReached"
    CPU_THROTTLED = "CpuThrottled"
    PAUSED = "Paused"
    POD_SCHEDULED = "PodScheduled"
    AGENT_READY = "AgentReady"
    RUNTIME_READY = "RuntimeReady"
    MEMORY_KEPT = "MemoryKept"
    RECONCILING = "Reconciling"
    STALLED = "Stalled"


class SandboxReason(StrEnum):
    """Condition reasons: stable CamelCase words; messages carry the detail."""

    READY = "SandboxReady"
    INVALID_SPEC = "InvalidSpec"
    CREATE_FAILED = "CreateFailed"
    PAUSED = "Paused"
    PAUSING = "Pausing"
    NOT_PAUSED = "NotPaused"
    RESUMING = "Resuming"
    POD_MISSING = "PodMissing"
    UNSCHEDULABLE = "Unschedulable"
    SCHEDULED = "Scheduled"
    POD_PENDING = "PodPending"
    POD_FAILED = "PodFailed"
    POD_TERMINATING = "PodTerminating"
    AGENT_READY = "AgentReady"
    AGENT_NOT_READY = "AgentNotReady"
    RUNTIME_RUNNING = "RuntimeRunning"
    RUNTIME_STARTING = "RuntimeStarting"
    RUNTIME_NO_PYTHON = "RuntimeMissingPython"
    RUNTIME_FAILED = "RuntimeFailed"
    IMAGE_PULL = "ImagePullFailed"
    TERMINATING = "Terminating"
    CLAIM_BOUND = "ClaimBound"
    CLAIM_PENDING = "ClaimPending"
    CLAIM_LOST = "ClaimLost"
    WORKSPACE_PENDING = "WorkspacePending"
    EPHEMERAL = "Ephemeral"
    NO_POD = "NoPod"
    RESTORED = "Restored"
    RESTORING = "Restoring"
    ROLLING_BACK = "RollingBack"
    SNAPSHOT_NOT_READY = "SnapshotNotReady"
    SNAPSHOT_FAILED = "SnapshotFailed"
    # A rollback named a snapshot that did not exist (or had failed) when the
    # operator looked: the request is dropped for good, the workspace kept.
    RESTORE_REFUSED = "RestoreRefused"
    # A SandboxQuota of the namespace, or a Kubernetes ResourceQuota, has no room.
    QUOTA_EXCEEDED = "QuotaExceeded"
    # spec.templateRef names a template that does not exist (yet).
    TEMPLATE_NOT_FOUND = "TemplateNotFound"
    # The template's base snapshot is being built, or its build failed.
    TEMPLATE_NOT_READY = "TemplateNotReady"
    # spec.poolRef names a SandboxPool that does not exist.
    POOL_NOT_FOUND = "PoolNotFound"
    # The pool has no ready member and its whenEmpty is Wait.
    POOL_EMPTY = "PoolEmpty"
    # The claimed member that served this Sandbox was deleted (its pod and workspace with it).
    POOL_MEMBER_LOST = "PoolMemberLost"
    # A child's name is still held by the object of an earlier Sandbox of the same
    # name, which the garbage collector is removing: this one starts when it is gone.
    PREDECESSOR_DELETING = "PredecessorDeleting"
    # spec.files could not be written into the workspace (the agent's answer says why).
    FILES_NOT_WRITTEN = "FilesNotWritten"
    # Under 1% of the workspace is free: writes fail with ENOSPC.
    NO_SPACE_LEFT = "NoSpaceLeft"
    # The pod's PID limit refused new processes since the last look.
    FORK_REFUSED = "ForkRefused"
    # The CPU limit stopped the sandbox in most scheduling periods since the last look.
    CPU_LIMIT = "CpuLimit"
    # pauseMode Memory: the pod was saved whole (MemoryKept True) ...
    CHECKPOINTED = "Checkpointed"
    # ... checkpointd refused or failed to save it: the pause waits, the pod runs on;
    CHECKPOINT_FAILED = "CheckpointFailed"
    # ... no checkpointd answered on the pod's node: the pause waits, the pod runs on;
    CHECKPOINTER_UNAVAILABLE = "CheckpointerUnavailable"
    # ... the resumed pod came back from the image, processes and memory included;
    MEMORY_RESTORED = "MemoryRestored"
    # ... the resumed pod started afresh from the workspace alone (message: why).
    MEMORY_LOST = "MemoryLost"


class OnIdle(StrEnum):
    DELETE = "Delete"
    PAUSE = "Pause"


class PauseMode(StrEnum):
    """What a pause keeps: the workspace, or the workspace and the running
    processes with their memory (a gVisor runtime class; docs/pause-memory.md)."""

    WORKSPACE = "Workspace"
    MEMORY = "Memory"


class EgressPolicy(StrEnum):
    """What the sandbox may reach.

    Internet: public addresses only (no cluster-internal or metadata access).
    None: no egress at all. Cluster: anything, cluster services included.
    """

    INTERNET = "Internet"
    NONE = "None"
    CLUSTER = "Cluster"


class Resources(Model):
    """Limits of the sandbox container, and the profile its requests come from.
    Changing them restarts the pod."""

    cpu: Annotated[Quantity | None, Bounds.quantity("cpu", "10m", "512")] = Field(
        default=None, description="CPU limit (default: the operator's default_cpu)."
    )
    memory: Annotated[Quantity | None, Bounds.quantity("memory", "32Mi", "4Ti")] = Field(
        default=None,
        description="Memory limit and request; python3 and the runner need about 32Mi"
        " (default: the operator's default_memory).",
    )
    ephemeral_storage: Annotated[
        Quantity | None, Bounds.quantity("ephemeralStorage", "64Mi", "16Ti")
    ] = Field(
        default=None,
        description="Scratch space outside the workspace (the container's writable layer);"
        " the kubelet evicts the pod beyond it (default: the operator's"
        " default_ephemeral_storage).",
    )
    profile: Annotated[str | None, Field(pattern=DNS_LABEL_PATTERN, max_length=63)] = Field(
        default=None,
        description="The operator's resource profile (resource_profiles; `standard` and"
        " `dense` unless configured otherwise): what the sandbox and its agent request"
        " of a node under their limits, so how many fit one. `standard` reserves"
        " memory up to the limit and 150m CPU; `dense` about what an idle sandbox"
        " uses (default: the operator's default_resource_profile).",
    )


class Workspace(Model):
    """The sandbox's persistent working directory, mounted at /workspace (or mountPath)."""

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
        default=False,
        description="Use an emptyDir instead of a PersistentVolumeClaim (lost with the pod).",
        json_schema_extra=_OPERATOR_DEFAULT,
    )
    size: Annotated[Quantity | None, Bounds.quantity("size", "16Mi", "64Ti")] = Field(
        default=None, description="Workspace size (default: the operator's default_workspace_size)."
    )
    storage_class_name: Annotated[
        str | None, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)
    ] = Field(
        default=None,
        description="StorageClass of the workspace claim (default: the cluster's default class).",
    )
    mount_path: Annotated[str | None, Field(pattern=MOUNT_PATH_PATTERN, max_length=128)] = Field(
        default=None,
        json_schema_extra=validations(
            cel(
                f"!self.matches('{RESERVED_MOUNT_PATTERN}')",
                "mountPath cannot hide a directory of the image or the pod"
                " (/proc, /sys, /dev, /etc, /tmp, /run, /usr, /bin, /sbin, /lib, /var, /sandbox)",
            )
        ),
        description="Where the sandbox container sees the workspace (default /workspace); it is"
        " also the working directory and HOME. An absolute path of a fresh directory:"
        " not /, and not under /proc, /sys, /dev, /etc, /tmp, /run, /usr, /bin, /sbin,"
        " /lib, /var or /sandbox.",
    )
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
    """When the operator stops the sandbox by itself."""

    idle_timeout: Annotated[Duration | None, Bounds.duration("idleTimeout", "1s")] = Field(
        default=None,
        description="Tear down after this long without exec or file activity (agent-reported;"
        " a running command counts as activity). Default: the operator's default_idle_timeout.",
    )
    max_lifetime: Annotated[Duration | None, Bounds.duration("maxLifetime", "1s")] = Field(
        default=None, description="Delete the Sandbox this long after creation, whatever it does."
    )
    expires_at: Annotated[str | None, Field(pattern=RFC3339_PATTERN, max_length=40)] = Field(
        default=None,
        description="A lease: at this time (RFC 3339, e.g. 2026-01-02T15:04:05Z) the operator"
        " ends the sandbox as onExpiry says. Moving it (either way) renews or shortens the"
        " lease. While it is set, the operator's default idle timeout does not apply (an"
        " explicit idleTimeout still does).",
        json_schema_extra={"format": "date-time"},
    )
    on_expiry: OnIdle = Field(
        default=OnIdle.DELETE,
        description="What the end of the lease (expiresAt) does: Delete (the default) the"
        " Sandbox, or Pause it (keeps the workspace; resume with the"
        " sandbox.dev/resume-requested-at annotation and a later expiresAt).",
        json_schema_extra=_OPERATOR_DEFAULT,
    )
    on_idle: OnIdle = Field(
        default=OnIdle.DELETE,
        description="What the idle timeout does: Delete (the default) the Sandbox, or Pause"
        " it (keeps the workspace; resume with the sandbox.dev/resume-requested-at"
        " annotation).",
        json_schema_extra=_OPERATOR_DEFAULT,
    )
    snapshot_on_idle: bool = Field(
        default=False,
        description=(
            "Take a Snapshot of the workspace before the idle policy deletes or pauses the"
            " sandbox (and before pausedTimeout deletes it), and delete only once it is"
            " Ready: a snapshot that fails leaves the sandbox paused instead. The Snapshot"
            " is not owned by the Sandbox: it outlives it."
        ),
        json_schema_extra=_OPERATOR_DEFAULT,
    )
    snapshot_timeout: Annotated[Duration | None, Bounds.duration("snapshotTimeout", "1s")] = Field(
        default=None,
        description="How long the idle policy waits for that Snapshot to be Ready before it"
        " counts as failed (the operator's idle_snapshot_timeout applies when unset).",
    )
    paused_timeout: Annotated[Duration | None, Bounds.duration("pausedTimeout", "1s")] = Field(
        default=None,
        description="Delete the Sandbox once it has been paused (by spec.paused or by the"
        " idle policy) this long; once a Snapshot is Ready when snapshotOnIdle is set.",
    )
    pause_mode: PauseMode = Field(
        default=PauseMode.WORKSPACE,
        description="What a pause (spec.paused, onIdle or onExpiry Pause) keeps: Workspace"
        " (the default) or Memory: the running processes too, with their memory, open files"
        " and listening sockets, saved by the node's checkpointd and restored into the"
        " resumed pod on the same node. Memory needs a gVisor runtime class"
        " (runtimeClassName) and a persistent workspace. When the save fails the sandbox"
        " keeps running (condition MemoryKept says why); when the image is gone at resume"
        " the sandbox starts from its workspace (MemoryKept False, reason MemoryLost).",
        json_schema_extra=_OPERATOR_DEFAULT,
    )


class ExposedPort(Model):
    """A port of the sandbox container, published through the Sandbox's Service."""

    name: Annotated[str, Field(pattern=DNS_LABEL_PATTERN, max_length=15)] = Field(
        description="The Service port's name."
    )
    port: Annotated[int, Field(ge=1, le=65535)] = Field(
        description="The port number, in the sandbox and on the Service."
    )
    protocol: Annotated[str, Field(pattern="^(TCP|UDP)$")] = Field(
        default="TCP", description="TCP or UDP."
    )
    public: bool = Field(
        default=False,
        description="Reachable through the gateway's preview URL without credentials."
        " Otherwise a scoped token or the preview cookie it sets is needed.",
    )


class Network(Model):
    """Reachability of the sandbox. Changing it never restarts the pod."""

    egress: EgressPolicy = Field(
        default=EgressPolicy.INTERNET,
        description="Internet (the default): public addresses only (no cluster-internal or"
        " metadata access); None: nothing; Cluster: anything, cluster services included.",
        json_schema_extra=_OPERATOR_DEFAULT,
    )
    exposed_ports: Annotated[list[ExposedPort], Field(max_length=16)] = Field(
        default_factory=list,
        description="Ports of the sandbox container published through a Service.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["port"]},
    )


class TemplateKind(StrEnum):
    NAMESPACED = "SandboxTemplate"
    CLUSTER = "ClusterSandboxTemplate"


class TemplateRef(Model):
    """The template a Sandbox takes its defaults (and base snapshot) from."""

    kind: TemplateKind = Field(
        default=TemplateKind.NAMESPACED,
        description="SandboxTemplate (same namespace) or ClusterSandboxTemplate.",
    )
    name: Annotated[str, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)] = Field(
        description="The template's name."
    )


class PoolRef(Model):
    """The SandboxPool (same namespace) a Sandbox takes a warm member from."""

    name: Annotated[str, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)] = Field(
        description="The pool's name."
    )


class PoolOutcome(StrEnum):
    """How a Sandbox naming a pool got its pod."""

    CLAIMED = "Claimed"
    COLD_START = "ColdStart"
    WAITING = "Waiting"


class PoolUse(Model):
    """What a Sandbox naming a pool got from it."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(description="The pool's name.")
    outcome: PoolOutcome = Field(
        description="Claimed (a warm member serves it), ColdStart (started the ordinary"
        " way: the pool was empty or the Sandbox asks for what its members lack) or"
        " Waiting (the pool is empty and waits for a member)."
    )
    template_ref: TemplateRef = Field(description="The pool's template, as read.")
    member: str | None = Field(
        default=None,
        description="The claimed member: a Sandbox this one now owns, whose pod, workspace"
        " and token serve it.",
    )
    member_uid: str | None = Field(default=None, description="The claimed member's UID.")
    message: str | None = Field(default=None, description="Why a cold start, in words.")


class Toleration(Model):
    """Passed through to the pod (core/v1 Toleration)."""

    key: Annotated[str | None, Field(max_length=316)] = Field(
        default=None, description="Taint key."
    )
    operator: Annotated[str | None, Field(pattern="^(Exists|Equal)$")] = Field(
        default=None, description="Exists or Equal (default Equal)."
    )
    value: Annotated[str | None, Field(max_length=63)] = Field(
        default=None, description="Taint value."
    )
    effect: Annotated[str | None, Field(pattern="^(NoSchedule|PreferNoSchedule|NoExecute)$")] = (
        Field(default=None, description="NoSchedule, PreferNoSchedule or NoExecute.")
    )
    toleration_seconds: int | None = Field(
        default=None, description="How long a NoExecute taint is tolerated."
    )


# Keys the operator sets on its pods; user labels must not take them over.
_RESERVED_LABEL_RULE = cel(
    "!self.exists(k, k.startsWith('sandbox.dev/') || k == 'app.kubernetes.io/managed-by')",
    "keys under sandbox.dev/ and app.kubernetes.io/managed-by are the operator's",
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
                "!(has(self.poolRef) && has(self.templateRef))",
                "set at most one of poolRef or templateRef (a pool has its template)",
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
            cel(
                "!(has(self.lifecycle) && has(self.lifecycle.pauseMode)"
                " && self.lifecycle.pauseMode == 'Memory' && !has(self.runtimeClassName)"
                " && !has(self.templateRef) && !has(self.poolRef))",
                "lifecycle.pauseMode: Memory needs runtimeClassName: a gVisor class (e.g. gvisor)",
            ),
            cel(
                "!(has(self.workspace) && has(self.workspace.ephemeral) && self.workspace.ephemeral"
                " && has(self.lifecycle) && has(self.lifecycle.pauseMode)"
                " && self.lifecycle.pauseMode == 'Memory')",
                "lifecycle.pauseMode: Memory needs a persistent workspace (not"
                " workspace.ephemeral)",
            ),
            total_size_rule(
                MAX_ENV_CHARACTERS,
                {
                    "env": "has(self.env) ? self.env.map(e, has(e.value) ? size(e.value) : 0)"
                    ".sum() : 0"
                },
                "the values of env",
            ),
            total_size_rule(
                MAX_INPUT_CHARACTERS,
                {"files": "has(self.files) ? self.files.map(f, size(f.content)).sum() : 0"},
                "the contents of files",
            ),
        )
    )

    template_ref: TemplateRef | None = Field(
        default=None,
        description="A template whose fields are this Sandbox's defaults (its own fields win;"
        " env, nodeSelector, pod labels and annotations are merged by key) and whose base"
        " snapshot its workspace starts from. Read once, when the Sandbox first starts:"
        " later edits of the template reach new Sandboxes only. Immutable.",
        json_schema_extra=validations(cel("self == oldSelf", "templateRef is immutable")),
    )
    pool_ref: PoolRef | None = Field(
        default=None,
        description="A SandboxPool of this namespace: the Sandbox takes one of its warm"
        " members (Ready at once) and the pool's template gives its defaults. When the pool"
        " is empty, or this Sandbox asks for what only a new pod gives (another image,"
        " resources, workspace), it starts cold or waits, per the pool's whenEmpty;"
        " status.pool says which. Immutable.",
        json_schema_extra=validations(cel("self == oldSelf", "poolRef is immutable")),
    )
    runtime: Annotated[str | None, Field(pattern=DNS_LABEL_PATTERN, max_length=63)] = Field(
        default=None, description="A runtime from the operator's catalog, e.g. python or node."
    )
    image: Annotated[str | None, Field(min_length=1, max_length=512, pattern=r"^\S+$")] = Field(
        default=None, description="A container image with python3 >= 3.9 (instead of runtime)."
    )
    image_pull_policy: Annotated[str | None, Field(pattern="^(Always|IfNotPresent|Never)$")] = (
        Field(
            default=None,
            description="Always, IfNotPresent or Never (default: the operator's setting).",
        )
    )
    resources: Resources = Field(
        default_factory=Resources,
        description="CPU, memory and scratch-space limits of the sandbox container.",
        json_schema_extra=_SERVER_DEFAULT,
    )
    workspace: Workspace = Field(
        default_factory=Workspace,
        description="The working directory at /workspace: a claim (kept while paused) or"
        " an emptyDir.",
        json_schema_extra=_SERVER_DEFAULT,
    )
    env: Annotated[list[EnvVar], Field(max_length=128)] = Field(
        default_factory=list,
        description="Environment of the commands run in the sandbox. Changing it reaches"
        " commands started afterwards, without restarting the pod.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    files: Annotated[list[InputFile], Field(max_length=64)] = Field(
        default_factory=list,
        description="Files written into the workspace through the agent before the Sandbox"
        " is first Ready (a claimed pool member's too), and again when this list changes:"
        " a file the user edited since is overwritten then, one left out is not deleted."
        " An ephemeral workspace gets them again in every new pod. Merged with the"
        " template's by path.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["path"]},
    )
    paused: bool = Field(default=False, description="Delete the pod, keep the workspace.")
    lifecycle: Lifecycle = Field(
        default_factory=Lifecycle,
        description="Idle timeout, maximum lifetime and what happens when idle.",
        json_schema_extra=_SERVER_DEFAULT,
    )
    network: Network = Field(
        default_factory=Network,
        description="Egress policy and exposed ports.",
        json_schema_extra=_SERVER_DEFAULT,
    )
    runtime_class_name: Annotated[
        str | None, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)
    ] = Field(default=None, description="Passed through to the pod, e.g. gvisor or kata.")
    node_selector: Annotated[dict[str, str], Field(max_length=32)] = Field(
        default_factory=dict, description="Passed through to the pod."
    )
    tolerations: Annotated[list[Toleration], Field(max_length=32)] = Field(
        default_factory=list, description="Passed through to the pod."
    )
    pod_labels: Annotated[dict[str, Annotated[str, Field(max_length=63)]], Field(max_length=32)] = (
        Field(
            default_factory=dict,
            description="Extra labels of the pod (not under sandbox.dev/).",
            json_schema_extra=validations(_RESERVED_LABEL_RULE),
        )
    )
    pod_annotations: Annotated[
        dict[str, Annotated[str, Field(max_length=4096)]], Field(max_length=32)
    ] = Field(
        default_factory=dict,
        description="Extra annotations of the pod (not under sandbox.dev/).",
        json_schema_extra=validations(_RESERVED_LABEL_RULE),
    )

    @model_validator(mode="after")
    def _inputs_fit(self) -> SandboxSpec:
        if sum(len(var.value or "") for var in self.env) > MAX_ENV_CHARACTERS:
            raise ValueError(f"the values of env may hold at most {MAX_ENV_CHARACTERS} characters")
        if sum(len(file.content) for file in self.files) > MAX_INPUT_CHARACTERS:
            raise ValueError(
                f"the contents of files may hold at most {MAX_INPUT_CHARACTERS} characters"
            )
        return self

    @model_validator(mode="after")
    def _memory_pause_fits(self) -> SandboxSpec:
        # The CEL rules see the Sandbox alone; this sees it with its template's
        # defaults (the effective spec the operator validates).
        if self.lifecycle.pause_mode is PauseMode.MEMORY:
            if not self.runtime_class_name:
                raise ValueError(
                    "lifecycle.pauseMode: Memory needs runtimeClassName: a gVisor class"
                    " (e.g. gvisor)"
                )
            if self.workspace.ephemeral:
                raise ValueError(
                    "lifecycle.pauseMode: Memory needs a persistent workspace (not"
                    " workspace.ephemeral)"
                )
        return self


class PortStatus(Model):
    """An exposed port as users reach it."""

    name: str = Field(description="The port's name.")
    port: int = Field(description="The port number in the sandbox.")
    url: str | None = Field(
        default=None, description="Its preview URL through the gateway (when one is set up)."
    )
    public: bool = Field(default=False, description="Reachable without credentials.")


class TemplateUse(Model):
    """What a Sandbox took from its template when it first started."""

    model_config = ConfigDict(extra="ignore")

    kind: TemplateKind = Field(description="SandboxTemplate or ClusterSandboxTemplate.")
    name: str = Field(description="The template's name.")
    generation: int | None = Field(default=None, description="The template generation read.")
    base_snapshot: str | None = Field(
        default=None, description="The template's base snapshot the workspace started from."
    )
    defaults: dict[str, Any] = Field(
        default_factory=dict,
        description="The template's sandbox fields as read (this Sandbox's own fields win).",
        json_schema_extra={"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    )


class RestoreRefusal(Model):
    """A rollback request that was dropped, so that no later namesake applies it."""

    model_config = ConfigDict(extra="ignore")

    snapshot: str = Field(description="The Snapshot the request named.")
    request: str = Field(
        default="", description="The restore-requested-at annotation value of the request."
    )
    message: str = Field(default="", description="Why it was dropped.")


class MemoryImage(Model):
    """The saved pod of a sandbox paused with pauseMode Memory."""

    model_config = ConfigDict(extra="ignore")

    key: str = Field(description="The image's name in the node's checkpoint store.")
    node: str = Field(description="The node that holds it (the resumed pod runs there).")
    pod_uid: str = Field(description="The pod it was taken from.")
    bytes: int = Field(default=0, description="Its size on the node's disk.")
    taken_at: str = Field(description="When it was taken (RFC 3339).")


class SandboxStatus(Model):
    """Observed state, written only by the operator."""

    model_config = ConfigDict(extra="ignore")

    phase: SandboxPhase | None = Field(
        default=None, description="A summary for people; scripts should read the conditions."
    )
    observed_generation: int | None = Field(
        default=None, description="The spec generation this status was computed from."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready always; WorkspaceReady, WorkspaceRestored, Paused, PodScheduled,"
        " AgentReady and RuntimeReady while they apply.",
    )
    pod_name: str | None = Field(default=None, description="The sandbox's pod.")
    pod_ip: str | None = Field(default=None, alias="podIP", description="The pod's IP address.")
    pod_uid: str | None = Field(
        default=None,
        alias="podUID",
        description="The running pod's UID (tells a replaced pod from the one a command ran in).",
    )
    agent_endpoint: str | None = Field(
        default=None, description="URL of the agent in the pod (reachable by the operator)."
    )
    workspace_claim: str | None = Field(
        default=None, description="The PersistentVolumeClaim of the workspace."
    )
    image: str | None = Field(default=None, description="The runtime image in use.")
    ports: list[PortStatus] | None = Field(
        default=None, description="The exposed ports and their preview URLs."
    )
    ready_pod_uid: str | None = Field(
        default=None,
        alias="readyPodUID",
        description="The last pod seen serving; one that stops serving for longer than the"
        " operator's agent_unready_patience is replaced.",
    )
    last_activity: str | None = Field(
        default=None, description="The last exec or file activity the agent reported."
    )
    active_executions: int | None = Field(
        default=None, description="Commands running in the sandbox, as the agent reported."
    )
    idle_deadline: str | None = Field(
        default=None, description="When the idle policy acts unless there is activity."
    )
    idle_paused_at: str | None = Field(
        default=None, description="Set when the idle policy paused the sandbox; cleared on resume."
    )
    expires_at: str | None = Field(
        default=None,
        description="When the Sandbox's life ends: the earlier of lifecycle.maxLifetime"
        " after creation and the lease (lifecycle.expiresAt).",
    )
    workspace_snapshot: str | None = Field(
        default=None, description="The Snapshot the current workspace was restored from."
    )
    workspace_lineage: list[str] | None = Field(
        default=None,
        description="That Snapshot, then the one its source was restored from, and so on.",
    )
    workspace_restore_request: str | None = Field(
        default=None,
        description="The restore-requested-at annotation value the last restore answered.",
    )
    workspace_restore_refused: RestoreRefusal | None = Field(
        default=None,
        description="The last rollback request that was dropped because its Snapshot did not"
        " exist, had failed or was being deleted; it never applies later (ask again with a"
        " new request).",
    )
    idle_snapshot: str | None = Field(
        default=None, description="The Snapshot the idle policy took (or is taking)."
    )
    idle_snapshot_started_at: str | None = Field(
        default=None, description="When the idle policy asked for that Snapshot."
    )
    template: TemplateUse | None = Field(
        default=None, description="The template this Sandbox started from, as read then."
    )
    paused_since: str | None = Field(
        default=None,
        description="When the pod was stopped for a pause (pausedTimeout counts from it).",
    )
    paused_deadline: str | None = Field(
        default=None, description="When lifecycle.pausedTimeout deletes the paused Sandbox."
    )
    pool: PoolUse | None = Field(
        default=None, description="What this Sandbox got from spec.poolRef's pool."
    )
    files_written: str | None = Field(
        default=None,
        description="A digest of spec.files as last written into the workspace (and of the"
        " pod, for an ephemeral workspace).",
    )
    memory: MemoryImage | None = Field(
        default=None,
        description="pauseMode Memory: the saved pod the next resume restores; cleared once"
        " the resumed pod is ready (or memory was lost).",
    )
    processes_from: str | None = Field(
        default=None,
        description="pauseMode Memory: the UID of the pod whose processes and memory the"
        " current pod (podUID) carries on, restored from its image; unset for a pod that"
        " started afresh. An Execution running in that pod follows its command here.",
    )
    admitted: bool | None = Field(
        default=None,
        description="Counted against the namespace's SandboxQuotas: set once the sandbox"
        " fitted them; it holds its share until it is deleted.",
    )
