"""Templates: where a template is, its setup digest, and the objects of its setup
build (the build Sandbox, its step Executions, the base Snapshot). Pure functions.

A Sandbox's spec over its template's defaults is `effective.sandbox_spec`."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sandbox_operator.api.common import API_VERSION
from sandbox_operator.api.sandbox import TemplateKind, TemplateRef
from sandbox_operator.api.snapshot import SnapshotPhase
from sandbox_operator.api.template import SandboxTemplateSpec, SetupStep
from sandbox_operator.resources import CLUSTER_SANDBOX_TEMPLATES, LABEL_TEMPLATE, SANDBOX_TEMPLATES

JSON = dict[str, Any]


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
