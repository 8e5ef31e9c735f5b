"""The SandboxQuota controller: usage in status and in the metrics.

Enforcement lives where objects are admitted (the Sandbox controller's
admission, the Execution scheduler); this controller only reports what the
namespace holds, from the same in-memory indexes, so it costs the API server
one status write when usage changes and nothing otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from sandbox_operator import metrics
from sandbox_operator.api.common import readable
from sandbox_operator.api.quota import SandboxQuotaSpec, SandboxQuotaStatus
from sandbox_operator.api.sandbox import SandboxCondition, SandboxReason, SandboxStatus
from sandbox_operator.builders import quota as arithmetic
from sandbox_operator.builders.conditions import find
from sandbox_operator.config import Settings
from sandbox_operator.context import OperatorContext
from sandbox_operator.indexes import Indexes
from sandbox_operator.kube import MERGE_PATCH, status_patch
from sandbox_operator.resources import SANDBOX_QUOTAS

JSON = dict[str, Any]
Key = tuple[str, str]


def index_entry(body: JSON) -> JSON | None:
    """What admission needs of a SandboxQuota: its name and parsed spec (None for
    a spec the model refuses, which the CRD's schema already keeps out)."""
    try:
        spec = SandboxQuotaSpec.model_validate(body.get("spec") or {})
    except ValidationError:
        return None
    return {"name": body["metadata"]["name"], "spec": spec}


def _quota_waiting(body: JSON) -> bool:
    status = SandboxStatus.model_validate(body.get("status") or {})
    ready = find(status.conditions, SandboxCondition.READY)
    return ready is not None and ready.reason == SandboxReason.QUOTA_EXCEEDED


def usage_status(
    spec: SandboxQuotaSpec,
    generation: int,
    sandboxes: list[JSON],
    slots: Mapping[Key, Any],
    claimed: Mapping[Key, set[str]],
    namespace: str,
    settings: Settings,
) -> tuple[SandboxQuotaStatus, dict[str, tuple[float, float]]]:
    """The status and the metric values (hard, used) by limit. Pure."""
    running = arithmetic.running_executions(slots, claimed, namespace)
    used = arithmetic.namespace_usage(sandboxes, settings, running_executions=running)
    waiting = sum(1 for body in sandboxes if _quota_waiting(body))
    waiting += arithmetic.waiting_executions(slots, namespace)
    status = SandboxQuotaStatus(
        observed_generation=generation, used=used.to_model(), waiting=waiting
    )
    values = {
        field: (float(limit), float(getattr(used, field)))
        for field, limit in arithmetic.hard_limits(spec).items()
    }
    return status, values


async def observe(
    ctx: OperatorContext,
    body: JSON,
    indexes: Indexes,
    claimed: Mapping[Key, set[str]],
) -> None:
    """Write the namespace's usage into the quota's status (once, when it changed)."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    sandboxes = ctx.sandboxes_in(indexes.sandboxes, namespace)
    try:
        spec = SandboxQuotaSpec.model_validate(body.get("spec") or {})
    except ValidationError as exc:
        ctx.event(body, "warn", reason="InvalidSpec", message=readable(exc))
        return
    status, values = usage_status(
        spec, meta.get("generation", 0), sandboxes, indexes.slots, claimed, namespace, ctx.settings
    )
    metrics.QUOTAS.set(namespace, name, values)
    patch = status_patch(body.get("status") or {}, status.to_wire())
    if patch is not None:
        await ctx.kube.patch(SANDBOX_QUOTAS.path(namespace, name, "status"), patch, MERGE_PATCH)


def forget(namespace: str, name: str) -> None:
    metrics.QUOTAS.forget(namespace, name)
