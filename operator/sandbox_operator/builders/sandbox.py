"""Desired children of a Sandbox, as plain dicts. Pure: no I/O, no clock.

Every child is named deterministically from the sandbox, labelled so the
operator can watch only its own pods (names and labels: `identity`), and
owned by the Sandbox so the garbage collector removes it when the Sandbox goes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, TypeVar

from sandbox_operator.api.common import API_VERSION, parse_duration, quantity_value
from sandbox_operator.api.execution import MAX_TIMEOUT
from sandbox_operator.api.sandbox import EgressPolicy, MemoryImage, PauseMode, SandboxSpec
from sandbox_operator.config import Requests, ResourceProfile, Settings
from sandbox_operator.identity import (
    AGENT_CONTAINER,
    SANDBOX_CONTAINER,
    TOKEN_KEY,
    SandboxRef,
    labels,
    names,
)
from sandbox_operator.resources import (
    DEFAULT_CONTAINER_ANNOTATION,
    IMAGE_ANNOTATION,
    POD_HASH_ANNOTATION,
    POD_SPEC_ANNOTATION,
    RESTORE_FROM_ANNOTATION,
)

JSON = dict[str, Any]
T = TypeVar("T")

WORKSPACE_PATH = "/workspace"
RUNTIME_DIR = "/sandbox/run"
TOKEN_DIR = "/var/run/sandbox-agent/token"

# The agent's probes. /readyz waits up to 2 s for the runner of a container that
# is just starting, so a normal pod start logs no failed probe.
READINESS_PATH = "/readyz?waitSeconds=2"
# Answers 503 once the agent has decided the runtime container must restart (a
# command that would not die); the kubelet then kills every process in it.
RUNTIME_LIVENESS_PATH = "/livez/runtime"

# The sandbox container's entrypoint: wait for the agent to place the runner
# (it places runner.py last, each file atomically), then become it, with the
# argv and sys.path it would have had as `python3 /sandbox/run/runner.py`.
# sys.path is set first: with -c, its first entry is the working directory,
# the user's workspace, from which no module may be imported.
RUNNER_PATH = f"{RUNTIME_DIR}/runner.py"
RUNNER_WAIT_SECONDS = 300
# The runner's interpreter skips the user's site-packages: they are in the
# workspace (HOME), where a caller allowed only to write files could plant a
# .pth or usercustomize.py that the runner would run at its next start. Commands
# the runner starts do not inherit the flag: `pip install --user` still works.
RUNNER_PYTHON = ("python3", "-s")
RUNNER_BOOTSTRAP = f"""import sys
sys.path[0] = {RUNTIME_DIR!r}
import os, time
deadline = time.monotonic() + {RUNNER_WAIT_SECONDS}
while not os.path.exists({RUNNER_PATH!r}):
    if time.monotonic() > deadline:
        sys.exit("sandbox: the agent did not place its runner in {RUNNER_WAIT_SECONDS} s")
    time.sleep(0.02)
os.execvp("python3", [*{RUNNER_PYTHON!r}, {RUNNER_PATH!r}])
"""

# The runtime directory holds only the runner script and its socket.
_RUNTIME_DIR_LIMIT = "16Mi"
# Under gVisor each container's bind mount of a pod volume is a filesystem of
# its own, so the runner's socket would not be seen from the agent's side: the
# runtime volume is one tmpfs of the pod inside gVisor instead (the shim reads
# these from the pod's annotations, which containerd passes on when its runsc
# runtime lists them in pod_annotations). The socket then stays inside gVisor,
# where a checkpoint can save it (docs/pause-memory.md). runc ignores them.
_RUNTIME_VOLUME = "runtime"
_GVISOR_SHARED_RUNTIME = {
    f"dev.gvisor.spec.mount.{_RUNTIME_VOLUME}.{field}": value
    for field, value in (("share", "pod"), ("type", "tmpfs"), ("options", "rw"))
}
_AGENT_LOG_LIMIT = "256Mi"
# The agent prunes its logs to stay under this, well inside the volume's limit
# (going over it gets the pod evicted).
_AGENT_LOG_BUDGET = 192 << 20
# A pod saved whole (pauseMode Memory) keeps the agent's own volumes inside
# gVisor as tmpfs: a restore reopens every file its processes had open, and an
# emptyDir of the new pod on the host is empty (seen: the agent's journal,
# "failed to walk executions.journal"). Their contents are then memory of the
# sandbox, saved in its image: the log budget is smaller.
_MEMORY_PAUSE_VOLUMES = ("agent-logs", "agent-tmp")
_GVISOR_MEMORY_VOLUMES = {
    f"dev.gvisor.spec.mount.{volume}.{field}": value
    for volume in _MEMORY_PAUSE_VOLUMES
    for field, value in (("share", "container"), ("type", "tmpfs"), ("options", "rw"))
}
_AGENT_LOG_BUDGET_IN_MEMORY = 48 << 20


def _meta(ref: SandboxRef, name: str) -> JSON:
    return {
        "name": name,
        "namespace": ref.namespace,
        "labels": labels(ref.name),
        "ownerReferences": [
            {
                "apiVersion": API_VERSION,
                "kind": "Sandbox",
                "name": ref.name,
                "uid": ref.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def image_of(spec: SandboxSpec, settings: Settings) -> str:
    """The runtime image; raises ValueError naming the catalog when unknown."""
    if spec.image:
        return spec.image
    runtime = spec.runtime or settings.default_runtime
    return _offered(settings.runtimes, runtime, "runtime").image


def profile_of(spec: SandboxSpec, settings: Settings) -> ResourceProfile:
    """The resource profile; raises ValueError naming the offered ones when unknown."""
    name = spec.resources.profile or settings.default_resource_profile
    return _offered(settings.resource_profiles, name, "resource profile")


def settings_problem(spec: SandboxSpec, settings: Settings, at: str = "spec") -> str | None:
    """What in `spec` this operator's settings cannot serve (None: nothing): a
    runtime or resource profile it does not offer, or an exposed port that is the
    agent's own (serving it would open the agent to the preview URL). `at` is
    where the spec sits in the object, for the message."""
    for field, offered in (("runtime", image_of), ("resources.profile", profile_of)):
        try:
            offered(spec, settings)
        except ValueError as exc:
            return f"{at}.{field}: {exc}"
    for i, port in enumerate(spec.network.exposed_ports):
        if port.port == settings.agent_port:
            return (
                f"{at}.network.exposedPorts[{i}].port: {port.port} is reserved for the sandbox"
                f" agent (reserved ports: {settings.agent_port})"
            )
    return None


def _offered(catalog: Mapping[str, T], name: str, what: str) -> T:
    """`catalog[name]`, or ValueError naming what this cluster offers instead."""
    if name not in catalog:
        known = ", ".join(sorted(catalog)) or "none"
        raise ValueError(f"unknown {what} {name!r}; this cluster offers: {known}")
    return catalog[name]


def build_secret(ref: SandboxRef, token: str) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(ref, names(ref.name)["secret"]),
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token},
    }


def build_claim(ref: SandboxRef, spec: SandboxSpec, settings: Settings) -> JSON | None:
    """The workspace PVC, or None for an ephemeral (emptyDir) workspace."""
    if spec.workspace.ephemeral:
        return None
    claim: JSON = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(ref, names(ref.name)["claim"]),
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {
                "requests": {"storage": spec.workspace.size or settings.default_workspace_size}
            },
        },
    }
    storage_class = spec.workspace.storage_class_name or settings.default_storage_class
    if storage_class:
        claim["spec"]["storageClassName"] = storage_class
    return claim


def _resources(cpu: str, memory: str, ephemeral: str, requests: Requests) -> JSON:
    """The limits, and the resource profile's requests (each capped at its limit;
    unset: the limit). Sandboxes idle most of their life: reserving their full
    CPU would fit a fraction of them on a node, so every profile asks for less."""
    limits = {"cpu": cpu, "memory": memory, "ephemeral-storage": ephemeral}
    asked = requests.to_wire()
    return {
        "requests": {key: _at_most(asked.get(key, limit), limit) for key, limit in limits.items()},
        "limits": limits,
    }


def _at_most(request: str, limit: str) -> str:
    return limit if quantity_value(request) > quantity_value(limit) else request


def _restricted(uid: int, read_only_root: bool) -> JSON:
    """A container security context that passes Pod Security Standards `restricted`."""
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": read_only_root,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _env(spec: SandboxSpec) -> list[JSON]:
    return [var.to_wire() for var in spec.env]


def build_pod(ref: SandboxRef, spec: SandboxSpec, settings: Settings) -> JSON:
    child = names(ref.name)
    keeps_memory = spec.lifecycle.pause_mode is PauseMode.MEMORY
    image = image_of(spec, settings)
    profile = profile_of(spec, settings)
    pull_policy = spec.image_pull_policy or settings.image_pull_policy
    agent_http = {"path": READINESS_PATH, "port": "agent"}

    if spec.workspace.ephemeral:
        workspace_volume: JSON = {
            "name": "workspace",
            "emptyDir": {"sizeLimit": spec.workspace.size or settings.default_workspace_size},
        }
    else:
        workspace_volume = {
            "name": "workspace",
            "persistentVolumeClaim": {"claimName": child["claim"]},
        }

    agent = {
        "name": AGENT_CONTAINER,
        "image": settings.agent_image,
        "imagePullPolicy": settings.image_pull_policy,
        "env": [
            {"name": "SANDBOX_AGENT_PORT", "value": str(settings.agent_port)},
            {"name": "SANDBOX_AGENT_TOKEN_FILE", "value": f"{TOKEN_DIR}/{TOKEN_KEY}"},
            {"name": "SANDBOX_AGENT_WORKSPACE", "value": WORKSPACE_PATH},
            {"name": "SANDBOX_AGENT_RUNTIME_DIR", "value": RUNTIME_DIR},
            {"name": "SANDBOX_AGENT_LOG_DIR", "value": "/sandbox/logs"},
            # The longest Execution timeout the CRD admits: both sides agree by construction.
            {
                "name": "SANDBOX_AGENT_MAX_TIMEOUT",
                "value": f"{parse_duration(MAX_TIMEOUT).total_seconds():g}",
            },
            {"name": "TMPDIR", "value": "/tmp"},
            # The agent sizes its memory budgets from its real limit.
            {
                "name": "SANDBOX_AGENT_MEMORY_LIMIT_BYTES",
                "valueFrom": {
                    "resourceFieldRef": {
                        "containerName": AGENT_CONTAINER,
                        "resource": "limits.memory",
                    }
                },
            },
            {
                "name": "SANDBOX_AGENT_MAX_LOG_DIR_BYTES",
                "value": str(_AGENT_LOG_BUDGET_IN_MEMORY if keeps_memory else _AGENT_LOG_BUDGET),
            },
        ],
        "ports": [{"name": "agent", "containerPort": settings.agent_port, "protocol": "TCP"}],
        # No startup probe: the sandbox container starts beside the agent and
        # waits for the runner itself (RUNNER_BOOTSTRAP). A startup probe held it
        # back until the probe's next one-second tick, on every start and resume.
        # The readiness probe waits (up to 2 s) for the runner to connect, so the
        # pod is Ready about when the runner is, not at a later tick.
        "readinessProbe": {
            "httpGet": agent_http,
            "periodSeconds": 2,
            "timeoutSeconds": 3,
            "failureThreshold": 2,
        },
        # The kubelet's default timeout (1 s) fails probes of a healthy agent on
        # a node busy enough: a Warning Event each time, though six in a row
        # are needed to restart it.
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "agent"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "securityContext": {
            **_restricted(settings.agent_uid, True),
            "runAsGroup": settings.fs_group,
        },
        "resources": _resources(
            settings.agent_cpu,
            settings.agent_memory,
            settings.agent_ephemeral_storage,
            profile.agent,
        ),
        "volumeMounts": [
            {"name": "workspace", "mountPath": WORKSPACE_PATH},
            {"name": _RUNTIME_VOLUME, "mountPath": RUNTIME_DIR},
            {"name": "agent-token", "mountPath": TOKEN_DIR, "readOnly": True},
            {"name": "agent-logs", "mountPath": "/sandbox/logs"},
            {"name": "agent-tmp", "mountPath": "/tmp"},
        ],
    }
    # The workspace is the user's home and working directory, where the spec says.
    home = spec.workspace.mount_path or WORKSPACE_PATH
    sandbox = {
        "name": SANDBOX_CONTAINER,
        "image": image,
        "imagePullPolicy": pull_policy,
        # The runner is placed by the agent; the image only needs python3 >= 3.9.
        "command": [*RUNNER_PYTHON, "-c", RUNNER_BOOTSTRAP],
        "workingDir": home,
        "env": [
            {"name": "HOME", "value": home},
            {"name": "SANDBOX_RUNNER_SOCKET", "value": f"{RUNTIME_DIR}/runner.sock"},
            *_env(spec),
        ],
        "securityContext": {
            **_restricted(settings.sandbox_uid, False),
            "runAsGroup": settings.fs_group,
        },
        "resources": _resources(
            spec.resources.cpu or settings.default_cpu,
            spec.resources.memory or settings.default_memory,
            spec.resources.ephemeral_storage or settings.default_ephemeral_storage,
            profile.sandbox,
        ),
        "volumeMounts": [
            {"name": "workspace", "mountPath": home},
            {"name": _RUNTIME_VOLUME, "mountPath": RUNTIME_DIR},
        ],
        # The agent's verdict, not the runner's: a runtime that cannot kill a command
        # (a fork bomb, a wedged runner) is restarted by the kubelet. Three misses,
        # so that an agent restart alone does not take user commands with it.
        # No `ports`: they are informational, and exposing a port must not restart
        # the pod (the Service targets the port number).
        "livenessProbe": {
            "httpGet": {"path": RUNTIME_LIVENESS_PATH, "port": settings.agent_port},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
    }
    pod_spec: JSON = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 10,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.sandbox_uid,
            "runAsGroup": settings.fs_group,
            "fsGroup": settings.fs_group,
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # Two plain containers, started together: the sandbox container waits
        # for the agent's runner itself (RUNNER_BOOTSTRAP). As a native sidecar
        # the agent cost every start and resume a second: the kubelet starts the
        # other containers only once its next runtime relist (once a second) has
        # seen the sidecar running (docs/benchmarks.md, "Resume against a pod
        # start"). The user's runtime first: what `kubectl exec` and `logs`
        # reach when no container is named.
        "containers": [sandbox, agent],
        "volumes": [
            workspace_volume,
            {"name": _RUNTIME_VOLUME, "emptyDir": {"sizeLimit": _RUNTIME_DIR_LIMIT}},
            {"name": "agent-logs", "emptyDir": {"sizeLimit": _AGENT_LOG_LIMIT}},
            {"name": "agent-tmp", "emptyDir": {"sizeLimit": _AGENT_LOG_LIMIT}},
            {
                "name": "agent-token",
                "secret": {"secretName": child["secret"], "defaultMode": 0o440},
            },
        ],
    }
    if spec.runtime_class_name:
        pod_spec["runtimeClassName"] = spec.runtime_class_name
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.to_wire() for t in spec.tolerations]
    meta = _meta(ref, child["pod"])
    # The user's keys first: the operator's own (which CEL keeps them from naming) win.
    meta["labels"] = {**spec.pod_labels, **meta["labels"]}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            **meta,
            "annotations": {
                **spec.pod_annotations,
                **_GVISOR_SHARED_RUNTIME,
                **(_GVISOR_MEMORY_VOLUMES if keeps_memory else {}),
                IMAGE_ANNOTATION: image,
                DEFAULT_CONTAINER_ANNOTATION: SANDBOX_CONTAINER,
            },
        },
        "spec": pod_spec,
    }


def preview_url(ref: SandboxRef, port: int, settings: Settings) -> str | None:
    """Where an exposed port is reached through the gateway: by host when a preview
    domain is set, else by path under the gateway's URL; None without a gateway."""
    if settings.preview_domain:
        host = f"{port}-{ref.name}-{ref.namespace}.{settings.preview_domain}"
        return f"{settings.preview_scheme}://{host}/"
    if settings.gateway_url:
        base = settings.gateway_url.rstrip("/")
        return f"{base}/v1/namespaces/{ref.namespace}/sandboxes/{ref.name}/ports/{port}/"
    return None


def port_statuses(ref: SandboxRef, spec: SandboxSpec, settings: Settings) -> list[JSON]:
    return [
        {
            "name": p.name,
            "port": p.port,
            "url": preview_url(ref, p.port, settings),
            "public": p.public,
        }
        for p in spec.network.exposed_ports
    ]


def build_service(ref: SandboxRef, spec: SandboxSpec) -> JSON | None:
    """A ClusterIP Service for the exposed ports, or None when nothing is exposed."""
    if not spec.network.exposed_ports:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(ref, names(ref.name)["service"]),
        "spec": {
            "type": "ClusterIP",
            "selector": labels(ref.name),
            "ports": [
                {"name": p.name, "port": p.port, "targetPort": p.port, "protocol": p.protocol}
                for p in spec.network.exposed_ports
            ],
        },
    }


def _peer(namespace: str, pod_labels: dict[str, str]) -> JSON:
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "podSelector": {"matchLabels": dict(pod_labels)},
    }


def build_network_policy(ref: SandboxRef, spec: SandboxSpec, settings: Settings) -> JSON:
    agent_peers = [_peer(settings.operator_namespace, settings.operator_pod_labels)]
    if settings.gateway_pod_labels:
        agent_peers.append(_peer(settings.operator_namespace, settings.gateway_pod_labels))
    ingress: list[JSON] = [
        {"from": agent_peers, "ports": [{"port": settings.agent_port, "protocol": "TCP"}]}
    ]
    if spec.network.exposed_ports:
        ingress.append(
            {
                "ports": [
                    {"port": p.port, "protocol": p.protocol} for p in spec.network.exposed_ports
                ]
            }
        )

    egress: list[JSON]
    if spec.network.egress == EgressPolicy.NONE:
        egress = []
    elif spec.network.egress == EgressPolicy.CLUSTER:
        egress = [{}]
    else:
        dns = [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]
        egress = [
            {"to": [_peer(settings.dns_namespace, settings.dns_pod_labels)], "ports": dns},
            {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": list(settings.private_cidrs)}}]},
        ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(ref, names(ref.name)["network_policy"]),
        "spec": {
            "podSelector": {"matchLabels": labels(ref.name)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": egress,
        },
    }


# -- what a pod was built from -------------------------------------------------------


def pod_stamp(spec: SandboxSpec) -> JSON:
    """The fields of the Sandbox spec that only a new pod can apply.

    Everything else reaches a running pod without a restart: env (through the
    agent, for commands started afterwards), network (the NetworkPolicy and the
    Service), lifecycle (but for pauseMode: Memory, whose pod keeps the agent's
    volumes in gVisor's memory), paused (the pod is deleted, not replaced) and
    workspace.fromSnapshot (a rollback replaces the pod by itself). Settings of
    the operator (a new agent image, say) are left out too: they reach each
    sandbox at its next pod start instead of restarting all of them at once."""
    return {
        "image": spec.image,
        "runtime": spec.runtime,
        "imagePullPolicy": spec.image_pull_policy,
        "resources": spec.resources.to_wire(),
        "workspace": spec.workspace.model_copy(update={"from_snapshot": None}).to_wire(),
        "runtimeClassName": spec.runtime_class_name,
        "nodeSelector": dict(spec.node_selector),
        # Newer fields only when set: pods stamped before they existed stay up to date.
        **({"tolerations": [t.to_wire() for t in spec.tolerations]} if spec.tolerations else {}),
        **({"podLabels": dict(spec.pod_labels)} if spec.pod_labels else {}),
        **({"podAnnotations": dict(spec.pod_annotations)} if spec.pod_annotations else {}),
        # The agent's volumes live in gVisor's memory then (see _GVISOR_MEMORY_VOLUMES).
        **(
            {"pauseMode": PauseMode.MEMORY.value}
            if spec.lifecycle.pause_mode is PauseMode.MEMORY
            else {}
        ),
    }


def files_digest(spec: SandboxSpec, pod_uid: str | None) -> str | None:
    """What `status.filesWritten` holds once spec.files is in the workspace (None: no
    files). An ephemeral workspace starts empty in every pod, so its pod counts too."""
    if not spec.files:
        return None
    essence: JSON = {"files": [file.to_wire() for file in spec.files]}
    if spec.workspace.ephemeral:
        essence["pod"] = pod_uid
    text = json.dumps(essence, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def stamp_annotation(spec: SandboxSpec) -> str:
    return json.dumps(pod_stamp(spec), sort_keys=True, separators=(",", ":"))


def stamp_pod(pod: JSON, spec: SandboxSpec) -> JSON:
    """`pod`, annotated with the stamp it was built from."""
    pod["metadata"].setdefault("annotations", {})[POD_SPEC_ANNOTATION] = stamp_annotation(spec)
    return pod


def desired_pod(
    ref: SandboxRef, spec: SandboxSpec, settings: Settings, memory: MemoryImage | None = None
) -> JSON:
    """The pod; with `memory`, one the node restores from that image."""
    pod = stamp_pod(build_pod(ref, spec, settings), spec)
    return restoring(pod, memory) if memory is not None else pod


def restoring(pod: JSON, memory: MemoryImage) -> JSON:
    """`pod`, to be restored from `memory`: it names the image, and it runs on the
    node that holds it (a required node affinity: the scheduler still checks
    that the pod fits there; one that cannot run there is given up on by the
    operator after memory_node_patience)."""
    pod["metadata"]["annotations"][RESTORE_FROM_ANNOTATION] = memory.key
    term = {"key": "kubernetes.io/hostname", "operator": "In", "values": [memory.node]}
    pod["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [term]}]
            }
        }
    }
    return pod


def legacy_pod_hash(spec: SandboxSpec) -> str:
    """The digest that pods made before the stamp existed carry (under
    POD_HASH_ANNOTATION): of the whole spec but `paused` and `workspace.fromSnapshot`."""
    workspace = spec.workspace.model_copy(update={"from_snapshot": None})
    stamped = spec.model_copy(update={"paused": False, "workspace": workspace}).to_wire()
    # Fields added since then, at their defaults, were not in what those pods hashed.
    for port in stamped.get("network", {}).get("exposedPorts", []):
        if port.get("public") is False:
            del port["public"]
    for key in ("tolerations", "podLabels", "podAnnotations", "files"):
        if not stamped.get(key):
            stamped.pop(key, None)
    if stamped.get("lifecycle", {}).get("onExpiry") == "Delete":
        del stamped["lifecycle"]["onExpiry"]
    if stamped.get("lifecycle", {}).get("pauseMode") == "Workspace":
        del stamped["lifecycle"]["pauseMode"]
    return hashlib.sha256(json.dumps(stamped, sort_keys=True).encode()).hexdigest()[:16]


def changed_fields(pod: JSON, spec: SandboxSpec) -> list[str] | None:
    """The spec fields whose change the pod has not got (empty: up to date).

    None for a pod made by an older operator whose digest no longer matches: it
    is out of date, but which field changed cannot be told."""
    annotations = pod["metadata"].get("annotations") or {}
    recorded = annotations.get(POD_SPEC_ANNOTATION)
    wanted = pod_stamp(spec)
    if recorded is None:
        return [] if annotations.get(POD_HASH_ANNOTATION) == legacy_pod_hash(spec) else None
    try:
        stamp = json.loads(recorded)
    except ValueError:
        return None
    return sorted(key for key in wanted.keys() | stamp.keys() if wanted.get(key) != stamp.get(key))
