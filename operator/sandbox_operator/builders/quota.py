"""Quota arithmetic: what a Sandbox holds, what a namespace uses, whether a
request fits every SandboxQuota of its namespace. Pure: no I/O, no clock."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from decimal import Decimal
from typing import Any

from pydantic import ValidationError

from sandbox_operator.api.common import quantity_value
from sandbox_operator.api.quota import ComputeLimits, QuotaUsage, SandboxQuotaSpec
from sandbox_operator.api.sandbox import SandboxSpec
from sandbox_operator.builders.pool import claimed_by
from sandbox_operator.builders.sandbox import build_pod
from sandbox_operator.config import Settings
from sandbox_operator.effective import sandbox_spec
from sandbox_operator.identity import SandboxRef

JSON = dict[str, Any]
ZERO = Decimal(0)
# Kubernetes quantities have no finer unit than the milli.
_MILLI = Decimal("0.001")


@dataclass(frozen=True)
class Usage:
    """Amounts held (by a namespace) or asked for (by one object)."""

    sandboxes: int = 0
    running_executions: int = 0
    requests_cpu: Decimal = ZERO
    requests_memory: Decimal = ZERO
    limits_cpu: Decimal = ZERO
    limits_memory: Decimal = ZERO
    workspace_storage: Decimal = ZERO

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )

    def to_model(self) -> QuotaUsage:
        return QuotaUsage(
            sandboxes=self.sandboxes,
            running_executions=self.running_executions,
            requests=ComputeLimits(
                cpu=format_quantity(self.requests_cpu),
                memory=format_quantity(self.requests_memory, binary=True),
            ),
            limits=ComputeLimits(
                cpu=format_quantity(self.limits_cpu),
                memory=format_quantity(self.limits_memory, binary=True),
            ),
            workspace_storage=format_quantity(self.workspace_storage, binary=True),
        )


# Each limit: (the name people read, the Usage field, how to read it off a spec).
_LIMITS: tuple[tuple[str, str, bool], ...] = (
    ("sandboxes", "sandboxes", False),
    ("runningExecutions", "running_executions", False),
    ("requests.cpu", "requests_cpu", False),
    ("requests.memory", "requests_memory", True),
    ("limits.cpu", "limits_cpu", False),
    ("limits.memory", "limits_memory", True),
    ("workspaceStorage", "workspace_storage", True),
)


def hard_limits(spec: SandboxQuotaSpec) -> dict[str, Decimal]:
    """The limits a quota sets, by Usage field; unset ones are absent."""
    requests = spec.requests or ComputeLimits()
    limits = spec.limits or ComputeLimits()
    raw: dict[str, int | str | None] = {
        "sandboxes": spec.sandboxes,
        "running_executions": spec.running_executions,
        "requests_cpu": requests.cpu,
        "requests_memory": requests.memory,
        "limits_cpu": limits.cpu,
        "limits_memory": limits.memory,
        "workspace_storage": spec.workspace_storage,
    }
    return {
        key: Decimal(value) if isinstance(value, int) else quantity_value(value)
        for key, value in raw.items()
        if value is not None
    }


def format_quantity(value: Decimal | int, *, binary: bool = False) -> str:
    """A quantity as people write it: "1500m", "2", "512Mi", "10Gi"."""
    value = Decimal(value)
    if binary and value == value.to_integral_value():
        number = int(value)
        for suffix, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
            if number and number % size == 0:
                return f"{number // size}{suffix}"
        return str(number)
    if value == value.to_integral_value():
        return str(int(value))
    return f"{int((value / _MILLI).to_integral_value())}m"


def _show(field: str, value: Decimal | int) -> str:
    binary = next(b for _, f, b in _LIMITS if f == field)
    return format_quantity(value, binary=binary)


def _pod_amounts(pod: JSON, kind: str) -> dict[str, Decimal]:
    """A pod's effective cpu and memory `kind` (requests or limits), as the
    scheduler and ResourceQuota count them: containers plus native sidecars,
    or the largest plain init container if that is more."""
    spec = pod["spec"]
    inits = spec.get("initContainers") or []
    running = [*spec.get("containers", []), *(c for c in inits if c.get("restartPolicy"))]
    plain = [c for c in inits if not c.get("restartPolicy")]
    out = {}
    for resource in ("cpu", "memory"):

        def of(container: JSON, resource: str = resource) -> Decimal:
            value = ((container.get("resources") or {}).get(kind) or {}).get(resource)
            return quantity_value(str(value)) if value is not None else ZERO

        total = sum((of(c) for c in running), ZERO)
        out[resource] = max([total, *(of(c) for c in plain)])
    return out


def sandbox_usage(spec: SandboxSpec, settings: Settings) -> Usage:
    """What one Sandbox holds once admitted: itself, its pod's cpu and memory, its
    workspace claim."""
    pod = build_pod(SandboxRef(name="quota", namespace="quota", uid=""), spec, settings)
    requests = _pod_amounts(pod, "requests")
    limits = _pod_amounts(pod, "limits")
    storage = ZERO
    if not spec.workspace.ephemeral:
        storage = quantity_value(spec.workspace.size or settings.default_workspace_size)
    return Usage(
        sandboxes=1,
        requests_cpu=requests["cpu"],
        requests_memory=requests["memory"],
        limits_cpu=limits["cpu"],
        limits_memory=limits["memory"],
        workspace_storage=storage,
    )


def admitted(body: JSON) -> bool:
    return bool((body.get("status") or {}).get("admitted"))


def namespace_usage(
    bodies: Iterable[JSON], settings: Settings, *, running_executions: int = 0
) -> Usage:
    """What the admitted Sandboxes among `bodies` hold (deleting ones still do:
    their pod and claim are not gone yet), plus the running Executions."""
    total = Usage(running_executions=running_executions)
    for body in bodies:
        # A claimed pool member's share is its claimer's now: counted once, there.
        if not admitted(body) or claimed_by(body) is not None:
            continue
        try:
            spec = sandbox_spec(body)
        except ValidationError:
            total += Usage(sandboxes=1)
            continue
        total += sandbox_usage(spec, settings)
    return total


def refusal(quotas: Mapping[str, SandboxQuotaSpec], used: Usage, request: Usage) -> str | None:
    """Why `request` does not fit on top of `used` (the first limit it exceeds, naming
    the quota, the limit, the usage and the request), or None when it fits every quota."""
    for name in sorted(quotas):
        for field, limit in hard_limits(quotas[name]).items():
            asked = getattr(request, field)
            if not asked:
                continue
            held = getattr(used, field)
            if held + asked > limit:
                label = next(label for label, f, _ in _LIMITS if f == field)
                return (
                    f"exceeded SandboxQuota {name}: {label} limited to {_show(field, limit)},"
                    f" used {_show(field, held)}, requested {_show(field, asked)}"
                )
    return None


def running_executions(
    slots: Mapping[tuple[str, str], Iterable[JSON]],
    claimed: Mapping[tuple[str, str], set[str]],
    namespace: str,
) -> int:
    """Executions of `namespace` running now: started and not done in the slot index
    (entries: see handlers.execution.slot_entry), or claimed by this process and
    not yet visible there."""
    total = 0
    for key in {k for k in slots if k[0] == namespace} | {k for k in claimed if k[0] == namespace}:
        entries = slots.get(key, [])
        names = {e["name"] for e in entries if e["started"] and not e["done"]}
        total += len(names | claimed.get(key, set()))
    return total


def waiting_executions(slots: Mapping[tuple[str, str], Iterable[JSON]], namespace: str) -> int:
    """Executions of `namespace` queued because a quota has no room."""
    return sum(
        1
        for key, entries in slots.items()
        if key[0] == namespace
        for e in entries
        if e.get("quota") and not e["done"]
    )
