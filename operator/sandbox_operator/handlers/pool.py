"""The SandboxPool controller: keep `replicas` warm members of the pool's template.

Members are Sandboxes of the template, owned by the pool and labelled with its
name; the Sandbox controller starts them like any other. This controller
only decides how many to create or delete (builders.pool.refill_plan, paced
by maxCreating) and reports counts and a Ready condition. It runs as one
loop per pool, woken by its members' events and by claims
(`OperatorContext.wake_pool`), so a burst of claims costs one pass, not one
per claim. A pass builds the status (pure functions below) and writes it
once; it runs under the one error policy (errors.py), like every handler.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

import kopf
from pydantic import ValidationError

from sandbox_operator import errors, metrics
from sandbox_operator.api.common import readable
from sandbox_operator.api.pool import PoolCondition, SandboxPoolSpec, SandboxPoolStatus
from sandbox_operator.api.sandbox import SandboxReason
from sandbox_operator.builders import pool as pools
from sandbox_operator.builders.conditions import FALSE, Cond, merge
from sandbox_operator.builders.template import describe, template_path
from sandbox_operator.clock import iso, now_utc
from sandbox_operator.context import OperatorContext
from sandbox_operator.indexes import Indexes
from sandbox_operator.kube import MERGE_PATCH, KubeError, Refused, status_patch
from sandbox_operator.resources import LABEL_POOL, SANDBOX_POOLS, SANDBOXES

JSON = dict[str, Any]
Key = tuple[str, str]
Index = Mapping[Key, Any]

# How long a pass waits for the index to show the members it created or deleted.
INDEX_WAIT_STEP = 0.05
INDEX_WAIT_STEPS = 100


def with_ready(old: SandboxPoolStatus, cond: Cond, generation: int, now: str) -> SandboxPoolStatus:
    """`old` with the Ready condition `cond`, observed at `generation`. Pure."""
    return old.model_copy(
        update={
            "conditions": merge(old.conditions, {PoolCondition.READY: cond}, generation, now),
            "observed_generation": generation,
        }
    )


def invalid_status(
    old: SandboxPoolStatus, why: str, generation: int, now: str
) -> SandboxPoolStatus:
    """A pool whose spec does not parse. Pure."""
    cond = Cond(PoolCondition.READY, FALSE, SandboxReason.INVALID_SPEC, f"invalid spec: {why}")
    return with_ready(old, cond, generation, now)


def refused_status(
    old: SandboxPoolStatus, why: str, generation: int, now: str
) -> SandboxPoolStatus:
    """A pool whose pass the API server refused (a member's create, say). Pure."""
    cond = Cond(PoolCondition.READY, FALSE, SandboxReason.CREATE_FAILED, why)
    return with_ready(old, cond, generation, now)


def pool_status(
    old: SandboxPoolStatus,
    body: JSON,
    spec: SandboxPoolSpec,
    template: JSON | None,
    generation: int,
    members: list[JSON],
    observed: list[pools.Member],
    claimed: int,
    now: str,
) -> SandboxPoolStatus:
    """The status of a pool whose members are `members` (`observed` as their
    pods stand), its template as read (`generation`: the template's). Pure."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    counted = pools.counts(observed, generation)
    failing = next(
        (m for m in members if pools.member_of(m).state is pools.MemberState.FAILED), None
    )
    reason, message = pools.failure_of(failing) if failing is not None else ("", "")
    cond = pools.ready_condition(
        template_found=template is not None,
        template_name=describe(spec.template_ref, namespace),
        template_has_python=reason != SandboxReason.RUNTIME_NO_PYTHON,
        template_invalid=pools.template_problem(template),
        replicas=spec.replicas,
        ready=counted.ready,
        failing_member=failing["metadata"]["name"] if failing is not None else None,
        failure=message,
        stuck=pools.stuck_member(members),
    )
    return with_ready(old, cond, meta.get("generation", 0), now).model_copy(
        update={
            "replicas": counted.replicas,
            "ready": counted.ready,
            "creating": counted.creating,
            "claimed": claimed,
            "selector": f"{LABEL_POOL}={name}",
            "template_generation": generation or None,
        }
    )


async def reconcile(
    ctx: OperatorContext, body: JSON, indexes: Indexes, logger: kopf.Logger
) -> None:
    """One pass: read the template, create or delete members, write status (once,
    when it changed)."""
    old = SandboxPoolStatus.model_validate(body.get("status") or {})
    await _write(ctx, body, old, await _converge(ctx, body, old, indexes, logger))


async def _converge(
    ctx: OperatorContext,
    body: JSON,
    old: SandboxPoolStatus,
    indexes: Indexes,
    logger: kopf.Logger,
) -> SandboxPoolStatus:
    """Create or delete members as the refill plan says; the status that follows."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    sandboxes, links, pods = indexes.sandboxes, indexes.links, indexes.pods
    try:
        spec = SandboxPoolSpec.model_validate(body.get("spec") or {})
    except ValidationError as exc:
        return invalid_status(old, readable(exc), meta.get("generation", 0), iso(now_utc()))
    template = await ctx.kube.get(template_path(spec.template_ref, namespace))
    generation = int((template or {}).get("metadata", {}).get("generation") or 0)

    def observe() -> tuple[list[JSON], list[pools.Member]]:
        members = pools.members_of(sandboxes, links, body)
        alive = [pools.pod_alive(pods, namespace, m["metadata"]["name"]) for m in members]
        return members, [pools.member_of(m, up) for m, up in zip(members, alive, strict=True)]

    members, observed = observe()
    invalid = pools.template_problem(template)
    if template is not None and not invalid and not meta.get("deletionTimestamp"):
        plan = pools.refill_plan(observed, spec.replicas, spec.max_creating, generation)
        await _carry_out(ctx, body, spec, plan, generation, sandboxes, logger)
        members, observed = observe()
    claimed = pools.claimed_count(sandboxes, links, namespace, name)
    return pool_status(
        old, body, spec, template, generation, members, observed, claimed, iso(now_utc())
    )


async def _carry_out(
    ctx: OperatorContext,
    body: JSON,
    spec: SandboxPoolSpec,
    plan: pools.RefillPlan,
    generation: int,
    sandboxes: Index,
    logger: kopf.Logger,
) -> None:
    namespace = body["metadata"]["namespace"]
    for member in plan.delete:
        seen = next(iter(sandboxes.get((namespace, member), [])), None)
        if seen is None:
            continue
        # Conditioned on the member as seen: one claimed since is not deleted.
        meta = seen["metadata"]
        deleted = await ctx.kube.delete(
            SANDBOXES.path(namespace, member),
            uid=meta["uid"],
            resource_version=meta["resourceVersion"],
        )
        if deleted:
            metrics.POOL_MEMBERS.labels("deleted").inc()
            logger.info("deleted member %s", member)
    made: list[str] = []
    for _ in range(plan.create):
        created = await ctx.kube.create(
            SANDBOXES.path(namespace), pools.build_member(body, spec, generation)
        )
        if created is not None:
            metrics.POOL_MEMBERS.labels("created").inc()
            made.append(created["metadata"]["name"])
    # The next pass counts from the index: let it show what this one did, or
    # that pass would create the same members again.
    await _until_indexed(sandboxes, namespace, made, plan.delete)


async def _until_indexed(
    sandboxes: Index, namespace: str, created: list[str], deleted: tuple[str, ...]
) -> None:
    for _ in range(INDEX_WAIT_STEPS):
        seen = all(sandboxes.get((namespace, name)) for name in created)
        gone = all(
            not store or next(iter(store))["metadata"].get("deletionTimestamp")
            for store in (sandboxes.get((namespace, name)) for name in deleted)
        )
        if seen and gone:
            return
        await asyncio.sleep(INDEX_WAIT_STEP)


async def _write(
    ctx: OperatorContext, body: JSON, old: SandboxPoolStatus, new: SandboxPoolStatus
) -> None:
    patch = status_patch(old.to_wire(), new.to_wire())
    if patch is None:
        return
    meta = body["metadata"]
    await ctx.kube.patch(
        SANDBOX_POOLS.path(meta["namespace"], meta["name"], "status"), patch, MERGE_PATCH
    )
    body["status"] = new.to_wire()


def refused(ctx: OperatorContext, body: JSON) -> errors.Report:
    """The error policy's report for a write the API server refused: the pool's
    Ready condition says so (CreateFailed, with the API server's message). A
    failure to write that is only logged: the pass is tried again anyway."""

    async def report(exc: Refused) -> None:
        old = SandboxPoolStatus.model_validate(body.get("status") or {})
        generation = body["metadata"].get("generation", 0)
        with contextlib.suppress(KubeError):
            await _write(ctx, body, old, refused_status(old, str(exc), generation, iso(now_utc())))

    return report


async def run(
    ctx: OperatorContext,
    body: Mapping[str, Any],
    indexes: Indexes,
    logger: kopf.Logger,
    stopped: Any,
) -> None:
    """The pool's loop: a pass whenever woken, and every reconcile interval. Each
    pass runs under the error policy (errors.py) as a handler does, and a pass
    that fails is tried again after the policy's delay, never the end of the loop."""
    meta = body["metadata"]
    woken = ctx.pool_wakeup(meta["namespace"], meta["name"])
    interval = ctx.settings.reconcile_interval_seconds
    retry = 0  # failed passes in a row: Kopf's retry count for a handler
    while not stopped:
        woken.clear()
        try:
            # `daemon`: a spec the policy deems final ends nothing here (the status
            # says why; a spec change is a new pass).
            async with errors.policy(
                "SandboxPool", "daemon", refused(ctx, dict(body)), daemon=True, retry=retry
            ):
                await reconcile(ctx, dict(body), indexes, logger)
        except kopf.TemporaryError as exc:
            logger.warning("pool pass failed: %s", exc)
            retry += 1
            await asyncio.sleep(exc.delay or errors.TRANSIENT_RETRY_SECONDS)
            continue
        retry = 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(interval):
                await woken.wait()
    ctx.pool_wakeups.pop((meta["namespace"], meta["name"]), None)
