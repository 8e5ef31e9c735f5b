"""Generate CustomResourceDefinitions from the pydantic models.

Pydantic's JSON Schema is close to, but not, a Kubernetes structural schema:
references must be inlined, `Optional[X]` must become plain X (absence means
unset), titles are noise, and enums must carry their type. This module does
those rewrites and nothing else, so the models stay the one source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from sandbox_operator.api.common import CATEGORY, GROUP, VERSION, cel
from sandbox_operator.api.execution import ExecutionSpec, ExecutionStatus
from sandbox_operator.api.pool import SandboxPoolSpec, SandboxPoolStatus
from sandbox_operator.api.quota import SandboxQuotaSpec, SandboxQuotaStatus
from sandbox_operator.api.sandbox import SandboxSpec, SandboxStatus
from sandbox_operator.api.snapshot import SnapshotSpec, SnapshotStatus
from sandbox_operator.api.template import (
    ClusterSandboxTemplateSpec,
    SandboxTemplateSpec,
    SandboxTemplateStatus,
)

JSON = dict[str, Any]

_DROPPED_KEYS = {"title"}


@dataclass(frozen=True)
class Kind:
    kind: str
    plural: str
    short_names: list[str]
    spec: type[BaseModel]
    status: type[BaseModel]
    columns: list[JSON] = field(default_factory=list)
    description: str = ""
    # Rules on the whole object, e.g. on metadata.name, which child names derive from.
    rules: list[JSON] = field(default_factory=list)
    scope: str = "Namespaced"
    # (specReplicasPath, statusReplicasPath, labelSelectorPath) for the scale subresource.
    scale: tuple[str, str, str] | None = None


def _column(name: str, json_path: str, type_: str = "string", priority: int = 0) -> JSON:
    column: JSON = {"name": name, "type": type_, "jsonPath": json_path}
    if priority:
        column["priority"] = priority
    return column


_AGE = _column("Age", ".metadata.creationTimestamp", "date")

KINDS: tuple[Kind, ...] = (
    Kind(
        kind="Sandbox",
        plural="sandboxes",
        short_names=["sbx"],
        spec=SandboxSpec,
        status=SandboxStatus,
        description="An isolated, stateful code-execution sandbox: a pod, a workspace, an agent.",
        rules=[
            cel(
                "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')"
                " && size(self.metadata.name) <= 50",
                "a Sandbox name must start with a letter, use only lowercase letters, digits"
                " and '-', and be at most 50 characters (its pod, service and claim names"
                " derive from it)",
            )
        ],
        columns=[
            _column("Phase", ".status.phase"),
            _column("Ready", '.status.conditions[?(@.type=="Ready")].status'),
            _column("Runtime", ".status.image", priority=1),
            _column("Pod IP", ".status.podIP", priority=1),
            _column("Last Activity", ".status.lastActivity", "date", priority=1),
            _column("Expires", ".status.expiresAt", priority=1),
            _AGE,
        ],
    ),
    Kind(
        kind="Execution",
        plural="executions",
        short_names=["sbxexec"],
        spec=ExecutionSpec,
        status=ExecutionStatus,
        description="One command run in a sandbox, with its outcome recorded in status.",
        columns=[
            _column("Sandbox", ".status.sandbox"),
            _column("Phase", ".status.phase"),
            _column("Exit", ".status.exitCode", "integer"),
            _column("Duration", ".status.duration"),
            _AGE,
        ],
    ),
    Kind(
        kind="Snapshot",
        plural="snapshots",
        short_names=["sbxsnap"],
        spec=SnapshotSpec,
        status=SnapshotStatus,
        description="A sandbox workspace captured as a CSI VolumeSnapshot.",
        columns=[
            _column("Sandbox", ".spec.sandboxRef.name"),
            _column("Tag", ".spec.tag"),
            _column("Ready", ".status.readyToUse", "boolean"),
            _column("Size", ".status.restoreSize"),
            _AGE,
        ],
    ),
    Kind(
        kind="SandboxQuota",
        plural="sandboxquotas",
        short_names=["sbxquota"],
        spec=SandboxQuotaSpec,
        status=SandboxQuotaStatus,
        description="Limits on the Sandboxes and running Executions of one namespace.",
        columns=[
            _column("Sandboxes", ".status.used.sandboxes", "integer"),
            _column("Max Sandboxes", ".spec.sandboxes", "integer"),
            _column("Running", ".status.used.runningExecutions", "integer"),
            _column("Max Running", ".spec.runningExecutions", "integer"),
            _column("Waiting", ".status.waiting", "integer"),
            _column("CPU Requests", ".status.used.requests.cpu", priority=1),
            _column("Memory Requests", ".status.used.requests.memory", priority=1),
            _column("Storage", ".status.used.workspaceStorage", priority=1),
            _AGE,
        ],
    ),
    Kind(
        kind="SandboxPool",
        plural="sandboxpools",
        short_names=["sbxpool"],
        spec=SandboxPoolSpec,
        status=SandboxPoolStatus,
        description="Warm, started Sandboxes of one template that new Sandboxes claim"
        " (spec.poolRef) instead of starting a pod.",
        columns=[
            _column("Template", ".spec.templateRef.name"),
            _column("Desired", ".spec.replicas", "integer"),
            _column("Ready", ".status.ready", "integer"),
            _column("Creating", ".status.creating", "integer"),
            _column("Claimed", ".status.claimed", "integer"),
            _column("Status", '.status.conditions[?(@.type=="Ready")].reason'),
            _AGE,
        ],
        rules=[
            cel(
                "size(self.metadata.name) <= 44",
                "a SandboxPool name may have at most 44 characters (its members are named"
                " after it, with a 6-character suffix, within a Sandbox name's 50)",
            )
        ],
        scale=(".spec.replicas", ".status.replicas", ".status.selector"),
    ),
    *(
        Kind(
            kind=kind,
            plural=f"{kind.lower()}s",
            short_names=[short],
            spec=spec,
            status=SandboxTemplateStatus,
            description=f"{what}: defaults for Sandboxes of one kind, optional setup steps"
            " whose workspace becomes their base snapshot; together the runtime catalog.",
            scope=scope,
            columns=[
                _column("Description", ".spec.description"),
                _column("Ready", '.status.conditions[?(@.type=="Ready")].status'),
                _column("Base Snapshot", ".status.baseSnapshot"),
                _column("Runtime", ".spec.sandbox.runtime", priority=1),
                _column("Image", ".spec.sandbox.image", priority=1),
                _AGE,
            ],
        )
        for kind, short, spec, scope, what in (
            ("SandboxTemplate", "sbxtpl", SandboxTemplateSpec, "Namespaced", "A template"),
            (
                "ClusterSandboxTemplate",
                "csbxtpl",
                ClusterSandboxTemplateSpec,
                "Cluster",
                "A cluster-wide template",
            ),
        )
    ),
)


def _resolve(schema: JSON, defs: dict[str, JSON]) -> JSON:
    """Inline $refs and rewrite pydantic idioms into structural-schema form."""
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        siblings = {k: v for k, v in schema.items() if k != "$ref"}
        return _resolve({**target, **siblings}, defs)

    out: JSON = {}
    for key, value in schema.items():
        if key in _DROPPED_KEYS:
            continue
        if key == "anyOf" and schema.get("x-kubernetes-int-or-string"):
            out[key] = value
            continue
        if key == "anyOf":
            variants = [v for v in value if v.get("type") != "null"]
            if len(variants) != 1:
                raise ValueError(f"unions other than Optional[X] are not structural: {value}")
            inner = _resolve(variants[0], defs)
            # The outer keys (description, default, validations) win over the inner ones,
            # but validations from both sides are kept.
            rules = inner.pop("x-kubernetes-validations", [])
            out = {**inner, **out}
            if rules:
                out["x-kubernetes-validations"] = [*rules, *out.get("x-kubernetes-validations", [])]
            continue
        if key == "properties":
            out[key] = {name: _resolve(prop, defs) for name, prop in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _resolve(value, defs)
        elif key == "x-kubernetes-validations":
            out[key] = [*out.get(key, []), *value]
        elif (
            key == "default" and (value is None or schema.get("x-operator-default"))
        ) or key == "x-operator-default":
            continue
        elif key == "additionalProperties" and value is True:
            # dict[str, Any]: kept whole by x-kubernetes-preserve-unknown-fields, which
            # `additionalProperties: true` beside it would turn into pruning below.
            continue
        elif key == "additionalProperties" and value is False:
            # Structural schemas forbid it next to `properties`; the server prunes instead.
            continue
        else:
            out[key] = value
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "const" in out:
        out["enum"] = [out.pop("const")]
        out.setdefault("type", "string")
    # type and description first: the generated YAML is read by people too.
    head: JSON = {k: out[k] for k in ("type", "description") if k in out}
    return {**head, **out}


def _no_defaults_in_lists(schema: Any, in_list: bool = False) -> Any:
    """No `default` inside a list's items: the API server would fill it into each
    item, and `kubectl apply` (which replaces a custom resource's lists whole)
    would then find every re-apply of an unchanged manifest `configured`. The
    models' defaults apply when the operator reads the object."""
    if isinstance(schema, list):
        return [_no_defaults_in_lists(v, in_list) for v in schema]
    if not isinstance(schema, dict):
        return schema
    return {
        key: _no_defaults_in_lists(value, in_list or key == "items")
        for key, value in schema.items()
        if not (in_list and key == "default")
    }


def openapi_schema(model: type[BaseModel]) -> JSON:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    cleaned: JSON = _no_defaults_in_lists(_resolve(raw, defs))
    return cleaned


def _subresources(kind: Kind) -> JSON:
    out: JSON = {"status": {}}
    if kind.scale:
        spec_path, status_path, selector_path = kind.scale
        out["scale"] = {
            "specReplicasPath": spec_path,
            "statusReplicasPath": status_path,
            "labelSelectorPath": selector_path,
        }
    return out


def crd(kind: Kind) -> JSON:
    spec_schema = openapi_schema(kind.spec)
    status_schema = openapi_schema(kind.status)
    schema: JSON = {
        "type": "object",
        "description": kind.description,
        "required": ["spec"],
        **({"x-kubernetes-validations": kind.rules} if kind.rules else {}),
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
    }
    names = {
        "kind": kind.kind,
        "listKind": f"{kind.kind}List",
        "plural": kind.plural,
        "singular": kind.kind.lower(),
        "shortNames": kind.short_names,
        "categories": [CATEGORY],
    }
    version = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "subresources": _subresources(kind),
        "additionalPrinterColumns": kind.columns,
        "schema": {"openAPIV3Schema": schema},
    }
    return _definition(GROUP, kind.scope, names, version)


def _definition(group: str, scope: str, names: JSON, version: JSON) -> JSON:
    """A CustomResourceDefinition of one version, labelled as the project's."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{names['plural']}.{group}",
            "labels": {"app.kubernetes.io/part-of": "sandbox-operator"},
        },
        "spec": {"group": group, "scope": scope, "names": names, "versions": [version]},
    }


def peering_crd(kind: str, scope: str) -> JSON:
    """Kopf's peering kinds (peering.py): the replicas' keep-alives in status,
    one key per replica, which Kopf owns."""
    plural = f"{kind.lower()}s"
    names = {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower()}
    version = {
        "name": "v1",
        "served": True,
        "storage": True,
        "schema": {
            "openAPIV3Schema": {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": True,
                "properties": {
                    "spec": {
                        "type": "object",
                        "description": "Unused: the peering lives in status.",
                        "x-kubernetes-preserve-unknown-fields": True,
                    },
                    "status": {
                        "type": "object",
                        "description": "Each live replica's keep-alive by its"
                        " identity (the pod's name): priority, lifetime, lastseen."
                        " The highest live priority is the active replica.",
                        "x-kubernetes-preserve-unknown-fields": True,
                    },
                },
            }
        },
    }
    return _definition("kopf.dev", scope, names, version)


def all_crds() -> dict[str, JSON]:
    """File name -> CRD object, for every kind and Kopf's peering kinds."""
    ours = {f"{kind.plural}.{GROUP}.yaml": crd(kind) for kind in KINDS}
    peerings = [
        peering_crd("ClusterKopfPeering", "Cluster"),
        peering_crd("KopfPeering", "Namespaced"),
    ]
    return ours | {f"{p['metadata']['name']}.yaml": p for p in peerings}
