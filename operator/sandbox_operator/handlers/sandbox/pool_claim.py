"""A Sandbox that names a pool takes one of its warm members.

The claim is one write: the member Sandbox gets this Sandbox as its only
owner, conditioned on the member's resourceVersion, so of two claims of one
member exactly one succeeds and the other takes the next member. Nothing
else moves: the member keeps its pod, workspace claim, token and policy, and
this Sandbox is served by them (`identity.children_ref`) from then on.
The outcome is recorded in `status.pool`; until it is, a restart finds the
member by its owner reference and takes it up again, so a crash between the
claim and the status write neither leaks nor doubles a member.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from sandbox_operator import metrics
from sandbox_operator.api.pool import SandboxPoolSpec, WhenEmpty
from sandbox_operator.api.sandbox import (
    PoolOutcome,
    PoolUse,
    SandboxReason,
    TemplateKind,
    TemplateRef,
)
from sandbox_operator.builders import pool as pools
from sandbox_operator.builders import sandbox as build
from sandbox_operator.context import OperatorContext
from sandbox_operator.effective import sandbox_spec
from sandbox_operator.handlers.sandbox.status import Blocked
from sandbox_operator.indexes import Indexes
from sandbox_operator.kube import KubeError
from sandbox_operator.resources import PODS, SANDBOX_POOLS, SANDBOX_TEMPLATES, SANDBOXES

JSON = dict[str, Any]
Key = tuple[str, str]
Index = Mapping[Key, Any]

# How often a Sandbox waiting for a pool (missing, or empty with whenEmpty: Wait) looks again.
POOL_RETRY_SECONDS = 1.0
# Claims that lose the race for a member try the next one; after this many
# losses in one pass they start cold (or wait) rather than spin.
MAX_CONFLICTS = 8
# Long enough for the index to show a claim (the member leaves the pool's
# members then). A claim that fails drops its reservation at once.
RESERVATION_SECONDS = 30.0


def pool_ref_of(body: JSON) -> str | None:
    """The pool a Sandbox names in spec.poolRef (its template's default pool is
    looked up separately: it needs a read)."""
    return ((body.get("spec") or {}).get("poolRef") or {}).get("name")


async def default_pool(ctx: OperatorContext, body: JSON) -> str | None:
    """The defaultPool of a new Sandbox's namespaced template, if it has one."""
    raw = (body.get("spec") or {}).get("templateRef")
    if not raw or (body.get("status") or {}).get("template"):
        return None
    try:
        ref = TemplateRef.model_validate(raw)
    except ValidationError:
        return None
    if ref.kind is not TemplateKind.NAMESPACED:
        return None
    template = await ctx.kube.get(SANDBOX_TEMPLATES.path(body["metadata"]["namespace"], ref.name))
    pool = ((template or {}).get("spec") or {}).get("defaultPool")
    return str(pool) if pool else None


def incompatible(body: JSON, member: JSON) -> str | None:
    """Why a member cannot serve this Sandbox (it asks for what only a new pod
    gives), or None. Pure."""
    pinned = (member.get("status") or {}).get("template")
    try:
        mine = sandbox_spec({"spec": body.get("spec") or {}, "status": {"template": pinned}})
        theirs = sandbox_spec(member)
    except ValidationError:
        return "the spec is invalid"
    wanted, has = build.pod_stamp(mine), build.pod_stamp(theirs)
    fields = sorted(k for k in wanted.keys() | has.keys() if wanted.get(k) != has.get(k))
    if not fields:
        return None
    return ", ".join(f"spec.{name}" for name in fields) + " differs from the pool's members"


def _bound(body: JSON, use: PoolUse, member: JSON | None) -> JSON:
    """`body` with the outcome in its status (in memory: the reconciliation writes it)."""
    status = dict(body.get("status") or {})
    status["pool"] = use.to_wire()
    if member is not None:
        # What the member's workspace is (its template, the Snapshot it was restored
        # from) is now this Sandbox's: no read to find it out again.
        theirs = member.get("status") or {}
        for key in _INHERITED:
            if theirs.get(key) is not None:
                status[key] = theirs[key]
    return {**body, "status": status}


_INHERITED = ("template", "workspaceSnapshot", "workspaceLineage", "workspaceRestoreRequest")


Decisions = dict[Key, JSON]


def remember(decisions: Decisions, bound: JSON) -> JSON:
    """`bound` (a Sandbox with its outcome in status), remembered in `decisions`
    until its status shows it (`OperatorContext.pool_decisions`)."""
    meta, status = bound["metadata"], bound["status"]
    kept = {k: status[k] for k in ("pool", *_INHERITED) if status.get(k) is not None}
    decisions[(meta["namespace"], meta["uid"])] = kept
    return bound


def with_decision(decisions: Decisions, body: JSON) -> JSON:
    """`body` with the outcome remembered for it while its status shows none;
    once the status shows one, that one holds and the memory goes."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["uid"])
    status = body.get("status") or {}
    if (status.get("pool") or {}).get("outcome") in (PoolOutcome.CLAIMED, PoolOutcome.COLD_START):
        decisions.pop(key, None)
        return body
    decided = decisions.get(key)
    return body if decided is None else {**body, "status": {**status, **decided}}


async def take_member(
    ctx: OperatorContext,
    body: JSON,
    indexes: Indexes,
) -> JSON:
    """`body` with `status.pool` decided when it names a pool: a member claimed, a
    cold start, or (Blocked) a wait. Sandboxes without a pool, and ones whose
    outcome is recorded, come back as they are."""
    ns = body["metadata"]["namespace"]
    body = with_decision(ctx.pool_decisions, body)
    recorded = (body.get("status") or {}).get("pool") or {}
    if recorded.get("outcome") == PoolOutcome.COLD_START and not _has_pod(body):
        # Until its pod exists: a cold start decided by a process that then
        # stopped is announced by this one (the Event is made once either way).
        pool = next(iter(indexes.pools.get((ns, recorded.get("name", "")), [])), None)
        _announce_cold(ctx, body, recorded.get("message", ""), pool)
    if recorded.get("outcome") in (PoolOutcome.CLAIMED, PoolOutcome.COLD_START):
        return body
    if (body.get("status") or {}).get("podUID") or body["metadata"].get("deletionTimestamp"):
        return body
    found = await _pool_of(ctx, body, indexes.pools)
    if found is None:
        return body
    pool, spec = found
    use = PoolUse(
        name=pool["metadata"]["name"], outcome=PoolOutcome.CLAIMED, template_ref=spec.template_ref
    )
    mine = pools.owned_member(indexes.sandboxes, indexes.links, body)
    if mine is not None:
        return remember(ctx.pool_decisions, _bound(body, _claimed(use, mine), mine))
    ready = _ready_members(pool, indexes.sandboxes, indexes.links, indexes.pods)
    claimed, mismatch = await _race(ctx, body, pool, ready)
    if claimed is not None:
        return remember(ctx.pool_decisions, _bound(body, _claimed(use, claimed), claimed))
    if mismatch is not None:
        return await _cold(ctx, body, use, mismatch, pool)
    if spec.when_empty is WhenEmpty.WAIT:
        metrics.POOL_CLAIMS.labels("waited").inc()
        why = f"SandboxPool {use.name} has no ready member; waiting for one (whenEmpty: Wait)"
        waiting = use.model_copy(update={"outcome": PoolOutcome.WAITING})
        # As a field: the status written builds on the one this process last wrote.
        raise Blocked(
            SandboxReason.POOL_EMPTY.value, why, retry=POOL_RETRY_SECONDS, fields={"pool": waiting}
        )
    return await _cold(ctx, body, use, f"SandboxPool {use.name} had no ready member", pool)


async def _pool_of(
    ctx: OperatorContext, body: JSON, pools_index: Index
) -> tuple[JSON, SandboxPoolSpec] | None:
    """The pool a Sandbox names (or its template's default pool), or None to start
    as if it named none; a named pool that does not exist makes it wait."""
    name = pool_ref_of(body)
    explicit = name is not None
    if name is None:
        name = await default_pool(ctx, body)
        if name is None:
            return None
    namespace = body["metadata"]["namespace"]
    pool = next(iter(pools_index.get((namespace, name), [])), None)
    if pool is None:
        # Not in the index: gone, or created a moment ago and not seen yet. Ask, so
        # that a pool and its first Sandbox applied together never read PoolNotFound.
        pool = await ctx.kube.get(SANDBOX_POOLS.path(namespace, name))
    if pool is None:
        if not explicit:
            return None  # a template's default pool that this namespace lacks: start cold
        why = f"SandboxPool {name} does not exist in namespace {namespace}"
        raise Blocked(SandboxReason.POOL_NOT_FOUND.value, why, retry=POOL_RETRY_SECONDS)
    spec = SandboxPoolSpec.model_validate(pool.get("spec") or {})
    if not explicit and (body.get("spec") or {}).get("templateRef") != spec.template_ref.to_wire():
        return None  # a pool of another template under the default's name
    return pool, spec


def _ready_members(pool: JSON, sandboxes: Index, links: pools.Links, pods: Index) -> list[JSON]:
    """The pool's members ready to claim now (their pods included)."""
    namespace = pool["metadata"]["namespace"]
    return [
        m
        for m in pools.members_of(sandboxes, links, pool)
        if pools.member_of(m, pools.pod_alive(pods, namespace, m["metadata"]["name"])).state
        is pools.MemberState.READY
    ]


async def _race(
    ctx: OperatorContext, body: JSON, pool: JSON, candidates: list[JSON]
) -> tuple[JSON | None, str | None]:
    """(the member this claim won, None) or (None, why no member can serve it, if
    that is the reason): tries members in order, skipping those other claims of
    this process are taking, until one compare-and-swap succeeds."""
    namespace = pool["metadata"]["namespace"]
    generation = int((pool.get("status") or {}).get("templateGeneration") or 0)
    by_name = {m["metadata"]["name"]: m for m in candidates}
    members = [pools.member_of(m) for m in candidates]
    me = body["metadata"]["uid"]
    now = time.monotonic()
    for key, (since, _) in list(ctx.reserved.items()):
        if now - since > RESERVATION_SECONDS:
            del ctx.reserved[key]
    lost: list[str] = []
    for _ in range(MAX_CONFLICTS):
        # Read again at every try: other claims of this process reserve as they go.
        others = reserved_by_others(ctx.reserved, namespace, me)
        choice = pools.choose_member(members, generation or _newest(members), skip=[*lost, *others])
        if choice is None:
            break
        member = by_name[choice.name]
        mismatch = incompatible(body, member)
        if mismatch is not None:
            return None, mismatch
        key = (namespace, choice.name)
        ctx.reserved[key] = (time.monotonic(), me)
        # The pod as it is now: the index can lag behind a pod that just died (a
        # busy API server's watch), and a claim must not hand out a dead member.
        if not pools.pod_ready(await ctx.kube.get(PODS.path(namespace, choice.name))):
            lost.append(choice.name)
            release(ctx.reserved, key, me)
            continue
        claimed = await _claim(ctx, body, member)
        if claimed is not None:
            metrics.POOL_CLAIMS.labels("claimed").inc()
            # No Event: status.pool says it, and a claim is kept to its few writes.
            # The pool is woken once that status is written (see reconcile).
            return claimed, None
        metrics.POOL_CLAIM_CONFLICTS.inc()
        lost.append(choice.name)
        release(ctx.reserved, key, me)
    return None, None


Reservations = dict[Key, tuple[float, str]]


def reserved_by_others(reserved: Reservations, namespace: str, claimer: str) -> list[str]:
    """Members of `namespace` that claims other than `claimer` (a Sandbox UID) are
    taking. Pure. A claimer's own reservation never holds it back: a claim that
    lost a member which then became ready takes it on its next pass."""
    return [m for (ns, m), (_, uid) in reserved.items() if ns == namespace and uid != claimer]


def release(reserved: Reservations, key: Key, claimer: str) -> None:
    """Drop `claimer`'s reservation of a member it failed to claim (lost to another
    claim, which holds its own, or no longer ready), so no claim skips the member
    once it is ready again."""
    if reserved.get(key, (0.0, ""))[1] == claimer:
        del reserved[key]


def _newest(members: list[pools.Member]) -> int:
    return max((m.template_generation for m in members), default=0)


def _claimed(use: PoolUse, member: JSON) -> PoolUse:
    meta = member["metadata"]
    return use.model_copy(update={"member": meta["name"], "member_uid": meta["uid"]})


async def _cold(ctx: OperatorContext, body: JSON, use: PoolUse, why: str, pool: JSON) -> JSON:
    metrics.POOL_CLAIMS.labels("cold").inc()
    message = f"{why}: starting a new pod"
    _announce_cold(ctx, body, message, pool)
    cold = use.model_copy(update={"outcome": PoolOutcome.COLD_START, "message": message})
    return remember(ctx.pool_decisions, _bound(body, cold, None))


def _has_pod(body: JSON) -> bool:
    return bool((body.get("status") or {}).get("podUID"))


def _announce_cold(ctx: OperatorContext, body: JSON, message: str, pool: JSON | None) -> None:
    """One PoolColdStart Event on the Sandbox and one ColdStart on its pool, however
    many passes (or processes) decide or see the cold start."""
    ctx.event_once(body, "info", reason="PoolColdStart", message=message)
    if pool is not None:
        sandbox = body["metadata"]
        ctx.event_once(
            pool, "info", "ColdStart", f"{sandbox['name']}: {message}", key=sandbox["uid"]
        )


async def _claim(ctx: OperatorContext, body: JSON, member: JSON) -> JSON | None:
    """Compare-and-swap the member's owner. The member as written, or None when
    another claim got there first (or it is no longer a ready member)."""
    meta = member["metadata"]
    path = SANDBOXES.path(meta["namespace"], meta["name"])
    # The member's own reconciliation, if one is running, finishes first; the
    # next one sees the claim and stands down (see reconcile).
    async with ctx.lock(meta["namespace"], meta["name"]):
        for _ in range(3):
            try:
                return await ctx.kube.patch(path, pools.claim_patch(member, body))
            except KubeError as exc:
                if exc.status != 409:
                    raise
            # Our copy was stale (its status was written since, say): read it again.
            fresh = await ctx.kube.get(path)
            if (
                fresh is None
                or fresh["metadata"].get("deletionTimestamp")
                or pools.member_of(fresh).state is not pools.MemberState.READY
            ):
                return None
            member = fresh
    return None
