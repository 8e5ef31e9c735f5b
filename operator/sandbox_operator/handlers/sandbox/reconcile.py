"""Sandbox reconciliation: children from builders, status from observation.

Every entry point (create/update/resume, the periodic timer, pod and claim
events) ends in `reconcile`, which is level-based: it looks at what exists and
converges, so a missed event or an operator restart at any moment costs nothing.
The decisions (what to do with the pod, the workspace, an idle sandbox) are
functions of what was read, in the modules beside this one, kept apart from
the calls that carry them out.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from enum import Enum
from typing import Any

import kopf

from sandbox_operator import errors, identity, metrics
from sandbox_operator.api.common import parse_duration
from sandbox_operator.api.sandbox import (
    PoolOutcome,
    SandboxPhase,
    SandboxReason,
)
from sandbox_operator.builders import sandbox_status
from sandbox_operator.builders.pool import claimed, claimed_by
from sandbox_operator.builders.sandbox_status import Observed
from sandbox_operator.clock import now_utc, parse_time
from sandbox_operator.context import OperatorContext
from sandbox_operator.handlers.sandbox import deadlines, memory
from sandbox_operator.handlers.sandbox.admission import SandboxIndex, admit
from sandbox_operator.handlers.sandbox.environment import sync_environment, sync_files
from sandbox_operator.handlers.sandbox.lifecycle import (
    Settled,
    idle_snapshot_outcome,
    lifecycle,
    paused_fields,
)
from sandbox_operator.handlers.sandbox.pod import decide_pod, ensure_pod, with_eviction
from sandbox_operator.handlers.sandbox.pool_claim import take_member
from sandbox_operator.handlers.sandbox.status import (
    Blocked,
    current,
    report,
    report_blocked,
    spec_fields,
    status_of,
    write_status,
)
from sandbox_operator.handlers.sandbox.template_use import pin_template
from sandbox_operator.handlers.sandbox.view import SandboxView, parse_spec, read
from sandbox_operator.handlers.sandbox.workspace import (
    ClaimState,
    claim_state,
    ensure_children,
    plan_workspace,
    roll_back,
)
from sandbox_operator.indexes import Indexes
from sandbox_operator.kube import Refused
from sandbox_operator.resources import (
    CLAIMS,
    PODS,
)

JSON = dict[str, Any]
Key = tuple[str, str]


# How long teardown waits for a graceful pod exit before forcing it.
POD_DELETE_PATIENCE = timedelta(seconds=60)


class Children(Enum):
    """How much of the Sandbox's children a reconciliation looks after."""

    # Only the pod (timer, pod and claim events): cheapest, the common case.
    POD = "pod"
    # Create missing children, leave existing ones be (operator restart).
    ENSURE = "ensure"
    # Creation: ENSURE, unless the pod exists. The pod is made after its siblings,
    # so this is the creation handler run again: Kopf had not seen its own
    # "handled" mark within its consistency timeout (at 10,000 Sandboxes on 2
    # cores, for most of them: 3 conflicting creates each).
    CREATE = "create"
    # Also bring drifted children back to the spec (spec updates).
    CONVERGE = "converge"


def refused(ctx: OperatorContext, body: JSON) -> Any:
    """The error policy's report for a child the API server refused: a status
    saying so (Ready=False, CreateFailed, or QuotaExceeded for a ResourceQuota,
    with the API server's message)."""

    async def report(exc: Refused) -> None:
        spec, _ = parse_spec(body, ctx.settings)
        if exc.quota:
            await report_blocked(ctx, body, spec, quota=str(exc))
        else:
            await report_blocked(ctx, body, spec, refused=str(exc))

    return report


async def reconcile(
    ctx: OperatorContext,
    body: JSON,
    logger: kopf.Logger,
    *,
    children: Children,
    indexes: Indexes,
    pod: JSON | None = None,
    pod_known: bool = False,
    status_into: kopf.Patch | None = None,
) -> JSON | None:
    """Converge one Sandbox. `children` says how far beyond the pod to look;
    `pod_known` means `pod` is the pod as it stands (None: there is none);
    otherwise the pod index is asked. The final status goes into `status_into`
    when given (see `write_status`). Returns the status a full pass arrived at
    (None when it stopped early)."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"], meta["uid"])
    try:
        return await _pass(ctx, body, logger, children, indexes, pod, pod_known, status_into, key)
    except Exception as exc:
        # Whatever ended this pass early, a later one tries again, whichever
        # trigger this was (Kopf retries change handlers, not event handlers).
        ctx.timetable.sooner(key, _retry_in(ctx, body, exc))
        raise


def _retry_in(ctx: OperatorContext, body: JSON, exc: Exception) -> float:
    """Seconds until a pass that ended in `exc` is tried again."""
    if isinstance(exc, kopf.TemporaryError) and exc.delay is not None:
        return float(exc.delay)
    if isinstance(exc, kopf.PermanentError) or (isinstance(exc, Refused) and exc.permanent):
        # Not before the spec changes, which starts a pass by itself.
        return deadlines.resync_seconds(body["metadata"]["uid"], ctx.settings)
    if (refused := ctx.backoffs.remaining(body)) > 0:
        return refused
    if errors.transient(exc):
        return errors.TRANSIENT_RETRY_SECONDS
    return ctx.settings.reconcile_interval_seconds


async def _pass(
    ctx: OperatorContext,
    body: JSON,
    logger: kopf.Logger,
    children: Children,
    indexes: Indexes,
    pod: JSON | None,
    pod_known: bool,
    status_into: kopf.Patch | None,
    key: tuple[str, str, str],
) -> JSON | None:
    meta = body["metadata"]
    async with ctx.lock(meta["namespace"], meta["name"]):
        if not _present(indexes.sandboxes, identity.ref_of(body)):
            return None  # gone since this pass was scheduled (a timer of a deleted Sandbox)
        body = current(ctx, body)
        if claimed_by(body) is not None:
            return None  # a pool member another Sandbox claimed: that one looks after it now
        recorded = (body.get("status") or {}).get("pool")
        view: SandboxView | None = None
        try:
            # A protocol step: a pool claim is written (the member's owner) before
            # anything of this Sandbox (see pool_claim).
            body = await take_member(ctx, body, indexes)
            kids = identity.children_ref(body)
            if kids.uid != meta["uid"] and not _present(indexes.sandboxes, kids):
                # Its children went with the member: nothing to rebuild them from.
                why = (
                    f"the pool member {kids.name} that served this Sandbox was deleted, with"
                    " its pod and workspace; delete this Sandbox and create it again"
                )
                raise Blocked(SandboxReason.POOL_MEMBER_LOST.value, why)
            if kids.uid != meta["uid"]:
                children = _on_member(body, recorded, children)
            if pod_known:
                ctx.created_pods.pop((kids.namespace, kids.name), None)  # the event is newer
            else:
                indexed = next(iter(indexes.pods.get((kids.namespace, kids.name), [])), None)
                pod = ctx.known_pod(kids.namespace, kids.name, indexed)
            claim = next(iter(indexes.claims.get((kids.namespace, kids.name), [])), None)
            # A protocol step: the template is read once and recorded (written)
            # before the spec is, which takes its defaults from the record.
            body = await pin_template(ctx, body)
            # From here on the pass works on this object: read it once.
            view = read(body, ctx.settings, pod=pod, claim=claim)
            if view.spec is not None and view.invalid is None and kids.uid == meta["uid"]:
                # A protocol step, under the namespace's lock (see admission). A
                # claimed member keeps the share it was admitted with.
                await admit(ctx, view, indexes.sandboxes, indexes.quotas)
            # Under the object's lock, so that racing triggers see each other's refusals.
            if (wait := ctx.backoffs.remaining(body)) > 0:
                raise kopf.TemporaryError(f"refused before; next try in {wait:.1f}s", delay=wait)
            try:
                await _reconcile(ctx, view, logger, children=children, status_into=status_into)
            except Refused as exc:
                if not exc.permanent:
                    ctx.backoffs.refused(body)
                raise
        except Blocked as blocked:
            # Every pass that stops short ends here: the status says why, written
            # once, with the spec when the pass had read it.
            await report(ctx, body, view.spec if view is not None else None, blocked)
            retry = blocked.retry
            if retry is None:  # for the user to fix (or never): the status says so
                retry = deadlines.resync_seconds(meta["uid"], ctx.settings)
            ctx.timetable.set(key, retry)
            error = blocked.error()
            if error is None:
                return None
            raise error from blocked
        ctx.backoffs.clear(body)
        # The status this pass arrived at: its writes keep the body's current.
        status: JSON = body.get("status") or {}
        use = status.get("pool") or {}
        if use != (recorded or {}) and use.get("outcome") == PoolOutcome.CLAIMED:
            # A member left the pool: refill now. (The pool counts its claimed
            # members from their status: a pass after the status is written does.)
            ctx.wake_pool(meta["namespace"], use["name"])
        return status


def _on_member(body: JSON, recorded: JSON | None, children: Children) -> Children:
    """How far a pass looks beyond the pod of a Sandbox served by a claimed member,
    whose children exist, converged to the pool's template: only a network of
    this Sandbox's own changes them, once, when just claimed (later spec updates
    converge as usual). Pure."""
    if children is Children.CONVERGE:
        return children
    just_claimed = (body.get("status") or {}).get("pool") != recorded
    own_network = bool((body.get("spec") or {}).get("network"))
    return Children.CONVERGE if just_claimed and own_network else Children.POD


def _present(sandboxes: SandboxIndex, ref: identity.SandboxRef) -> bool:
    """The Sandbox (this very object, by UID) is in the index: it exists."""
    return any(
        b["metadata"].get("uid") == ref.uid for b in sandboxes.get((ref.namespace, ref.name), [])
    )


async def _reconcile(
    ctx: OperatorContext,
    view: SandboxView,
    logger: kopf.Logger,
    *,
    children: Children,
    status_into: kopf.Patch | None = None,
) -> None:
    now = now_utc()
    if view.invalid is not None:
        raise Blocked(SandboxReason.INVALID_SPEC.value, view.invalid, permanent=True)
    body, spec, old, pod = view.body, view.valid_spec, view.old, view.pod
    ref = view.served_by
    if children is Children.CREATE:
        children = Children.POD if pod is not None else Children.ENSURE
    workspace = await plan_workspace(ctx, body, spec)
    created_claim = None
    if children is not Children.POD:
        created_claim = await ensure_children(
            ctx, ref, spec, converge=children is Children.CONVERGE, workspace=workspace
        )
    if pod is None and children is Children.POD and not view.paused:
        # The pod is gone (evicted, deleted): its siblings may be too.
        created_claim = await ensure_children(ctx, ref, spec, converge=False, workspace=workspace)
    await roll_back(ctx, body, workspace, pod)
    if workspace.refused and workspace.condition is not None:
        ctx.event(body, "warn", reason="RestoreRefused", message=workspace.condition.message)
    claim, claims = view.claim, ClaimState()
    if not spec.workspace.ephemeral and not workspace.hold:
        if claim is None or not identity.controlled_by(claim, ref):
            # Not in the index yet (or only an earlier namesake's is): the one this
            # pass just created, or (created by an earlier pass) ask, rather than
            # make a pod the scheduler would find waiting on an unbound claim.
            claim = created_claim or await ctx.kube.get(
                CLAIMS.path(ref.namespace, identity.names(ref.name)["claim"])
            )
        claims = await claim_state(ctx, ref.namespace, claim, now)
    pod = await with_eviction(ctx, pod)
    decision = decide_pod(
        pod,
        spec,
        paused=view.paused,
        hold=workspace.hold,
        claim=claims,
        status=old,
        now=now,
        agent_patience=parse_duration(ctx.settings.agent_unready_patience),
    )
    kept = await memory.before_pod(
        ctx, view, pod, decision, now, logger, rolling_back=workspace.hold or workspace.busy
    )
    restore_from = old.memory if memory.wants_memory(spec) and not view.paused else None
    pod = await ensure_pod(ctx, view, pod, kept.decision, logger, memory=restore_from)

    fields: JSON = {**workspace.fields, **spec_fields(body, spec, ctx.settings), **kept.fields}
    if not view.deleting:
        fields["admitted"] = True  # admit() let it through: it holds its share from now on
    fields.update(paused_fields(old, spec, view.paused and pod is None, now))
    if (pod or {}).get("metadata", {}).get("uid") != old.pod_uid:
        # A new pod carries on no pod's processes until its restore is confirmed.
        fields["processes_from"] = None
    if not view.paused:
        fields["idle_paused_at"] = None
        if old.idle_paused_at or old.paused_since:
            # Resumed: the next idle period takes a snapshot of its own (and one
            # pausedTimeout was taking is not taken for the idle policy's).
            fields.update(idle_snapshot=None, idle_snapshot_started_at=None)
    observed = Observed(
        generation=view.generation,
        # A pause whose save failed waits: the sandbox runs on meanwhile.
        paused=view.paused and not kept.waiting,
        deleting=view.deleting,
        ephemeral=spec.workspace.ephemeral,
        pod=pod,
        claim=claims.claim,
        claim_problem=claims.problem,
        restore=workspace.condition,
        holding=workspace.hold,
        awaiting_claim=claims.wait,
        memory=memory.condition(spec, old.evolve(**kept.fields), kept.said),
    )
    status = sandbox_status.build_status(old, observed, ctx.settings.agent_port, now, **fields)
    if status.phase == SandboxPhase.RUNNING:
        await sync_environment(ctx, view, pod, status.agent_endpoint)
        written, problem = await sync_files(ctx, view, status)
        if problem is not None:
            observed = replace(observed, files_problem=problem)
            status = sandbox_status.build_status(
                old, observed, ctx.settings.agent_port, now, **fields
            )
        status = status.evolve(ready_pod_uid=status.pod_uid, files_written=written)
        settled = await memory.after_ready(ctx, view, pod, status, logger)
        if settled is not None:
            # The resumed pod of a saved one is ready: its verdict, and the image is gone.
            fields.update(settled.fields)
            observed = replace(observed, memory=settled.said)
            status = sandbox_status.build_status(
                old, observed, ctx.settings.agent_port, now, **fields
            ).evolve(ready_pod_uid=status.pod_uid, files_written=written)
    if old.phase == SandboxPhase.PAUSED and not view.paused:
        ctx.event(body, "info", reason="Resumed", message="starting the pod on the kept workspace")
    if not observed.deleting:
        changes = await lifecycle(ctx, view, status, now, logger)
        if changes is None:
            return  # deleted: the finalizer takes it from here
        if changes.get("idle_paused_at"):
            # Paused by the idle policy just now: converge again as a paused sandbox,
            # from the object as this pass leaves it (read again: its status changed).
            body["status"] = status.evolve(**changes).to_wire()
            again = read(body, ctx.settings, pod=pod, claim=claim)
            await _reconcile(ctx, again, logger, children=Children.POD, status_into=status_into)
            return
        status = status.evolve(**changes)
        look = deadlines.next_pass(
            status,
            pod,
            uid=view.ref.uid,
            claim_wait=claims.wait,
            restoring=workspace.busy,
            now=now,
            settings=ctx.settings,
        )
        wait = look.seconds_from(now)
        if kept.waiting:  # a pause whose save failed tries again
            wait = min(wait, ctx.settings.memory_retry_seconds)
        ctx.timetable.set((view.ref.namespace, view.ref.name, view.ref.uid), wait)
    await write_status(ctx, body, status, into=status_into)
    if workspace.busy and children is not Children.POD:
        # Change handlers retry; timers and pod events come back by themselves.
        raise kopf.TemporaryError("restoring the workspace from a snapshot", delay=1)


def forget(ctx: OperatorContext, body: JSON) -> None:
    """Drop what this process holds for a Sandbox that is going."""
    own, served_by = identity.ref_of(body), identity.children_ref(body)
    metrics.PHASES.forget(own.namespace, own.name)
    ctx.forget(own.namespace, own.name, own.uid)
    ctx.tokens.pop((served_by.namespace, served_by.uid), None)
    if claimed(body):
        # Its pool counts one claimed member less now, not at its next periodic pass.
        ctx.wake_pool(own.namespace, body["status"]["pool"]["name"])


async def teardown(ctx: OperatorContext, body: JSON, logger: kopf.Logger) -> None:
    """Finalizer: wait for the idle policy's snapshot (bounded), stop the pod (no
    writes in flight), then let GC take the rest. Snapshots are not owned by
    the Sandbox: they stay."""
    ref = identity.children_ref(body)
    status = status_of(body)
    if status.idle_snapshot and not status.idle_paused_at:
        spec, _ = parse_spec(body, ctx.settings)
        started = status.idle_snapshot_started_at
        name = status.idle_snapshot
        settled, why = await idle_snapshot_outcome(ctx, body, spec, name, started, now_utc())
        if settled is Settled.WAITING:
            raise kopf.TemporaryError(f"waiting for snapshot {name}", delay=2)
        if settled is Settled.FAILED:
            # Deleted by its user: the Sandbox goes, as it was asked to.
            message = f"snapshot {name}: {why}; deleting as asked"
            ctx.event(body, "warn", reason="IdleSnapshotFailed", message=message)
    forget(ctx, body)
    if status.memory is not None:  # a paused sandbox's saved pod: of no use any more
        await memory.drop(ctx, ref.namespace, status.memory, logger)
    path = PODS.path(ref.namespace, identity.names(ref.name)["pod"])
    pod = await ctx.kube.get(path)
    if pod is None:
        return
    deleting_since = pod["metadata"].get("deletionTimestamp")
    if not deleting_since:
        await ctx.kube.delete(path, uid=pod["metadata"]["uid"])
        raise kopf.TemporaryError("waiting for the pod to stop", delay=1)
    if now_utc() - parse_time(deleting_since) > POD_DELETE_PATIENCE:
        logger.warning("pod did not stop in %s; forcing", POD_DELETE_PATIENCE)
        await ctx.kube.delete(path, grace_seconds=0, uid=pod["metadata"]["uid"])
        return
    raise kopf.TemporaryError("waiting for the pod to stop", delay=1)
