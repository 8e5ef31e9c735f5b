"""Admission of a Sandbox against the SandboxQuotas of its namespace.

A Sandbox is admitted once, before any of its children exist, and from then
on holds its share (itself, its pod's cpu and memory, its workspace) until
it is deleted: `status.admitted` records that. Admissions in one namespace
are serialized in this process and counted from the indexes overlaid with
the statuses this process wrote last, so two Sandboxes created at once never
both take the last place; after a restart the recorded `admitted` flags are
the count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sandbox_operator.api.quota import SandboxQuotaSpec
from sandbox_operator.api.sandbox import SandboxReason
from sandbox_operator.builders import quota as arithmetic
from sandbox_operator.context import OperatorContext
from sandbox_operator.handlers.sandbox.status import Blocked, write_status
from sandbox_operator.handlers.sandbox.view import SandboxView

JSON = dict[str, Any]
Key = tuple[str, str]
# Kopf indexes: Sandboxes by (namespace, name); SandboxQuotas by namespace.
SandboxIndex = Mapping[Key, Any]
QuotaIndex = Mapping[str, Any]


def quotas_of(quotas: QuotaIndex, namespace: str) -> dict[str, SandboxQuotaSpec]:
    """The namespace's SandboxQuotas by name (their index entries are valid specs)."""
    return {entry["name"]: entry["spec"] for entry in quotas.get(namespace, [])}


async def admit(
    ctx: OperatorContext,
    view: SandboxView,
    sandboxes: SandboxIndex,
    quotas: QuotaIndex,
) -> None:
    """Let the Sandbox go on, or stop the pass (Blocked: Ready=False,
    QuotaExceeded, looked at again after a while; its timer may look again
    sooner, and each look reads only memory). Already admitted (or older than
    quotas: it has had a pod) goes on at once; otherwise it is checked against
    every quota and recorded as admitted."""
    old, spec = view.old, view.valid_spec
    if old.admitted or old.pod_uid or view.deleting:
        return
    namespace = view.ref.namespace
    limits = quotas_of(quotas, namespace)
    if not limits:
        return  # recorded with the next status write (see reconcile)
    async with ctx.namespace_lock(namespace):
        used = arithmetic.namespace_usage(ctx.sandboxes_in(sandboxes, namespace), ctx.settings)
        why = arithmetic.refusal(limits, used, arithmetic.sandbox_usage(spec, ctx.settings))
        if why is None:
            # Written at once, before the lock is released: the next admission
            # counts it (the pass's own status write comes too late for that).
            await write_status(ctx, view.body, old.evolve(admitted=True))
            return
    raise Blocked(
        SandboxReason.QUOTA_EXCEEDED.value,
        why,
        retry=ctx.settings.quota_retry_seconds,
        retry_message=f"waiting for room in the SandboxQuotas of {namespace}",
    )
