"""A Sandbox's template: read once, when the Sandbox first starts, and recorded.

What the Sandbox took (the template's sandbox fields and its base snapshot)
is kept in `status.template`, so later edits of the template never restart
or roll back a running sandbox, and an operator restart reads the same
defaults again (effective.sandbox_spec merges them).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from sandbox_operator.api.common import readable
from sandbox_operator.api.sandbox import SandboxReason, TemplateKind, TemplateRef, TemplateUse
from sandbox_operator.api.template import (
    SandboxTemplateSpec,
    SandboxTemplateStatus,
    TemplateCondition,
)
from sandbox_operator.builders.conditions import TRUE, find
from sandbox_operator.builders.template import describe, setup_hash, template_path
from sandbox_operator.context import OperatorContext
from sandbox_operator.handlers.sandbox.status import (
    Blocked,
    current,
    status_of,
    write_status,
)

JSON = dict[str, Any]

# How often a Sandbox waiting for its template looks again.
TEMPLATE_RETRY_SECONDS = 3.0


def use_of(ref: TemplateRef, template: JSON) -> tuple[TemplateUse | None, str]:
    """What a Sandbox takes from `template`, or (None, why it cannot yet). Pure."""
    try:
        spec = SandboxTemplateSpec.model_validate(template.get("spec") or {})
    except ValidationError as exc:
        return None, f"its spec is invalid: {readable(exc)}"
    digest = setup_hash(spec)
    base = None
    if digest is not None and ref.kind is TemplateKind.NAMESPACED:
        status = SandboxTemplateStatus.model_validate(template.get("status") or {})
        ready = find(status.conditions, TemplateCondition.READY)
        built = status.setup_hash == digest and status.base_snapshot
        if not built or ready is None or ready.status != TRUE:
            why = ready.message if ready is not None and ready.message else "not built yet"
            return None, f"its base snapshot is not ready: {why}"
        base = status.base_snapshot
    use = TemplateUse(
        kind=ref.kind,
        name=ref.name,
        generation=template["metadata"].get("generation"),
        base_snapshot=base,
        defaults=spec.sandbox.to_wire(),
    )
    return use, ""


async def pin_template(ctx: OperatorContext, body: JSON) -> JSON:
    """`body` with `status.template` recorded; a Sandbox without a template as it is.
    Until its template exists (and its base snapshot is built) the Sandbox waits
    (Blocked), with a status that says for what."""
    status = body.get("status") or {}
    # Named in the spec, or the template of the pool the Sandbox could not claim from.
    raw_ref = (body.get("spec") or {}).get("templateRef") or (status.get("pool") or {}).get(
        "templateRef"
    )
    if not raw_ref or status.get("template"):
        return body
    try:
        ref = TemplateRef.model_validate(raw_ref)
    except ValidationError:
        return body  # the spec's own validation reports it
    namespace = body["metadata"]["namespace"]
    template = await ctx.kube.get(template_path(ref, namespace))
    if template is None:
        held = (
            SandboxReason.TEMPLATE_NOT_FOUND.value,
            f"{describe(ref, namespace)} does not exist",
        )
    else:
        use, why = use_of(ref, template)
        if use is not None:
            # Written at once, not with the pass's status: from now on the
            # Sandbox runs with what it took, whatever happens to the template.
            fresh = current(ctx, body)
            await write_status(ctx, fresh, status_of(fresh).evolve(template=use))
            return fresh
        held = (SandboxReason.TEMPLATE_NOT_READY.value, f"{describe(ref, namespace)}: {why}")
    raise Blocked(*held, retry=TEMPLATE_RETRY_SECONDS)
