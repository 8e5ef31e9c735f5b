"""Execution handling: one long-lived task (a Kopf daemon) per Execution.

Exactly once. The Execution's UID is the agent's idempotency key, and before
the command is first sent the pod it is sent to is recorded in status
(`podUID`). After an operator restart at any moment:
- nothing recorded: the command was never sent; start it;
- recorded, same pod: ask the agent for the key (its journal survives agent
  restarts) and follow the execution it has, or send the request again, which
  the key makes harmless;
- recorded, another pod: the command may have run in the old pod and its
  outcome is gone with it: the Execution fails as Lost, and is never re-run;
  unless the old pod was saved whole (pauseMode Memory): then it waits for the
  resume, and follows the command into the pod restored from that image
  (the Sandbox's `processesFrom`), where the same agent still runs it.
No code path retries a command: a failed or lost run is a terminal phase.

Waiting (no sandbox yet, sandbox starting or paused, no free slot) reads only
Kopf's in-memory indexes, so a queue costs the API server nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import kopf
from pydantic import ValidationError

from sandbox_operator import envvars, metrics
from sandbox_operator.agent_client import AgentError
from sandbox_operator.api.common import parse_duration, readable
from sandbox_operator.api.execution import (
    TERMINAL_PHASES,
    ExecutionPhase,
    ExecutionReason,
    ExecutionSpec,
    ExecutionStatus,
)
from sandbox_operator.api.sandbox import (
    SandboxCondition,
    SandboxPhase,
    SandboxReason,
    SandboxSpec,
    SandboxStatus,
)
from sandbox_operator.builders import execution as build
from sandbox_operator.builders import quota
from sandbox_operator.builders.conditions import find
from sandbox_operator.builders.pool import claimed_by
from sandbox_operator.clock import iso, iso_precise, now_utc, parse_time
from sandbox_operator.context import OperatorContext
from sandbox_operator.effective import effectively_paused, sandbox_spec
from sandbox_operator.indexes import Indexes
from sandbox_operator.kube import MERGE_PATCH, Refused, status_patch
from sandbox_operator.resources import EXECUTIONS, LABEL_POOL, RESUME_ANNOTATION, SANDBOXES

JSON = dict[str, Any]
T = TypeVar("T")
Key = tuple[str, str]
# Kopf indexes: (namespace, name) -> bodies, and (namespace, sandbox) -> slot entries.
SandboxIndex = Mapping[Key, Any]
SlotIndex = Mapping[Key, Any]
# SandboxQuotas by namespace: {"name", "spec"} entries.
QuotaIndex = Mapping[str, Any]
R = ExecutionReason
# Reasons to wait that never make an Execution give up: its sandbox is fine,
# the namespace or the sandbox is just busy.
PATIENT_REASONS = (R.CONCURRENCY_LIMIT, R.QUOTA_EXCEEDED)
# How often a waiting Execution looks at the indexes again (in-memory, free).
WAIT_POLL_SECONDS = 0.5
SECRET_POLL_SECONDS = 2.0
# How soon a waiting or running Execution notices `spec.cancel` (a look at memory).
CANCEL_POLL_SECONDS = 0.5
# Backoff while the agent cannot be reached (pod restarting, network blip).
AGENT_RETRY_SECONDS = (0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass
class Scheduler:
    """Process-wide state of Executions: held slots, wake-ups, agent tokens."""

    # Slots taken by this process and not yet visible in the index.
    claimed: dict[Key, set[str]] = field(default_factory=dict)
    wakeups: dict[Key, asyncio.Event] = field(default_factory=dict)
    slot_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Executions waiting for their sandbox to change (exist, start, resume), by
    # (namespace, sandbox): woken by the sandbox index, not by their next poll.
    waiting: dict[Key, set[str]] = field(default_factory=dict)

    def wakeup(self, namespace: str, name: str) -> asyncio.Event:
        return self.wakeups.setdefault((namespace, name), asyncio.Event())

    def wake(self, namespace: str, name: str) -> None:
        self.wakeup(namespace, name).set()

    def sandbox_changed(self, namespace: str, sandbox: str) -> None:
        for name in self.waiting.pop((namespace, sandbox), set()):
            self.wake(namespace, name)

    def release(self, namespace: str, sandbox: str, name: str) -> None:
        self.claimed.get((namespace, sandbox), set()).discard(name)

    def forget(self, namespace: str, name: str) -> None:
        self.wakeups.pop((namespace, name), None)


def sandbox_of(body: JSON) -> str | None:
    """The sandbox an Execution runs in: recorded, referenced, or its one-shot sandbox."""
    recorded = (body.get("status") or {}).get("sandbox")
    if recorded:
        return str(recorded)
    spec = body.get("spec") or {}
    if spec.get("sandboxRef"):
        return str(spec["sandboxRef"].get("name"))
    meta = body["metadata"]
    return build.one_shot_name(meta["name"], meta["uid"])


def slot_entry(body: JSON) -> JSON:
    """What the scheduler needs to know of an Execution (the slot index's value)."""
    status = body.get("status") or {}
    return {
        "name": body["metadata"]["name"],
        "created": body["metadata"].get("creationTimestamp", ""),
        "started": bool(status.get("podUID")),
        "done": status.get("phase") in TERMINAL_PHASES,
        "quota": status.get("reason") == ExecutionReason.QUOTA_EXCEEDED,
    }


def may_start(name: str, created: str, entries: list[JSON], claimed: set[str], limit: int) -> bool:
    """Whether `name` gets a slot: fewer than `limit` run, and it is among the
    oldest waiting ones (creation order, then name) that fit."""
    active = {e["name"] for e in entries if e["started"] and not e["done"]} | claimed
    if name in active:
        return True
    free = limit - len(active)
    if free <= 0:
        return False
    waiting = {
        (e["created"], e["name"])
        for e in entries
        if not e["started"] and not e["done"] and e["name"] not in active
    }
    waiting.add((created, name))
    return name in [n for _, n in sorted(waiting)[:free]]


class Stop(Exception):
    """The daemon should end (the Execution is being deleted, or finished)."""


class Run:
    """One Execution followed from wherever it stands to its end."""

    def __init__(
        self,
        ctx: OperatorContext,
        scheduler: Scheduler,
        body: kopf.Body,
        sandboxes: SandboxIndex,
        slots: SlotIndex,
        stopped: kopf.DaemonStopped,
        logger: kopf.Logger,
        quotas: QuotaIndex,
    ) -> None:
        self.ctx, self.scheduler, self.body = ctx, scheduler, body
        self.quotas = quotas
        self.sandboxes, self.slots, self.stopped, self.logger = sandboxes, slots, stopped, logger
        meta = body["metadata"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.uid: str = meta["uid"]
        self.created: str = meta.get("creationTimestamp", "")
        self.status = ExecutionStatus.model_validate(body.get("status") or {})
        self.spec: ExecutionSpec | None = None
        self.endpoint: str | None = None
        self.resolved_env: dict[str, str] | None = None
        self.attempt = 0

    @classmethod
    def of(
        cls,
        ctx: OperatorContext,
        scheduler: Scheduler,
        body: kopf.Body,
        indexes: Indexes,
        stopped: kopf.DaemonStopped,
        logger: kopf.Logger,
    ) -> Run:
        """A Run that reads the operator's indexes."""
        return cls(
            ctx, scheduler, body, indexes.sandboxes, indexes.slots, stopped, logger, indexes.quotas
        )

    # -- status ------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """From the live body: the write that records a cancel (a spec change)
        has observed the generation that asked for it."""
        return int(self.body["metadata"].get("generation", 1))

    async def write(self, **changes: Any) -> None:
        """Patch status when it changed (`changes` by field name; None clears one).
        Every write lands before the next step: the recorded state is what a
        restarted operator starts from."""
        if self.status.sandbox is None:
            # Which sandbox, recorded with the first write (one write fewer per run).
            one_shot = (self.body.get("spec") or {}).get("sandboxTemplate") is not None
            changes = {"sandbox": self.sandbox_name(), "one_shot": one_shot or None, **changes}
        status = build.build_status(self.status, changes, self.generation, now_utc())
        patch = status_patch(self.status.to_wire(), status.to_wire())
        if patch is None:
            return
        path = EXECUTIONS.path(self.namespace, self.name, "status")
        written = await self.ctx.kube.patch(path, patch, MERGE_PATCH)
        if written is None:
            raise Stop()  # the Execution is gone
        self.status = status

    async def finish(self, outcome: build.Outcome, record: JSON | None = None) -> None:
        now = now_utc()
        changes: JSON = {
            "phase": outcome.phase,
            "reason": outcome.reason,
            "message": outcome.message or None,
            "completion_time": iso(now),
        }
        if record is not None:
            changes.update(
                build.record_fields(record, self.ctx.settings.execution_output_tail_bytes)
            )
        if "duration" not in changes and self.status.start_time:
            elapsed = (now - parse_time(self.status.start_time)).total_seconds()
            changes["duration"] = build.format_duration(elapsed)
        await self.write(**changes)
        sandbox = self.status.sandbox or ""
        self.scheduler.release(self.namespace, sandbox, self.name)
        # A slot is free: the queued Executions of this sandbox look again now.
        for entry in self.slots.get((self.namespace, sandbox), []):
            if not entry["done"] and entry["name"] != self.name:
                self.scheduler.wake(self.namespace, entry["name"])
        metrics.EXECUTIONS.labels(outcome.phase.value, outcome.reason).inc()
        if self.created:
            metrics.EXECUTION_SECONDS.observe((now - parse_time(self.created)).total_seconds())
        kind = "info" if outcome.phase is ExecutionPhase.SUCCEEDED else "warn"
        self.ctx.event(
            dict(self.body), kind, outcome.reason, outcome.message or outcome.phase.value
        )
        self.logger.info("finished: %s %s", outcome.phase.value, outcome.message)

    async def fail(self, reason: str, message: str) -> None:
        await self.finish(build.Outcome(ExecutionPhase.FAILED, reason, message))

    # -- waiting -----------------------------------------------------------------

    def deleting(self) -> bool:
        return bool(self.body["metadata"].get("deletionTimestamp")) or self.stopped.is_set()

    def cancel_requested(self) -> bool:
        return bool((self.body.get("spec") or {}).get("cancel"))

    async def race(self, work: Awaitable[T]) -> T | None:
        """`work`'s result, or None when something else comes first: a free slot
        (a wake-up from a finishing sibling) or a cancel request (seen in the live
        body, which Kopf keeps current from the watch: no handler per event)."""
        wakeup = self.scheduler.wakeup(self.namespace, self.name)
        task = asyncio.ensure_future(work)
        waker = asyncio.ensure_future(wakeup.wait())
        cancelled = self.cancel_requested()
        try:
            done: set[asyncio.Future[Any]] = set()
            while not done and cancelled == self.cancel_requested():
                done, _ = await asyncio.wait(
                    {task, waker}, timeout=CANCEL_POLL_SECONDS, return_when=asyncio.FIRST_COMPLETED
                )
        finally:
            for pending in (task, waker):
                if not pending.done():
                    pending.cancel()
            wakeup.clear()
        return task.result() if task in done else None

    async def pause(self, seconds: float) -> None:
        await self.race(asyncio.sleep(seconds))

    async def wait(self, reason: str, message: str, **changes: Any) -> None:
        """Stay Queued for `reason`; fail once the configured bound has passed,
        unless the wait is for a slot (a busy sandbox is not a broken one).
        `changes` land in the same status write as the reason."""
        bound = parse_duration(self.ctx.settings.execution_sandbox_wait)
        overdue = self.created and now_utc() - parse_time(self.created) > bound
        if overdue and reason not in PATIENT_REASONS:
            await self.fail(
                reason, f"{message} (gave up after {self.ctx.settings.execution_sandbox_wait})"
            )
            return
        await self.write(phase=ExecutionPhase.QUEUED, reason=reason, message=message, **changes)
        if reason not in (*PATIENT_REASONS, R.SECRET_NOT_FOUND):
            key = (self.namespace, self.sandbox_name())
            self.scheduler.waiting.setdefault(key, set()).add(self.name)
        # Waits on the indexes are free; a wait for a Secret asks the API server.
        await self.pause(SECRET_POLL_SECONDS if reason == R.SECRET_NOT_FOUND else WAIT_POLL_SECONDS)

    # -- the sandbox ---------------------------------------------------------------

    def sandbox_name(self) -> str:
        name = sandbox_of(
            {
                "metadata": self.body["metadata"],
                "spec": self.body.get("spec"),
                "status": self.status.to_wire(),
            }
        )
        assert name is not None
        return name

    def sandbox(self) -> JSON | None:
        return next(iter(self.sandboxes.get((self.namespace, self.sandbox_name()), [])), None)

    async def token(self, sandbox: JSON) -> str | None:
        return await self.ctx.agent_token(sandbox)

    async def ensure_one_shot(self, template: SandboxSpec) -> None:
        sandbox = build.build_one_shot_sandbox(dict(self.body["metadata"]), template)
        if await self.ctx.kube.create(SANDBOXES.path(self.namespace), sandbox) is not None:
            self.ctx.event(
                dict(self.body), "info", "SandboxCreated", f"one-shot sandbox {self.sandbox_name()}"
            )

    async def resume(self, sandbox: JSON) -> None:
        """Ask the Sandbox controller to resume an idle-paused sandbox (an annotation,
        not a spec change: the spec belongs to whoever applied it)."""
        path = SANDBOXES.path(self.namespace, sandbox["metadata"]["name"])
        # Sub-second precision: a pause is recorded to the second, and a resume in
        # that same second must still count as later than the pause.
        moment = iso_precise(datetime.now(UTC))
        await self.ctx.kube.patch(path, {"metadata": {"annotations": {RESUME_ANNOTATION: moment}}})
        self.ctx.event(
            dict(self.body),
            "info",
            "SandboxResumed",
            f"resuming sandbox {sandbox['metadata']['name']}",
        )

    async def env(self) -> dict[str, str] | tuple[str, str]:
        """Resolved environment, or (reason, message) when a Secret is not there (yet).
        Read once: a queued Execution must not read Secrets at every look around."""
        assert self.spec is not None
        if self.resolved_env is None:
            try:
                self.resolved_env = await envvars.resolve(
                    self.ctx.kube, self.namespace, self.spec.env
                )
            except envvars.MissingSecret as exc:
                return R.SECRET_NOT_FOUND, f"spec.{exc}"
        return self.resolved_env

    def refused(self, exc: Refused) -> Awaitable[None]:
        """The error policy's report when the API server refuses the one-shot sandbox:
        the Execution fails (an invalid sandbox) or waits saying why (a quota)."""
        message = f"{exc}"
        if exc.permanent:
            return self.fail(R.CREATE_FAILED, message)
        if exc.quota:
            return self.wait(R.QUOTA_EXCEEDED, message)
        return self.wait(R.CREATE_FAILED, message)

    def over_quota(self) -> str | None:
        """Why one more running Execution does not fit the namespace's SandboxQuotas."""
        limits = {
            entry["name"]: entry["spec"]
            for entry in self.quotas.get(self.namespace, [])
            if entry["spec"].running_executions is not None
        }
        if not limits:
            return None
        running = quota.running_executions(self.slots, self.scheduler.claimed, self.namespace)
        return quota.refusal(
            limits, quota.Usage(running_executions=running), quota.Usage(running_executions=1)
        )

    # -- the steps -----------------------------------------------------------------

    async def drive(self) -> None:
        """The daemon body: take the Execution to its end. Errors go through the error
        policy; the daemon restarts and picks up from the recorded status."""
        with contextlib.suppress(Stop):
            await self.run()

    async def run(self) -> None:
        try:
            self.spec = ExecutionSpec.model_validate(self.body.get("spec") or {})
        except ValidationError as exc:
            if not build.terminal(self.status):
                await self.fail(R.INVALID_SPEC, readable(exc))
        while not build.terminal(self.status):
            if self.deleting():
                return  # the deletion handler cancels what runs
            if self.status.pod_uid:
                await self.follow()
            else:
                await self.start()
        await self.after()

    async def start(self) -> None:
        """Not started yet: find the sandbox, a slot, then record and send the command."""
        assert self.spec is not None
        if self.cancel_requested():
            outcome = build.Outcome(
                ExecutionPhase.CANCELLED, R.CANCELLED, "cancelled before it started"
            )
            await self.finish(outcome)
            return
        name = self.sandbox_name()
        sandbox = self.sandbox()
        if sandbox is None or sandbox["metadata"].get("deletionTimestamp"):
            if self.spec.sandbox_template is not None and sandbox is None:
                await self.ensure_one_shot(self.spec.sandbox_template)
                await self.wait(R.SANDBOX_STARTING, f"creating sandbox {name}")
            else:
                await self.wait(R.SANDBOX_NOT_FOUND, f"sandbox {name} does not exist")
            return
        if (sandbox["metadata"].get("labels") or {}).get(LABEL_POOL) or claimed_by(sandbox):
            # Nothing may be left in a warm member before (or behind) its claimer.
            why = (
                f"sandbox {name} is a SandboxPool member: run commands in the Sandbox that"
                " claims it (spec.poolRef)"
            )
            await self.fail(R.POOL_MEMBER, why)
            return
        sb_status = SandboxStatus.model_validate(sandbox.get("status") or {})
        if sb_status.phase == SandboxPhase.FAILED:
            await self.fail(R.SANDBOX_FAILED, f"sandbox {name} failed: {_why_not_ready(sb_status)}")
            return
        try:
            sb_spec = sandbox_spec(sandbox)
        except ValidationError:
            await self.wait(R.SANDBOX_STARTING, f"sandbox {name} has an invalid spec")
            return
        if effectively_paused(sandbox, sb_spec):
            if sb_spec.paused:
                await self.wait(R.SANDBOX_PAUSED, f"sandbox {name} is paused (spec.paused)")
                return
            if not self.status.sandbox_resumed:
                await self.resume(sandbox)
            # The flag and the reason in one write: a reader never sees one without the other.
            message = f"resuming sandbox {name}, paused when idle"
            await self.wait(R.SANDBOX_RESUMING, message, sandbox_resumed=True)
            return
        endpoint, pod_uid = sb_status.agent_endpoint, sb_status.pod_uid
        ready = find(sb_status.conditions, SandboxCondition.READY)
        if ready is not None and ready.reason == SandboxReason.QUOTA_EXCEEDED:
            await self.wait(R.QUOTA_EXCEEDED, f"sandbox {name} waits for quota: {ready.message}")
            return
        if sb_status.phase != SandboxPhase.RUNNING or not endpoint or not pod_uid:
            await self.wait(R.SANDBOX_STARTING, f"waiting for sandbox {name} to be ready")
            return
        env = await self.env()
        if isinstance(env, tuple):
            await self.wait(*env)
            return
        limit = self.ctx.settings.max_executions_per_sandbox
        async with self.scheduler.slot_lock:
            claimed = self.scheduler.claimed.setdefault((self.namespace, name), set())
            entries = list(self.slots.get((self.namespace, name), []))
            free = may_start(self.name, self.created, entries, claimed, limit)
            # The namespace's quotas, counted under the same lock as the claims.
            over = self.over_quota() if free and self.name not in claimed else None
            if free and over is None:
                claimed.add(self.name)
        if over is not None:
            await self.wait(R.QUOTA_EXCEEDED, over)
            return
        if not free:
            await self.wait(
                R.CONCURRENCY_LIMIT,
                f"{limit} executions already run in sandbox {name}; waiting in creation order",
            )
            return
        if self.deleting() or self.cancel_requested():
            self.scheduler.release(self.namespace, name, self.name)
            return
        # The intent is recorded before the command is sent: see the module docstring.
        await self.write(
            phase=ExecutionPhase.RUNNING,
            reason=R.STARTED,
            message=None,
            pod_uid=pod_uid,
            start_time=iso(now_utc()),
        )
        self.endpoint = endpoint
        self.logger.info("starting in sandbox %s, pod %s, agent %s", name, pod_uid, endpoint)
        await self.send(endpoint, env)

    async def send(self, endpoint: str, env: dict[str, str]) -> None:
        """Write the input files and start the command (idempotent by the UID key)."""
        assert self.spec is not None
        sandbox = self.sandbox()
        token = await self.token(sandbox) if sandbox else None
        if not token:
            return  # follow() sorts out what happened to the sandbox
        try:
            for file in self.spec.files:
                await self.ctx.agents.write_file(
                    endpoint, token, file.path, file.content.encode(), file.mode
                )
            record = await self.ctx.agents.start(
                endpoint, token, build.agent_request(self.spec, self.uid, env)
            )
        except AgentError as exc:
            if exc.refused:
                await self.fail(R.START_FAILED, str(exc))
            else:
                self.logger.warning("agent unavailable, will try again: %s", exc)
                await self.backoff()
            return
        self.attempt = 0
        await self.write(agent_execution_id=record["id"])

    async def backoff(self) -> None:
        metrics.AGENT_ERRORS.inc()
        await self.pause(AGENT_RETRY_SECONDS[min(self.attempt, len(AGENT_RETRY_SECONDS) - 1)])
        self.attempt += 1

    async def follow(self) -> None:
        """Started: wait for the agent to report the end (or cancel it)."""
        name = self.sandbox_name()
        sandbox = self.sandbox()
        if sandbox is None or sandbox["metadata"].get("deletionTimestamp"):
            await self.fail(R.SANDBOX_DELETED, f"sandbox {name} was deleted while the command ran")
            return
        sb_status = SandboxStatus.model_validate(sandbox.get("status") or {})
        if sb_status.pod_uid != self.status.pod_uid:
            carried = carried_on(sb_status, self.status.pod_uid)
            if carried is not None:
                if carried:
                    self.logger.info(
                        "pod %s was restored from the image of pod %s: following there",
                        sb_status.pod_uid,
                        self.status.pod_uid,
                    )
                    await self.write(pod_uid=sb_status.pod_uid)
                else:
                    await self.pause(WAIT_POLL_SECONDS)
                return
            await self.fail(
                R.LOST,
                f"the pod of sandbox {name} ended or was replaced while the command ran; "
                "the outcome is unknown and the command is not run again",
            )
            return
        if sb_status.phase == SandboxPhase.FAILED:
            await self.fail(R.SANDBOX_FAILED, f"sandbox {name} failed while the command ran")
            return
        endpoint = sb_status.agent_endpoint or self.endpoint
        token = await self.token(sandbox)
        if not endpoint or not token:
            await self.pause(WAIT_POLL_SECONDS)  # pod restarting: its status will say more
            return
        try:
            record = await self.observe(endpoint, token)
        except AgentError as exc:
            if exc.status == 404 and self.status.agent_execution_id:
                await self.fail(
                    R.LOST,
                    "the sandbox agent no longer knows this execution; the outcome is unknown",
                )
            elif exc.refused:
                await self.fail(R.START_FAILED, str(exc))
            else:
                self.logger.warning("agent unavailable, will look again: %s", exc)
                await self.backoff()
            return
        self.attempt = 0
        if record is None:
            return
        outcome = build.outcome_of(record)
        if outcome is None:
            return
        deleted = (self.sandbox() or sandbox)["metadata"].get("deletionTimestamp")
        if outcome.phase is not ExecutionPhase.SUCCEEDED and deleted:
            # The sandbox's teardown stopped the pod: that is the cause worth naming.
            outcome = build.Outcome(
                ExecutionPhase.FAILED,
                R.SANDBOX_DELETED,
                f"sandbox {name} was deleted while the command ran ({outcome.message})",
            )
        await self.finish(outcome, record)

    async def observe(self, endpoint: str, token: str) -> JSON | None:
        """The agent's record after one wait (None: woken or not yet started)."""
        agents = self.ctx.agents
        execution_id = self.status.agent_execution_id
        if not execution_id:
            found = await agents.find(endpoint, token, self.uid)
            if found is None:
                env = await self.env()
                if isinstance(env, tuple):
                    await self.fail(*env)
                    return None
                await self.send(endpoint, env)
                return None
            await self.write(agent_execution_id=found["id"])
            execution_id = found["id"]
        if self.cancel_requested():
            grace = self.ctx.settings.execution_cancel_grace_seconds
            return await agents.cancel(endpoint, token, execution_id, grace)
        poll = self.ctx.settings.execution_poll_seconds
        return await self.race(agents.execution(endpoint, token, execution_id, wait_seconds=poll))

    async def after(self) -> None:
        """Finished: remove a one-shot sandbox, then the Execution after its TTL."""
        if self.status.one_shot:
            await self.ctx.kube.delete(SANDBOXES.path(self.namespace, self.sandbox_name()))
        ttl = (self.body.get("spec") or {}).get("ttlSecondsAfterFinished")
        if ttl is None or not self.status.completion_time:
            return
        finished = parse_time(self.status.completion_time)
        left = ttl - (now_utc() - finished).total_seconds()
        if left > 0 and await self.stopped.wait(left):
            return
        await self.ctx.kube.delete(
            EXECUTIONS.path(self.namespace, self.name), uid=self.body["metadata"]["uid"]
        )


def carried_on(sandbox_status: SandboxStatus, pod_uid: str | None) -> bool | None:
    """Whether the processes of pod `pod_uid`, which the sandbox no longer runs,
    go on in its current pod (pauseMode Memory): True once that pod was
    restored from their image, False while the image waits (paused, or the
    resumed pod not confirmed yet), None when they are gone."""
    if pod_uid is None:
        return None
    if sandbox_status.processes_from == pod_uid and sandbox_status.pod_uid:
        return True
    kept = sandbox_status.memory
    return False if kept is not None and kept.pod_uid == pod_uid else None


def _why_not_ready(sandbox_status: SandboxStatus) -> str:
    ready = find(sandbox_status.conditions, SandboxCondition.READY)
    return (ready.message or ready.reason) if ready else "no detail"


async def deleted(
    ctx: OperatorContext,
    scheduler: Scheduler,
    body: JSON,
    indexes: Indexes,
    logger: kopf.Logger,
) -> None:
    """Finalizer: kill the process group of a running command, remove a one-shot sandbox."""
    meta = body["metadata"]
    status = ExecutionStatus.model_validate(body.get("status") or {})
    scheduler.forget(meta["namespace"], meta["name"])
    sandbox_name = sandbox_of(body)
    sandbox = next(iter(indexes.sandboxes.get((meta["namespace"], sandbox_name or ""), [])), None)
    if not build.terminal(status) and status.pod_uid and sandbox is not None:
        sb_status = SandboxStatus.model_validate(sandbox.get("status") or {})
        endpoint = sb_status.agent_endpoint
        here = sb_status.pod_uid == status.pod_uid or carried_on(sb_status, status.pod_uid)
        if endpoint and here:
            token = await ctx.agent_token(sandbox)
            if token:
                await _cancel(ctx, endpoint, token, meta["uid"], status.agent_execution_id, logger)
    if sandbox_name and status.one_shot:
        await ctx.kube.delete(SANDBOXES.path(meta["namespace"], sandbox_name))
    if sandbox_name:
        scheduler.release(meta["namespace"], sandbox_name, meta["name"])


async def _cancel(
    ctx: OperatorContext,
    endpoint: str,
    token: str,
    uid: str,
    execution_id: str | None,
    logger: kopf.Logger,
) -> None:
    try:
        if not execution_id:
            found = await ctx.agents.find(endpoint, token, uid)
            execution_id = found["id"] if found else None
        if execution_id:
            await ctx.agents.cancel(
                endpoint, token, execution_id, ctx.settings.execution_cancel_grace_seconds
            )
            logger.info("cancelled agent execution %s", execution_id)
    except AgentError as exc:
        if exc.status == 404:
            return
        raise kopf.TemporaryError(f"could not cancel the command: {exc}", delay=2) from exc
