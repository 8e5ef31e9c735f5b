"""Pure decisions of a SandboxPool: which member a claim takes, what to create
or delete next, and the pool's status."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sandbox_operator.api.common import API_VERSION
from sandbox_operator.api.pool import PoolCondition, PoolReason, SandboxPoolSpec
from sandbox_operator.api.sandbox import PoolOutcome, SandboxCondition, SandboxReason
from sandbox_operator.builders.conditions import FALSE, TRUE, Cond
from sandbox_operator.builders.sandbox_status import pod_condition
from sandbox_operator.resources import GENERATION_ANNOTATION, LABEL_POOL

JSON = dict[str, Any]
Key = tuple[str, str]
Index = Mapping[Key, Any]
# The pool links of Sandboxes (`pool_links`): (kind, namespace, pool name or claimer UID).
LinkKey = tuple[str, str, str]
Links = Mapping[LinkKey, Any]
MEMBER, CLAIMED_BY, SERVED = "member", "claimed-by", "served"


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
    template, never more than `max_creating` started and not yet ready.

    A failed member is kept while the pool needs it: it is a Sandbox, whose
    controller keeps retrying its pod (the pool's condition names the failure).
    Another member takes its place, within the maxCreating budget that failed
    members use up, so members that all fail the same way are not churned; once
    ready members fill the pool, failed ones are deleted. Members of an older
    template generation go only as current ones become ready, one for each, so
    rolling a template never empties the pool. Surplus goes newest first,
    unready ones before ready ones."""
    unclaimed = [m for m in members if m.state is not MemberState.CLAIMED]
    current = [m for m in unclaimed if m.template_generation == template_generation]
    stale = [m for m in unclaimed if m.template_generation != template_generation]
    failed = [m for m in current if m.state is MemberState.FAILED]
    healthy = [m for m in current if m.state is not MemberState.FAILED]
    ready_current = sum(1 for m in healthy if m.state is MemberState.READY)

    delete: list[str] = []
    surplus = len(healthy) - replicas
    if surplus > 0:
        newest_first = sorted(healthy, key=lambda m: (m.created, m.name), reverse=True)
        by_cost = [m for m in newest_first if m.state is not MemberState.READY] + [
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
    # Failed members go once ready ones fill the pool without them.
    failed_to_delete = failed if ready_current >= replicas else []
    delete.extend(m.name for m in failed_to_delete)
    going = {*delete}
    in_flight = sum(
        1 for m in unclaimed if m.state is not MemberState.READY and m.name not in going
    )
    missing = max(0, replicas - len(healthy))
    create = max(0, min(missing, max_creating - in_flight))
    return RefillPlan(create=create, delete=tuple(delete))


@dataclass(frozen=True)
class PoolCounts:
    replicas: int
    ready: int
    creating: int


def counts(members: Iterable[Member], template_generation: int) -> PoolCounts:
    """Unclaimed members (what `kubectl scale` compares with spec.replicas), the
    claimable ones, and the ones still starting (or failing to)."""
    unclaimed = [m for m in members if m.state is not MemberState.CLAIMED]
    ready = len(claimable(unclaimed, template_generation))
    creating = sum(1 for m in unclaimed if m.state is not MemberState.READY)
    return PoolCounts(replicas=len(unclaimed), ready=ready, creating=creating)


# A member whose Ready condition has one of these reasons will not get ready by
# waiting: the pool reports it rather than counting it as starting.
FAILING_REASONS = frozenset(
    {
        SandboxReason.INVALID_SPEC,
        SandboxReason.CREATE_FAILED,
        SandboxReason.RUNTIME_NO_PYTHON,
        SandboxReason.RUNTIME_FAILED,
        SandboxReason.IMAGE_PULL,
        SandboxReason.POD_FAILED,
        SandboxReason.TEMPLATE_NOT_FOUND,
        SandboxReason.TEMPLATE_NOT_READY,
        SandboxReason.QUOTA_EXCEEDED,
    }
)


def awaits_claim(sandbox: JSON) -> bool:
    """A Sandbox that names a pool and has no outcome yet (nor a pod of its own)."""
    status = sandbox.get("status") or {}
    return bool(
        ((sandbox.get("spec") or {}).get("poolRef") or {}).get("name")
        and not (status.get("pool") or {}).get("outcome")
        and not status.get("podUID")
        and not sandbox["metadata"].get("deletionTimestamp")
    )


def claimed(sandbox: JSON) -> bool:
    """A Sandbox whose status records that it claimed a member."""
    use = (sandbox.get("status") or {}).get("pool") or {}
    return bool(use.get("outcome") == PoolOutcome.CLAIMED and use.get("member"))


def claimed_by(member: JSON) -> JSON | None:
    """The owner reference of the Sandbox that claimed `member`, if one did."""
    return next(
        (
            owner
            for owner in member["metadata"].get("ownerReferences") or []
            if owner.get("controller") and owner.get("kind") == "Sandbox"
        ),
        None,
    )


def member_generation(member: JSON) -> int:
    """The template generation a member was made from: the one it pinned, else the
    one the pool saw when it created the member."""
    pinned = ((member.get("status") or {}).get("template") or {}).get("generation")
    if pinned is not None:
        return int(pinned)
    annotations = member["metadata"].get("annotations") or {}
    return int(annotations.get(GENERATION_ANNOTATION, "0") or 0)


def _ready_of(member: JSON) -> JSON:
    """The member's Ready condition as stored ({} when it has none): read on every
    claim for every member, so the plain dict, not a model."""
    return next(
        (
            c
            for c in (member.get("status") or {}).get("conditions") or []
            if c.get("type") == SandboxCondition.READY
        ),
        {},
    )


def member_of(member: JSON, pod_alive: bool = True) -> Member:
    """A member Sandbox as the pool's decisions see it."""
    meta = member["metadata"]
    ready = _ready_of(member)
    if claimed_by(member) is not None:
        state = MemberState.CLAIMED
    elif ready.get("status") == TRUE:
        state = MemberState.READY
    elif ready.get("reason") in FAILING_REASONS:
        state = MemberState.FAILED
    else:
        state = MemberState.CREATING
    return Member(
        name=meta["name"],
        state=state,
        template_generation=member_generation(member),
        pod_alive=pod_alive,
        created=meta.get("creationTimestamp", ""),
    )


# Why a member that is not failing can still wait indefinitely: the cluster, not
# the member, must change. Named in the pool's Filling message.
STUCK_REASONS = frozenset(
    {
        SandboxReason.UNSCHEDULABLE,
        SandboxReason.QUOTA_EXCEEDED,
        SandboxReason.WORKSPACE_PENDING,
        SandboxReason.TEMPLATE_NOT_READY,
    }
)


def stuck_member(members: list[JSON]) -> str:
    """'member NAME: Reason: message' for the first starting member held by the
    cluster (no room on a node, a quota, an unbound claim), or ''. Pure."""
    for member in members:
        reason, message = failure_of(member)
        if member_of(member).state is MemberState.CREATING and reason in STUCK_REASONS:
            return f"member {member['metadata']['name']}: {reason}: {message}"
    return ""


def failure_of(member: JSON) -> tuple[str, str]:
    """(reason, message) of a failing member's Ready condition."""
    ready = _ready_of(member)
    return str(ready.get("reason") or ""), str(ready.get("message") or "")


def build_member(pool: JSON, spec: SandboxPoolSpec, template_generation: int) -> JSON:
    """A new member: a Sandbox of the pool's template, named after the pool, owned by
    it (deleting the pool deletes its unclaimed members) and labelled as waiting."""
    meta = pool["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": "Sandbox",
        "metadata": {
            "generateName": f"{meta['name']}-",
            "namespace": meta["namespace"],
            "labels": {LABEL_POOL: meta["name"]},
            "annotations": {GENERATION_ANNOTATION: str(template_generation)},
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": "SandboxPool",
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {"templateRef": spec.template_ref.to_wire()},
    }


def claim_patch(member: JSON, claimer: JSON) -> JSON:
    """The one write that hands `member` to `claimer`: the Sandbox becomes its only
    owner and the pool label goes. It carries the member's resourceVersion, so of
    two claims of the same member the API server lets exactly one through.

    Only metadata the operator's change detection ignores (owners, and a label
    Kopf's digest leaves out) changes: no handler of the member runs for it."""
    cmeta = claimer["metadata"]
    return {
        "metadata": {
            "resourceVersion": member["metadata"]["resourceVersion"],
            "labels": {LABEL_POOL: None},
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": "Sandbox",
                    "name": cmeta["name"],
                    "uid": cmeta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        }
    }


def template_problem(template: JSON | None) -> str:
    """Why the template's own status says no Sandbox of it can run ('' when it does
    not say so, or speaks of an older generation). Pure."""
    if template is None:
        return ""
    status = template.get("status") or {}
    if status.get("observedGeneration") != template["metadata"].get("generation"):
        return ""
    ready: JSON = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    if ready.get("status") == FALSE and ready.get("reason") == "InvalidSpec":
        return str(ready.get("message") or "invalid spec")
    return ""


def ready_condition(
    *,
    template_found: bool,
    template_name: str,
    template_has_python: bool,
    template_invalid: str = "",
    replicas: int,
    ready: int,
    failing_member: str | None = None,
    failure: str = "",
    stuck: str = "",
) -> Cond:
    """Ready: the pool holds `replicas` claimable members. A missing template, one
    without python3 and a member that fails to start are named in the reason; a
    member the cluster holds back (`stuck`) in the Filling message."""
    if not template_found:
        return Cond(
            PoolCondition.READY,
            FALSE,
            PoolReason.TEMPLATE_NOT_FOUND,
            f"template {template_name} not found",
        )
    if template_invalid:
        return Cond(
            PoolCondition.READY,
            FALSE,
            PoolReason.TEMPLATE_INVALID,
            f"template {template_name} cannot make sandboxes here, so no members are made:"
            f" {template_invalid}",
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
    held = f"; {stuck}" if stuck else ""
    return Cond(
        PoolCondition.READY, FALSE, PoolReason.FILLING, f"{ready}/{replicas} members ready{held}"
    )


def pod_alive(pods: Index, namespace: str, member: str) -> bool:
    """The member's pod, as last seen, is there and ready: a member whose pod just
    died is skipped even while its own status still says Ready."""
    return pod_ready(next(iter(pods.get((namespace, member), [])), None))


def pod_ready(pod: JSON | None) -> bool:
    """A pod that exists, is not being deleted, and is Ready."""
    if pod is None or pod["metadata"].get("deletionTimestamp"):
        return False
    ready = pod_condition(pod, "Ready") or {}
    return ready.get("status") == "True"


def pool_links(body: JSON) -> dict[LinkKey, str] | None:
    """The keys under which a Sandbox is found by pool decisions, to its name: a
    member by its pool's label, a claimed member by the UID of the Sandbox that
    claimed it, a claiming Sandbox by the pool that served it. Pure.

    A claim then reads its pool's members, not every Sandbox of the cluster
    (at ten thousand Sandboxes, a scan per claim)."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    links: dict[LinkKey, str] = {}
    pool = (meta.get("labels") or {}).get(LABEL_POOL)
    if pool:
        links[(MEMBER, namespace, pool)] = name
    owner = claimed_by(body)
    if owner is not None and owner.get("uid"):
        links[(CLAIMED_BY, namespace, owner["uid"])] = name
    if claimed(body):
        links[(SERVED, namespace, body["status"]["pool"].get("name", ""))] = name
    return links or None


def _linked(sandboxes: Index, links: Links, key: LinkKey) -> list[JSON]:
    """The Sandboxes linked under `key`, as the Sandbox index holds them. Kopf
    updates both indexes from the same event at once, so each body still has
    what linked it: no need to check that again."""
    namespace = key[1]
    return [body for name in links.get(key, ()) for body in sandboxes.get((namespace, name), ())]


def members_of(sandboxes: Index, links: Links, pool: JSON) -> list[JSON]:
    """The pool's unclaimed members (by its label and its UID as their owner)."""
    meta = pool["metadata"]
    return [
        body
        for body in _linked(sandboxes, links, (MEMBER, meta["namespace"], meta["name"]))
        if not body["metadata"].get("deletionTimestamp")
        and any(
            o.get("controller") and o.get("uid") == meta["uid"]
            for o in body["metadata"].get("ownerReferences") or []
        )
    ]


def owned_member(sandboxes: Index, links: Links, body: JSON) -> JSON | None:
    """A member this Sandbox already claimed (its status write was lost)."""
    meta = body["metadata"]
    return next(iter(_linked(sandboxes, links, (CLAIMED_BY, meta["namespace"], meta["uid"]))), None)


def claimed_count(sandboxes: Index, links: Links, namespace: str, pool: str) -> int:
    """Sandboxes of the namespace now served by a member of `pool`."""
    return len(_linked(sandboxes, links, (SERVED, namespace, pool)))


__all__ = [
    "FAILING_REASONS",
    "Member",
    "MemberState",
    "PoolCounts",
    "RefillPlan",
    "awaits_claim",
    "build_member",
    "choose_member",
    "claim_patch",
    "claimable",
    "claimed_by",
    "claimed_count",
    "counts",
    "failure_of",
    "member_generation",
    "member_of",
    "members_of",
    "owned_member",
    "pod_alive",
    "pool_links",
    "ready_condition",
    "refill_plan",
]
