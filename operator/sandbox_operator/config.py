"""Operator settings: images, runtime catalog, defaults. Configuration, not code.

Read once at startup from the YAML file named by `SANDBOX_OPERATOR_CONFIG` (the
chart mounts it from a ConfigMap); any field may be overridden by an environment
variable `SANDBOX_OPERATOR_<FIELD>` holding JSON or a plain string. Which
namespaces are watched is Kopf's own flag (`--all-namespaces` or `--namespace`),
rendered by the chart from its values.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sandbox_operator.api.common import Duration, Quantity

M = TypeVar("M", bound=BaseModel)
NonNegative = Annotated[int, Field(ge=0)]


class Runtime(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str
    description: str = ""


class Requests(BaseModel):
    """What one container requests of a node; unset: its limit (the node never
    promises what it lacks). Each is capped at the container's limit."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu: Quantity | None = None
    memory: Quantity | None = None
    ephemeral_storage: Quantity | None = None

    def to_wire(self) -> dict[str, str]:
        named = {
            "cpu": self.cpu,
            "memory": self.memory,
            "ephemeral-storage": self.ephemeral_storage,
        }
        return {key: value for key, value in named.items() if value is not None}


class ResourceProfile(BaseModel):
    """What a sandbox's two containers request of a node, under their limits.

    Requests decide how many sandboxes a node holds; limits (the Sandbox's
    resources, the agent's settings) what each may use. A memory request under
    the limit makes the pod Burstable: more idle sandboxes fit, and under
    memory or disk pressure the kubelet evicts first the pods furthest above
    their requests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    description: str = ""
    sandbox: Requests
    agent: Requests


# An idle sandbox measured on the local node: agent 20.5 MiB, runner 8.5 MiB,
# no CPU to speak of (benchmarks/density_bench.py measures it again).
DEFAULT_PROFILES = {
    "standard": ResourceProfile(
        description="Memory and disk reserved up to their limits, 150m CPU: sandboxes at work",
        sandbox=Requests(cpu="100m"),
        agent=Requests(cpu="50m"),
    ),
    "dense": ResourceProfile(
        description="About what an idle sandbox uses (10m CPU, 64Mi, 128Mi of disk),"
        " Burstable: many mostly idle sandboxes",
        sandbox=Requests(cpu="5m", memory="32Mi", ephemeral_storage="64Mi"),
        agent=Requests(cpu="5m", memory="32Mi", ephemeral_storage="64Mi"),
    ),
}


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    agent_image: str = "sandbox-agent:dev"
    image_pull_policy: str = "IfNotPresent"
    runtimes: dict[str, Runtime] = Field(
        default_factory=lambda: {
            "python": Runtime(image="sandbox-runtime-python:dev", description="Python 3"),
            "node": Runtime(image="sandbox-runtime-node:dev", description="Node.js and Python 3"),
        }
    )
    default_runtime: str = "python"

    # Defaults for fields a Sandbox leaves unset.
    # The CPU limit; requests come from the resource profile (capped at the limits).
    default_cpu: Quantity = "1"
    default_memory: Quantity = "1Gi"
    default_ephemeral_storage: Quantity = "2Gi"
    default_workspace_size: Quantity = "1Gi"
    # What sandboxes request of a node, by name; a Sandbox or template picks one
    # with spec.resources.profile.
    resource_profiles: dict[str, ResourceProfile] = Field(
        default_factory=lambda: dict(DEFAULT_PROFILES)
    )
    default_resource_profile: str = "standard"
    default_storage_class: str | None = None
    default_idle_timeout: Duration | None = "30m"
    default_max_lifetime: Duration | None = None

    # The agent container.
    agent_port: Annotated[int, Field(ge=1, le=65535)] = 8080
    # A limit, not a request (the resource profile sets that): the agent's start
    # (its imports, the runner's placement) is on the way to every start and
    # resume, and under 250m it took a second of wall time for a quarter second
    # of CPU (docs/benchmarks.md, "Resume against a pod start").
    agent_cpu: Quantity = "1"
    agent_memory: Quantity = "256Mi"
    agent_ephemeral_storage: Quantity = "512Mi"
    # Distinct UIDs: user code must not be able to act as the agent.
    sandbox_uid: int = 1000
    agent_uid: int = 1001
    # Shared group of both containers: workspace files stay usable by both.
    fs_group: int = 1000

    # NetworkPolicy: who may reach the agent, and what "Internet" egress excludes.
    operator_namespace: str = "sandbox-system"
    operator_pod_labels: dict[str, str] = Field(
        default_factory=lambda: {"app.kubernetes.io/name": "sandbox-operator"}
    )
    gateway_pod_labels: dict[str, str] | None = None
    # Where clients reach the gateway, the base of status.ports[].url: the chart
    # sets the gateway's external URL (gateway.externalURL), else its Service's
    # in-cluster URL, which resolves only in pods. The domain of preview hosts
    # `{port}-{sandbox}-{namespace}.{preview_domain}`, when set, wins.
    gateway_url: str | None = None
    preview_domain: str | None = None
    preview_scheme: str = "https"
    private_cidrs: list[str] = Field(
        default_factory=lambda: [
            "10.0.0.0/8",
            "172.16.0.0/12",
            "192.168.0.0/16",
            "100.64.0.0/10",
            "169.254.0.0/16",
        ]
    )
    dns_namespace: str = "kube-system"
    dns_pod_labels: dict[str, str] = Field(default_factory=lambda: {"k8s-app": "kube-dns"})

    # Executions.
    # Executions running at once in one sandbox; later ones wait, in creation order.
    max_executions_per_sandbox: Annotated[int, Field(ge=1, le=1024)] = 8
    # How long an Execution waits for its sandbox to exist and be ready before failing.
    execution_sandbox_wait: Duration = "10m"
    # Bytes of stdout/stderr kept in an Execution's status (the agent keeps the rest).
    execution_output_tail_bytes: Annotated[int, Field(ge=0, le=65536)] = 4096
    # Longest single wait on the agent for a command's exit (then the loop looks around).
    execution_poll_seconds: Annotated[float, Field(gt=0, le=600)] = 20.0
    # SIGTERM-to-SIGKILL grace when an Execution is cancelled or deleted.
    execution_cancel_grace_seconds: Annotated[float, Field(ge=0, le=300)] = 2.0

    # Snapshots. No class: the VolumeSnapshotClass of the workspace volume's
    # CSI driver (the one marked default, if several).
    volume_snapshot_class: str | None = None
    # How long the agent keeps executions stopped for a quiescing Snapshot if
    # the operator never tells it to resume (a crash, say).
    snapshot_quiesce_seconds: float = 120.0
    # How long the idle policy waits for its Snapshot before it deletes or pauses anyway.
    idle_snapshot_timeout: Duration = "10m"

    # Pauses that keep memory (lifecycle.pauseMode: Memory, docs/pause-memory.md).
    # The runtime classes whose pods checkpointd can save (gVisor's).
    memory_pause_runtime_classes: list[str] = Field(default_factory=lambda: ["gvisor"])
    # Where checkpointd's pods run (the chart's checkpointd.namespace) and listen.
    checkpointd_namespace: str = "sandbox-node"
    checkpointd_port: Annotated[int, Field(ge=1, le=65535)] = 8450
    # A service account token for the audience sandbox-checkpointd (the chart
    # projects one here).
    checkpointd_token_file: str = "/var/run/secrets/sandbox-checkpointd/token"
    # How soon a pause whose save failed tries again (the sandbox runs meanwhile).
    memory_retry_seconds: Annotated[float, Field(gt=0, le=3600)] = 30.0
    # How long a resumed pod pinned to the image's node may stay unscheduled
    # before the image is given up and the sandbox starts anywhere, from its workspace.
    memory_node_patience: Duration = "2m"

    # A pod whose agent stops being ready for longer than this (while its runtime
    # container runs) is replaced on the same workspace. The kubelet restarts a
    # wedged runtime container well before that (see builders.sandbox).
    agent_unready_patience: Duration = "2m"

    # Quotas: how often a Sandbox refused by a quota (a SandboxQuota or a
    # ResourceQuota) looks again for room; a look costs no API request.
    quota_retry_seconds: Annotated[float, Field(gt=0, le=600)] = 5.0

    # Reconciliation. A Sandbox is looked at when something happens to it and when
    # one of its deadlines comes (handlers.sandbox.deadlines); besides, a running
    # sandbox's agent is asked for its report this often (activity, workspace
    # usage, PID and CPU limits), which is also the period of the other kinds'
    # timers and of the retries that name no delay of their own.
    reconcile_interval_seconds: float = Field(default=30.0, gt=0)
    # The longest a Sandbox goes without a pass when nothing is due: a safety net
    # against a change no watch reports, not a poll (+-10 %, spread by UID).
    resync_interval_seconds: float = Field(default=600.0, gt=0)
    # Requests in flight to the API server, for each of the operator's two
    # clients (its own, and Kopf's for finalizers and bookkeeping); the rest
    # wait in this process for a connection, not in the API server's queues.
    api_connections: int = Field(default=64, ge=4, le=1024)
    agent_timeout_seconds: float = 5.0
    metrics_port: int = 8000
    max_workers: int = 32
    # Python's cycle collector (gc.set_threshold): allocations between young
    # collections, then young collections per middle one, middle per full. The
    # interpreter's (700, 10, 10) suit a short script; here nearly every
    # object parsed from a watch event survives (the indexes keep it), so each
    # collection walks objects that are not garbage: a quarter of the
    # operator's CPU at 1,000 Sandboxes (docs/benchmarks.md). Cycles still go,
    # only later; most of what the operator frees goes by reference counting.
    gc_thresholds: tuple[NonNegative, NonNegative, NonNegative] = (20_000, 20, 50)

    # High availability (Kopf peering; docs/operations.md, "High availability"). A replica
    # whose keep-alive is older than this is presumed dead and a standby takes
    # over, so a killed active replica is replaced within about this long.
    peering_lifetime_seconds: int = Field(default=10, ge=3, le=600)
    # The namespaces of `--namespace` (the chart sets them): a KopfPeering is
    # made in each; with `--all-namespaces` one ClusterKopfPeering.
    watch_namespaces: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _default_profile_is_offered(self) -> Settings:
        if self.default_resource_profile not in self.resource_profiles:
            offered = ", ".join(sorted(self.resource_profiles)) or "none"
            raise ValueError(
                f"default_resource_profile {self.default_resource_profile!r} is not one of"
                f" resource_profiles ({offered})"
            )
        return self


def load_model(model: type[M], prefix: str, environ: Mapping[str, str] | None = None) -> M:
    """Settings of `model` from the YAML file named by `<prefix>CONFIG`, then
    `<prefix><FIELD>` environment variables (JSON, or a plain string)."""
    env = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    path = env.get(f"{prefix}CONFIG")
    if path:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        data.update(loaded)
    for name in model.model_fields:
        raw = env.get(prefix + name.upper())
        if raw is None:
            continue
        try:
            data[name] = json.loads(raw)
        except json.JSONDecodeError:
            data[name] = raw
    return model.model_validate(data)


def load(environ: Mapping[str, str] | None = None) -> Settings:
    return load_model(Settings, "SANDBOX_OPERATOR_", environ)
