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

import kopf

from sandbox_operator.api.quota import SandboxQuotaSpec
from sandbox_operator.api.sandbox import SandboxSpec
from sandbox_operator.builders import quota as arithmetic
from sandbox_operator.context import OperatorContext
from sandbox_operator.handlers.sandbox.status import report_blocked, status_of, write_status

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
    body: JSON,
    spec: SandboxSpec,
    sandboxes: SandboxIndex,
    quotas: QuotaIndex,
) -> bool:
    """Whether the Sandbox may go on. Already admitted (or older than quotas: it
    has had a pod) is yes at once; otherwise it is checked against every quota
    and either recorded as admitted or given Ready=False, QuotaExceeded."""
    old = status_of(body)
    if old.admitted or old.pod_uid or body["metadata"].get("deletionTimestamp"):
        return True
    namespace = body["metadata"]["namespace"]
    limits = quotas_of(quotas, namespace)
    if not limits:
        return True  # recorded with the next status write (see reconcile)
    async with ctx.namespace_lock(namespace):
        used = arithmetic.namespace_usage(ctx.sandboxes_in(sandboxes, namespace), ctx.settings)
        why = arithmetic.refusal(limits, used, arithmetic.sandbox_usage(spec, ctx.settings))
        if why is None:
            # Recorded before the lock is released: the next admission counts it.
            await write_status(ctx, body, old.evolve(admitted=True))
            return True
    await report_blocked(ctx, body, spec, quota=why)
    return False


def waiting(ctx: OperatorContext, namespace: str) -> kopf.TemporaryError:
    """The error that sends a refused Sandbox's handler back after a while (its
    timer may look again sooner); each look reads only memory."""
    return kopf.TemporaryError(
        f"waiting for room in the SandboxQuotas of {namespace}",
        delay=ctx.settings.quota_retry_seconds,
    )
