"""Kopf registration: wires decorators to the per-kind handler modules. Thin.

Run with `kopf run -m sandbox_operator.main --all-namespaces` (or `--namespace X`),
and `--peering NAME` for several replicas with one active (peering.py) or
`--standalone` for exactly one.
Every handler runs under the one error policy (errors.policy), which also
counts it in the metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from contextlib import suppress
from typing import Any, cast

import kopf
from prometheus_client import start_http_server

from sandbox_operator import (
    bookkeeping,
    collector,
    config,
    errors,
    logs,
    peering,
    timetable,
    wirejson,
)
from sandbox_operator import login as kopf_login
from sandbox_operator.agent_client import AgentClient
from sandbox_operator.builders import pool as pools
from sandbox_operator.context import OperatorContext
from sandbox_operator.events import EventRecorder
from sandbox_operator.handlers import execution, sandbox
from sandbox_operator.handlers import pool as pool_controller
from sandbox_operator.handlers import quota as quotas
from sandbox_operator.handlers import snapshot as snapshots
from sandbox_operator.handlers import template as templates
from sandbox_operator.handlers.sandbox import deadlines
from sandbox_operator.indexes import (
    OWN_SELECTOR,
    Indexes,
    drop_managed_fields,
    pod_essentials,
    trim,
)
from sandbox_operator.kube import Kube
from sandbox_operator.resources import (
    CLAIMS,
    CLUSTER_SANDBOX_TEMPLATES,
    EXECUTIONS,
    LABEL_MANAGED_BY,
    LABEL_POOL,
    LABEL_SANDBOX,
    MANAGED_BY,
    PODS,
    SANDBOX_POOLS,
    SANDBOX_QUOTAS,
    SANDBOX_TEMPLATES,
    SANDBOXES,
    SNAPSHOTS,
    Resource,
)
from sandbox_operator.sweep import Gone, Sweep
from sandbox_operator.sweep import Key as SweepKey

# Read at import: the timer interval is fixed when handlers are registered.
SETTINGS = config.load()
SANDBOX = (SANDBOXES.group, SANDBOXES.plural)
EXECUTION = (EXECUTIONS.group, EXECUTIONS.plural)
SNAPSHOT = (SNAPSHOTS.group, SNAPSHOTS.plural)
QUOTA = (SANDBOX_QUOTAS.group, SANDBOX_QUOTAS.plural)
TEMPLATE = (SANDBOX_TEMPLATES.group, SANDBOX_TEMPLATES.plural)
CLUSTER_TEMPLATE = (CLUSTER_SANDBOX_TEMPLATES.group, CLUSTER_SANDBOX_TEMPLATES.plural)
POOL = (SANDBOX_POOLS.group, SANDBOX_POOLS.plural)
POD = (PODS.group, PODS.version, PODS.plural)
CLAIM = (CLAIMS.group, CLAIMS.version, CLAIMS.plural)
OWN = {LABEL_MANAGED_BY: MANAGED_BY}
# See configure(): how Kopf waits for a timer pass in flight when its object is deleted.
TIMER_EXIT_WAIT_SECONDS = 1.0
TIMER_EXIT_POLL_SECONDS = 1.0
# How long a Sandbox's deletion waits for its clock pass in flight before it cancels it.
PASS_EXIT_WAIT_SECONDS = 5.0

# Before Kopf starts: the clock pauses with it (peering.follow_pauses).
peering.follow_pauses()


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    bookkeeping.configure(settings)
    wirejson.use_in_kopf()
    peering.configure(settings, SETTINGS.peering_lifetime_seconds)
    # Watch only our own pods and claims, filtered by the API server, not in this process.
    for resource in (POD, CLAIM):
        settings.watching.label_selectors[resource] = OWN_SELECTOR
    settings.execution.max_workers = SETTINGS.max_workers
    # A Sandbox deleted while its timer pass runs (always so when the pass itself
    # deleted it: idle, paused and lifetime timeouts) keeps its finalizer until
    # the pass is over. Kopf waits for that in place this long, then looks again
    # this often; with its defaults (no wait, once a minute) such a deletion
    # took a minute longer.
    settings.background.instant_exit_timeout = TIMER_EXIT_WAIT_SECONDS
    settings.background.cancellation_polling = TIMER_EXIT_POLL_SECONDS
    # Handler chatter stays in logs; Events are for what users should see.
    settings.posting.level = logging.WARNING
    settings.networking.connect_timeout = 10
    logs.configure()
    collector.configure(SETTINGS.gc_thresholds)
    kube = Kube.from_environment(connections=SETTINGS.api_connections)
    memo.events = EventRecorder(kube)
    memo.ctx = OperatorContext(
        settings=SETTINGS,
        kube=kube,
        agents=AgentClient(timeout=SETTINGS.agent_timeout_seconds),
        post=memo.events.post,
        post_once=memo.events.post_once,
    )
    memo.scheduler = execution.Scheduler()
    await peering.ensure_objects(memo.ctx.kube, settings, SETTINGS.watch_namespaces)
    await peering.announce(memo.ctx.kube, settings, SETTINGS.watch_namespaces)
    if SETTINGS.metrics_port:
        start_http_server(SETTINGS.metrics_port)
    # Startup handlers get the indexes too (empty until the watches fill them).
    pause = peering.pause(settings)
    clock = memo.ctx.timetable.run(_clock_pass(memo, settings, _indexes(kwargs)), pause)
    memo.clock = asyncio.create_task(clock, name="the Sandboxes' clock")
    memo.sweep = None
    if pause is not None:
        namespaces = SETTINGS.watch_namespaces
        swept = Sweep(memo.ctx.kube, _indexes(kwargs), namespaces, _forget_gone(memo))
        memo.sweep = asyncio.create_task(swept.run(pause), name="the sweep after pauses")


@kopf.on.login()
async def login(logger: kopf.Logger, **kwargs: Any) -> kopf.AiohttpSession:
    return await kopf_login.bounded_session(
        logger, SETTINGS.api_connections, len(SETTINGS.watch_namespaces), **kwargs
    )


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    ctx: OperatorContext = memo.ctx
    for task in (memo.clock, memo.sweep):
        if task is not None:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    await memo.events.drain()
    await ctx.kube.close()
    await ctx.agents.close()
    await ctx.checkpoints.close()


def _ctx(memo: kopf.Memo) -> OperatorContext:
    ctx: OperatorContext = memo.ctx
    return ctx


def _scheduler(memo: kopf.Memo) -> execution.Scheduler:
    scheduler: execution.Scheduler = memo.scheduler
    return scheduler


def _forget_gone(memo: kopf.Memo) -> Gone:
    """What this process keeps of an object that was deleted while it was paused
    (sweep.py), as the object's deletion would have dropped it."""

    def gone(resource: Resource, key: SweepKey) -> None:
        namespace, name, uid = key
        if namespace is None:
            return
        if resource == SANDBOXES:
            _ctx(memo).forget(namespace, name, uid)
        elif resource == SANDBOX_QUOTAS:
            quotas.forget(namespace, name)
        elif resource == EXECUTIONS:
            _scheduler(memo).forget(namespace, name)

    return gone


def _indexes(kwargs: Mapping[str, Any]) -> Indexes:
    """The indexes registered below, from a handler's kwargs, where Kopf passes
    each under its index function's name: the one place that knows those names."""
    return Indexes(
        sandboxes=kwargs["sandbox_bodies"],
        links=kwargs["sandbox_pool_links"],
        pods=kwargs["sandbox_pods"],
        claims=kwargs["sandbox_claims"],
        quotas=kwargs["sandbox_quotas"],
        pools=kwargs["sandbox_pools"],
        slots=kwargs["execution_slots"],
    )


# Every handler, index functions included, is a coroutine: Kopf runs a plain
# function in its thread pool, and an index function runs on every event of
# every object (the GIL handed to a thread and back each time; at 10,000
# Sandboxes, 16% of the operator's profile samples were in that step).


# -- Sandbox -------------------------------------------------------------------------


@kopf.index(*SANDBOX)
async def sandbox_bodies(
    namespace: str | None, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> dict[Any, Any]:
    """Sandboxes by (namespace, name), so pod events and Executions find them without a GET.

    Executions waiting for this sandbox look again as soon as the index holds
    the new body (they wake after this function returns), not at their next poll."""
    drop_managed_fields(body)
    scheduler = getattr(memo, "scheduler", None)
    if scheduler is not None and namespace:
        scheduler.sandbox_changed(namespace, name)
    if namespace:
        ctx = _ctx(memo)
        key = (namespace, name, body["metadata"]["uid"])
        if body["metadata"].get("deletionTimestamp"):
            ctx.timetable.drop(key)  # its finalizer has the last word
        else:
            ctx.timetable.ensure(key)
        ctx.status_seen(namespace, name, body.get("status"))
    # Without managedFields already (above): kept as the event is, no trimmed copy.
    return {(namespace, name): dict(body)}


@kopf.index(*SANDBOX)
async def sandbox_pool_links(body: kopf.Body, **_: Any) -> dict[Any, Any] | None:
    """Pool members by pool and by claimer, claimers by pool (`builders.pool.pool_links`)."""
    return pools.pool_links(dict(body))


@kopf.index(*POD, labels=OWN)
async def sandbox_pods(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> Any:
    """Our pods by (namespace, sandbox): the parts of them the operator reads."""
    owner = labels.get(LABEL_SANDBOX)
    return {(namespace, owner): pod_essentials(body)} if owner else None


@kopf.index(*CLAIM, labels=OWN)
async def sandbox_claims(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> Any:
    """Our workspace claims by (namespace, sandbox)."""
    owner = labels.get(LABEL_SANDBOX)
    return {(namespace, owner): trim(body)} if owner else None


@kopf.on.create(*SANDBOX)
@kopf.on.update(*SANDBOX)
@kopf.on.resume(*SANDBOX)
async def sandbox_changed(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, reason: str, **kwargs: Any
) -> None:
    ctx = _ctx(memo)
    children = {
        "create": sandbox.Children.CREATE,
        "update": sandbox.Children.CONVERGE,
    }.get(str(reason), sandbox.Children.ENSURE)
    refused = sandbox.refused(ctx, dict(body))
    backoff = (ctx.backoffs, dict(body))
    async with errors.policy(
        "Sandbox", str(reason), refused, retry=kwargs["retry"], backoff=backoff
    ):
        await sandbox.reconcile(
            ctx,
            dict(body),
            logger,
            children=children,
            indexes=_indexes(kwargs),
        )


# Each Sandbox's pass when nothing happens to it: at the time its last pass
# worked out (handlers.sandbox.deadlines), not on a fixed timer, so a Sandbox
# that waits for nothing costs nothing. One clock for all of them
# (timetable.py), started with the operator.
def _clock_pass(
    memo: kopf.Memo, settings: kopf.OperatorSettings, indexes: Indexes
) -> timetable.Pass:
    async def due(key: timetable.Key) -> None:
        ctx = _ctx(memo)
        namespace, name, uid = key
        # The pass sets its own next time; one that ends early without (a claimed
        # pool member's, served by its claimer) leaves this one, never a past time.
        ctx.timetable.set(key, deadlines.resync_seconds(uid, ctx.settings))
        found = indexes.sandboxes.get((namespace, name), [])
        body = next((b for b in found if b["metadata"]["uid"] == uid), None)
        if body is None:
            ctx.timetable.drop(key)  # gone, or a namesake in its place
            return
        wrapped = kopf.Body(cast(kopf.RawBody, body))
        # Logs with the Sandbox's name, as Kopf's own lines; what users should
        # see goes out as Events from the pass itself (ctx.post).
        logger = kopf.LocalObjectLogger(body=wrapped, settings=settings)
        await sandbox_due(wrapped, memo, logger, indexes)

    return due


async def sandbox_due(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, indexes: Indexes
) -> None:
    """The pass of a Sandbox whose time came."""
    if body["metadata"].get("deletionTimestamp"):
        return
    ctx = _ctx(memo)
    # A pass that fails has set the time of its retry (reconcile); a bad spec
    # was reported in status by the change handler.
    with suppress(kopf.PermanentError, kopf.TemporaryError):
        backoff = (ctx.backoffs, dict(body))
        report = sandbox.refused(ctx, dict(body))
        async with errors.policy("Sandbox", "timer", report, backoff=backoff):
            await sandbox.reconcile(
                ctx,
                dict(body),
                logger,
                children=sandbox.Children.POD,
                indexes=indexes,
            )


@kopf.on.delete(*SANDBOX)
async def sandbox_deleted(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    meta = body["metadata"]
    # Not while a clock pass of it may still write to its children.
    await _ctx(memo).timetable.settle(
        (meta["namespace"], meta["name"], meta["uid"]), PASS_EXIT_WAIT_SECONDS
    )
    async with errors.policy("Sandbox", "delete"):
        await sandbox.teardown(_ctx(memo), dict(body), logger)


@kopf.on.event(*SANDBOX)
async def sandbox_event(
    type: str, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any
) -> None:
    """Gone: drop what this process holds for it (the finalizer does too, when it
    ran). New and naming a pool: claim a member now, in the round of the event
    that announced it (see `handlers.sandbox.arrival`)."""
    ctx = _ctx(memo)
    if type == "DELETED":
        sandbox.forget(ctx, dict(body))
        return
    if type not in (None, "ADDED") or not pools.awaits_claim(dict(body)):
        return
    await sandbox.claim_on_arrival(ctx, body, kwargs["patch"], logger, _indexes(kwargs))


async def _child_changed(
    trigger: str, type: str, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, kwargs: Any
) -> None:
    """A pod or claim of a Sandbox changed: converge its Sandbox now."""
    meta = body["metadata"]
    indexes = _indexes(kwargs)
    name = (meta.get("labels") or {}).get(LABEL_SANDBOX)
    bodies = indexes.sandboxes.get((meta["namespace"], name), []) if name else []
    owner = next(iter(bodies), None)
    claimer = pools.claimed_by(owner) if owner is not None else None
    if claimer is not None:
        # A claimed pool member's child: the Sandbox that claimed it is served by it.
        bodies = indexes.sandboxes.get((meta["namespace"], claimer["name"]), [])
        owner = next(iter(bodies), None)
    if owner is None or owner["metadata"].get("deletionTimestamp"):
        return
    ctx = _ctx(memo)
    # A pod event carries the pod as it stands; a claim event leaves the pod to the index.
    is_pod = trigger == "pod-event"
    with suppress(kopf.PermanentError):
        report = sandbox.refused(ctx, owner)
        async with errors.policy("Sandbox", trigger, report, backoff=(ctx.backoffs, owner)):
            await sandbox.reconcile(
                ctx,
                owner,
                logger,
                children=sandbox.Children.POD,
                indexes=indexes,
                pod=dict(body) if is_pod and type != "DELETED" else None,
                pod_known=is_pod,
            )


@kopf.on.event(*POD, labels=OWN)
async def pod_event(
    type: str, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any
) -> None:
    await _child_changed("pod-event", type, body, memo, logger, kwargs)


@kopf.on.event(*CLAIM, labels=OWN)
async def claim_event(
    type: str, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any
) -> None:
    await _child_changed("claim-event", type, body, memo, logger, kwargs)


# -- Execution ------------------------------------------------------------------------


@kopf.index(*EXECUTION)
async def execution_slots(namespace: str | None, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    """Executions by (namespace, sandbox): the per-sandbox queue, read without a GET."""
    drop_managed_fields(body)
    return {(namespace, execution.sandbox_of(dict(body))): execution.slot_entry(dict(body))}


# One task per Execution follows it from Queued to its end. Deleting it stops
# the task at once; the deletion handler below then cancels what still runs.
@kopf.daemon(*EXECUTION, cancellation_timeout=1.0)
async def execution_daemon(
    body: kopf.Body,
    memo: kopf.Memo,
    logger: kopf.Logger,
    stopped: kopf.DaemonStopped,
    **kwargs: Any,
) -> None:
    ctx = _ctx(memo)
    run = execution.Run.of(ctx, _scheduler(memo), body, _indexes(kwargs), stopped, logger)
    async with errors.policy("Execution", "daemon", run.refused, daemon=True):
        await run.drive()


@kopf.on.delete(*EXECUTION, retries=10, errors=kopf.ErrorsMode.IGNORED)
async def execution_deleted(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any
) -> None:
    async with errors.policy("Execution", "delete"):
        await execution.deleted(_ctx(memo), _scheduler(memo), dict(body), _indexes(kwargs), logger)


# -- SandboxQuota ---------------------------------------------------------------------


@kopf.index(*QUOTA)
async def sandbox_quotas(namespace: str | None, body: kopf.Body, **_: Any) -> dict[Any, Any] | None:
    """SandboxQuotas by namespace: what admission checks Sandboxes and Executions against."""
    entry = quotas.index_entry(dict(body))
    return {namespace: entry} if entry is not None else None


async def _observe_quota(body: kopf.Body, memo: kopf.Memo, kwargs: Mapping[str, Any]) -> None:
    claimed = _scheduler(memo).claimed
    await quotas.observe(_ctx(memo), dict(body), _indexes(kwargs), claimed)


@kopf.on.event(*QUOTA)
async def quota_event(type: str, body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    meta = body["metadata"]
    if type == "DELETED":
        quotas.forget(meta["namespace"], meta["name"])
        return
    async with errors.policy("SandboxQuota", "event"):
        await _observe_quota(body, memo, kwargs)


@kopf.timer(*QUOTA, interval=SETTINGS.reconcile_interval_seconds)
async def quota_tick(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    async with errors.policy("SandboxQuota", "timer"):
        await _observe_quota(body, memo, kwargs)


# -- Snapshot --------------------------------------------------------------------------


@kopf.on.create(*SNAPSHOT)
@kopf.on.resume(*SNAPSHOT)
async def snapshot_changed(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, reason: str, retry: int, **_: Any
) -> None:
    ctx = _ctx(memo)
    refused = snapshots.refused(ctx, dict(body))
    async with errors.policy("Snapshot", str(reason), refused, retry=retry):
        await snapshots.take(ctx, dict(body), logger, retry=retry)


# Mirrors the VolumeSnapshot of a taken Snapshot (deleted or repaired behind our back).
@kopf.timer(
    *SNAPSHOT,
    interval=SETTINGS.reconcile_interval_seconds * 2,
    initial_delay=SETTINGS.reconcile_interval_seconds * 2,
)
async def snapshot_tick(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    if body["metadata"].get("deletionTimestamp"):
        return
    async with errors.policy("Snapshot", "timer"):
        await snapshots.observe(_ctx(memo), dict(body), logger)


@kopf.on.delete(*SNAPSHOT)
async def snapshot_deleted(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    async with errors.policy("Snapshot", "delete"):
        await snapshots.release(_ctx(memo), dict(body), logger)


# -- SandboxTemplate -------------------------------------------------------------------
# ClusterSandboxTemplates have no setup (snapshots are namespaced): their status
# says whether Sandboxes of them can run here, and is kept current by spec changes.


@kopf.on.create(*CLUSTER_TEMPLATE)
@kopf.on.update(*CLUSTER_TEMPLATE)
@kopf.on.resume(*CLUSTER_TEMPLATE)
@kopf.on.create(*TEMPLATE)
@kopf.on.update(*TEMPLATE)
@kopf.on.resume(*TEMPLATE)
async def template_changed(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, reason: str, **_: Any
) -> None:
    async with errors.policy("SandboxTemplate", str(reason)):
        await templates.reconcile(_ctx(memo), dict(body), logger)


@kopf.on.event(*TEMPLATE)
async def template_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    if event["type"] == "DELETED":
        _ctx(memo).template_statuses.pop(event["object"]["metadata"]["uid"], None)


@kopf.timer(
    *TEMPLATE,
    interval=SETTINGS.reconcile_interval_seconds,
    initial_delay=SETTINGS.reconcile_interval_seconds,
)
async def template_tick(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    with suppress(kopf.PermanentError, kopf.TemporaryError):
        async with errors.policy("SandboxTemplate", "timer"):
            await templates.reconcile(_ctx(memo), dict(body), logger)


# -- SandboxPool -----------------------------------------------------------------------


@kopf.index(*POOL)
async def sandbox_pools(
    namespace: str | None, name: str, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    """SandboxPools by (namespace, name): a claim reads its pool without a GET."""
    return {(namespace, name): trim(body)}


@kopf.daemon(*POOL, cancellation_timeout=2.0)
async def pool_loop(
    body: kopf.Body,
    memo: kopf.Memo,
    logger: kopf.Logger,
    stopped: kopf.DaemonStopped,
    **kwargs: Any,
) -> None:
    # `body` is kept current by Kopf: each pass reads the pool as it stands.
    await pool_controller.run(_ctx(memo), body, _indexes(kwargs), logger, stopped)


@kopf.on.event(*POOL)
async def pool_event(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A spec change (replicas from `kubectl scale`, say): a pass now, not at the next tick."""
    _ctx(memo).wake_pool(body["metadata"]["namespace"], body["metadata"]["name"])


@kopf.on.event(*SANDBOX, labels={LABEL_POOL: kopf.PRESENT})
async def pool_member_event(
    body: kopf.Body, memo: kopf.Memo, labels: kopf.Labels, **_: Any
) -> None:
    """A waiting member changed (got ready, failed, went): its pool recounts."""
    _ctx(memo).wake_pool(body["metadata"]["namespace"], str(labels[LABEL_POOL]))
