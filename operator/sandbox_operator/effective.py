"""A Sandbox as it runs: its spec over the template defaults it recorded, and
whether it is paused now. Pure: no I/O, no clock.

The Sandbox controller, the Execution controller, quota arithmetic and the
gateway all read a Sandbox through these, so they agree on what it runs with.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from sandbox_operator.api.sandbox import SandboxSpec, TemplateUse
from sandbox_operator.clock import parse_time
from sandbox_operator.resources import RESUME_ANNOTATION

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


def effectively_paused(sandbox: JSON, spec: SandboxSpec) -> bool:
    """Paused by the user (spec) or by the idle policy (status), unless resumed since
    (the resume annotation is later than the pause)."""
    if spec.paused:
        return True
    paused_at = (sandbox.get("status") or {}).get("idlePausedAt")
    if not paused_at:
        return False
    resumed = (sandbox["metadata"].get("annotations") or {}).get(RESUME_ANNOTATION)
    try:
        return not (resumed and parse_time(resumed) > parse_time(paused_at))
    except ValueError:
        return True
