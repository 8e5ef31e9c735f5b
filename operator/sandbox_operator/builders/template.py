"""Templates: a Sandbox's effective spec from its template's defaults, and the
template's setup digest. Pure functions."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel

from sandbox_operator.api.common import API_VERSION
from sandbox_operator.api.sandbox import SandboxSpec, TemplateKind, TemplateRef, TemplateUse
from sandbox_operator.api.snapshot import SnapshotPhase
from sandbox_operator.api.template import SandboxTemplateSpec, SetupStep
from sandbox_operator.resources import CLUSTER_SANDBOX_TEMPLATES, LABEL_TEMPLATE, SANDBOX_TEMPLATES

JSON = dict[str, Any]

# Objects merged field by field (a Sandbox field set wins over the template's).
_NESTED = ("resources", "workspace", "lifecycle", "network")
# Maps merged by key, the Sandbox's keys winning.
_MAPS = ("node_selector", "pod_labels", "pod_annotations")
# Lists merged by an item's key field (as their schema's list-map-keys), the Sandbox's
# items winning.
_KEYED_LISTS = {"env": "name", "files": "path"}
# Where the image comes from: the Sandbox's choice of either replaces the template's.
_IMAGE = ("runtime", "image", "image_pull_policy")


def _merge_model(defaults: BaseModel, own: BaseModel) -> JSON:
    """`own`'s fields that were set, over `defaults`' values."""
    return {
        name: getattr(own if name in own.model_fields_set else defaults, name)
        for name in type(own).model_fields
    }


def effective_spec(defaults: SandboxSpec, own: SandboxSpec) -> SandboxSpec:
    """A Sandbox's spec with its template's defaults filled in.

    "Set" means present in the object the user wrote: the schema gives the
    fields a template may set no server-side default (see api.sandbox), so an
    absent field is told apart from a default one."""
    merged: JSON = {}
    for name in SandboxSpec.model_fields:
        mine, theirs = getattr(own, name), getattr(defaults, name)
        if name in _NESTED:
            merged[name] = _merge_model(theirs, mine)
        elif name in _MAPS:
            merged[name] = {**theirs, **mine}
        elif name in _KEYED_LISTS:
            key = _KEYED_LISTS[name]
            own_keys = {getattr(item, key) for item in mine}
            merged[name] = [*(i for i in theirs if getattr(i, key) not in own_keys), *mine]
        elif name in _IMAGE:
            chose = own.runtime is not None or own.image is not None
            merged[name] = mine if chose or name in own.model_fields_set else theirs
        else:
            merged[name] = mine if name in own.model_fields_set else theirs
    merged["template_ref"] = own.template_ref
    return SandboxSpec.model_validate(merged)


def template_path(ref: TemplateRef, namespace: str) -> str:
    if ref.kind is TemplateKind.CLUSTER:
        return CLUSTER_SANDBOX_TEMPLATES.path(None, ref.name)
    return SANDBOX_TEMPLATES.path(namespace, ref.name)


def describe(ref: TemplateRef, namespace: str) -> str:
    where = "" if ref.kind is TemplateKind.CLUSTER else f" in namespace {namespace}"
    return f"{ref.kind.value} {ref.name}{where}"


def setup_hash(spec: SandboxTemplateSpec) -> str | None:
    """What a base snapshot is built from: the steps and the sandbox fields they run
    with (image, resources, env, workspace). None when there is nothing to build."""
    if not spec.setup:
        return None
    sandbox = spec.sandbox
    essence = {
        "setup": [step.to_wire() for step in spec.setup],
        "image": [sandbox.runtime, sandbox.image],
        "resources": sandbox.resources.to_wire(),
        "env": [var.to_wire() for var in sandbox.env],
        "workspace": sandbox.workspace.to_wire(),
        "runtimeClassName": sandbox.runtime_class_name,
    }
    text = json.dumps(essence, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def build_names(template: str, digest: str) -> dict[str, str]:
    """The build Sandbox and the base Snapshot of one setup digest. Sandbox names are at
    most 50 characters; the template part is cut to fit."""
    stem = f"{template[:34].rstrip('-')}-base-{digest[:10]}"
    return {"sandbox": stem, "snapshot": stem}


def sandbox_spec(body: JSON) -> SandboxSpec:
    """The spec a Sandbox runs with: its own fields over the template defaults it
    recorded in status when it first started (a ValidationError when invalid).
    The template's base snapshot is where a persistent workspace starts, unless
    the Sandbox names a snapshot of its own."""
    own = SandboxSpec.model_validate(body.get("spec") or {})
    recorded = (body.get("status") or {}).get("template")
    if not recorded:  # no template: named in spec.templateRef or through a pool
        return own
    use = TemplateUse.model_validate(recorded)
    spec = effective_spec(SandboxSpec.model_validate(use.defaults), own)
    workspace = spec.workspace
    if use.base_snapshot and workspace.from_snapshot is None and not workspace.ephemeral:
        spec = spec.evolve(workspace=workspace.evolve(from_snapshot=use.base_snapshot))
    return spec


def _child(template: JSON, kind: str, name: str, spec: JSON) -> JSON:
    """An object of the template's build, labelled with and owned by the template
    (deleting the template takes its builds and bases with it)."""
    meta = template["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "metadata": {
            "name": name,
            "namespace": meta["namespace"],
            "labels": {LABEL_TEMPLATE: meta["name"]},
            "ownerReferences": [
                {
                    "apiVersion": template["apiVersion"],
                    "kind": template["kind"],
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": spec,
    }


def build_sandbox(template: JSON, spec: SandboxTemplateSpec, name: str) -> JSON:
    """The Sandbox a base snapshot is built in: the template's sandbox fields, kept
    running while the steps go (the idle policy must not take it mid-build)."""
    sandbox = spec.sandbox.model_copy(
        update={"lifecycle": spec.sandbox.lifecycle.model_copy(update={"idle_timeout": "3h"})}
    )
    return _child(template, "Sandbox", name, sandbox.to_wire())


def step_execution_name(sandbox: str, index: int) -> str:
    return f"{sandbox}-step-{index}"


def build_step(template: JSON, sandbox: str, index: int, step: SetupStep) -> JSON:
    """The Execution of one setup step in the build Sandbox."""
    spec = {
        "sandboxRef": {"name": sandbox},
        "script": step.script,
        "timeout": step.timeout,
        "combinedOutput": True,
    }
    return _child(template, "Execution", step_execution_name(sandbox, index), spec)


def build_base_snapshot(template: JSON, sandbox: str, name: str) -> JSON:
    spec = {
        "sandboxRef": {"name": sandbox},
        "tag": "base",
        "description": f"base of template {template['metadata']['name']} after its setup",
    }
    return _child(template, "Snapshot", name, spec)


def bases_to_keep(current: str, snapshots: list[JSON]) -> set[str]:
    """The template's base snapshots to keep: the current one and the newest other
    ready one (a Sandbox that read the template just before the new base was ready
    may still be restoring from it); the rest can go."""
    ready = [
        s
        for s in snapshots
        if s["metadata"]["name"] != current
        and (s.get("status") or {}).get("phase") == SnapshotPhase.READY
    ]
    newest = max(
        ready,
        key=lambda s: (s["metadata"].get("creationTimestamp") or "", s["metadata"]["name"]),
        default=None,
    )
    return {current} | ({newest["metadata"]["name"]} if newest else set())


LOG_TAIL = 4000


def build_log(steps: list[SetupStep], executions: list[JSON | None]) -> str | None:
    """The output tails of the steps that ran, each under its name, cut to LOG_TAIL."""
    parts = []
    for step, execution in zip(steps, executions, strict=False):
        if execution is None:
            break
        status = execution.get("status") or {}
        phase = status.get("phase") or "Queued"
        parts.append(f"--- {step.name} ({phase}) ---\n{status.get('stdout') or ''}".rstrip())
    text = "\n".join(parts)
    return text[-LOG_TAIL:] if text else None
