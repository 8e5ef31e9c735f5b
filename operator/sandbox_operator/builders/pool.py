"""Pure decisions of a SandboxPool: which member a claim takes, what to create
or delete next, and the pool's status."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from sandbox_operator.api.pool import PoolCondition, PoolReason
from sandbox_operator.builders.conditions import FALSE, TRUE, Cond


class MemberState(StrEnum):
    CREATING = "Creating"
    READY = "Ready"
    FAILED = "Failed"
    CLAIMED = "Claimed"


@dataclass(frozen=True)
class Member:
    """One member as observed: its name, state, the template generation it was
    built from, and whether its pod is alive right now."""

    name: str
    state: MemberState
    template_generation: int
    pod_alive: bool = True
    created: str = ""


@dataclass(frozen=True)
class RefillPlan:
    create: int
    delete: tuple[str, ...]


def claimable(members: Iterable[Member], template_generation: int) -> list[Member]:
    """Ready members of the current template whose pod is alive, oldest first (the
    oldest has waited longest; members of an older generation are being rolled)."""
    return sorted(
        (
            m
            for m in members
            if m.state is MemberState.READY
            and m.pod_alive
            and m.template_generation == template_generation
        ),
        key=lambda m: (m.created, m.name),
    )


def choose_member(
    members: Iterable[Member], template_generation: int, skip: Iterable[str] = ()
) -> Member | None:
    """The member a claim takes: the first claimable one not in `skip` (members a
    concurrent claim already won, seen as a conflict on the compare-and-swap)."""
    taken = set(skip)
    return next((m for m in claimable(members, template_generation) if m.name not in taken), None)


def refill_plan(
    members: Sequence[Member], replicas: int, max_creating: int, template_generation: int
) -> RefillPlan:
    """What to do next so the pool holds `replicas` unclaimed members of the current
    template, never more than `max_creating` in flight.

    Failed members and dead-pod ready members are deleted. Members of an older
    template generation are deleted only as current ones become ready, one for each,
    so rolling a template never empties the pool. Surplus goes newest-first, creating
    ones before ready ones."""
    unclaimed = [m for m in members if m.state is not MemberState.CLAIMED]
    broken = [
        m
        for m in unclaimed
        if m.state is MemberState.FAILED or (m.state is MemberState.READY and not m.pod_alive)
    ]
    healthy = [m for m in unclaimed if m not in broken]
    current = [m for m in healthy if m.template_generation == template_generation]
    stale = [m for m in healthy if m.template_generation != template_generation]
    creating = sum(1 for m in current if m.state is MemberState.CREATING)
    ready_current = len(current) - creating

    delete = [m.name for m in broken]
    surplus = len(current) - replicas
    if surplus > 0:
        # Creating members go first (no claim can take them yet), then the newest ready.
        newest_first = sorted(current, key=lambda m: (m.created, m.name), reverse=True)
        by_cost = [m for m in newest_first if m.state is MemberState.CREATING] + [
            m for m in newest_first if m.state is MemberState.READY
        ]
        delete.extend(m.name for m in by_cost[:surplus])
        stale_to_delete = stale
    else:
        # A stale member goes once a current one is ready to take its place.
        keep_stale = max(0, replicas - ready_current)
        stale_sorted = sorted(stale, key=lambda m: (m.created, m.name))
        stale_to_delete = stale_sorted[: max(0, len(stale) - keep_stale)]
    delete.extend(m.name for m in stale_to_delete)

    missing = max(0, replicas - len(current))
    in_flight = sum(
        1 for m in stale if m.state is MemberState.CREATING and m not in stale_to_delete
    )
    create = max(0, min(missing, max_creating - creating - in_flight))
    return RefillPlan(create=create, delete=tuple(delete))


@dataclass(frozen=True)
class PoolCounts:
    replicas: int
    ready: int
    creating: int


def counts(members: Iterable[Member], template_generation: int) -> PoolCounts:
    unclaimed = [
        m
        for m in members
        if m.state in (MemberState.READY, MemberState.CREATING)
        and (m.state is MemberState.CREATING or m.pod_alive)
    ]
    ready = len(claimable(unclaimed, template_generation))
    creating = sum(1 for m in unclaimed if m.state is MemberState.CREATING)
    return PoolCounts(replicas=len(unclaimed), ready=ready, creating=creating)


def ready_condition(
    *,
    template_found: bool,
    template_name: str,
    template_has_python: bool,
    replicas: int,
    ready: int,
    failing_member: str | None = None,
    failure: str = "",
) -> Cond:
    """Ready: the pool holds `replicas` claimable members. A missing template, one
    without python3 and a member that fails to start are named in the reason."""
    if not template_found:
        return Cond(
            PoolCondition.READY,
            FALSE,
            PoolReason.TEMPLATE_NOT_FOUND,
            f"template {template_name} not found",
        )
    if not template_has_python:
        return Cond(
            PoolCondition.READY,
            FALSE,
            PoolReason.TEMPLATE_WITHOUT_PYTHON,
            f"template {template_name}: its image has no python3, which the sandbox agent needs",
        )
    if failing_member is not None:
        why = f": {failure}" if failure else ""
        return Cond(
            PoolCondition.READY,
            FALSE,
            PoolReason.MEMBER_FAILING,
            f"member {failing_member} failed to start{why}",
        )
    if ready >= replicas:
        return Cond(PoolCondition.READY, TRUE, PoolReason.FULL, f"{ready}/{replicas} members ready")
    return Cond(PoolCondition.READY, FALSE, PoolReason.FILLING, f"{ready}/{replicas} members ready")


__all__ = [
    "Member",
    "MemberState",
    "PoolCounts",
    "RefillPlan",
    "choose_member",
    "claimable",
    "counts",
    "ready_condition",
    "refill_plan",
]
