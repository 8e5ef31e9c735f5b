"""Execution handling: one long-lived task (a Kopf daemon) per Execution.

Exactly once. The Execution's UID is the agent's idempotency key, and before
the command is first sent the pod it is sent to is recorded in status
(`podUID`). After an operator restart at any moment:
- nothing recorded: the command was never sent; start it;
- recorded, same pod: ask the agent for the key (its journal survives agent
  restarts) and follow the execution it has, or send the request again, which
  the key makes harmless;
- recorded, another pod: the command may have run in the old pod and its
  outcome is gone with it: the Execution fails as Lost, and is never re-run.
No code path retries a command: a failed or lost run is a terminal phase.

Waiting (no sandbox yet, sandbox starting or paused, no free slot) reads only
Kopf's in-memory indexes, so a queue costs the API server nothing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import kopf
from pydantic import ValidationError

from sandbox_operator import conditions, metrics
from sandbox_operator.agent_client import AgentError, parse_time
from sandbox_operator.api.common import parse_duration
from sandbox_operator.api.execution import ExecutionPhase, ExecutionSpec
from sandbox_operator.api.sandbox import SandboxSpec
from sandbox_operator.builders import execution as build
from sandbox_operator.handlers.sandbox import (
    RESUME_ANNOTATION,
    Runtime,
    agent_token,
    effective_paused,
    event,
    iso,
    now_utc,
    readable,
)
from sandbox_operator.kube import MERGE_PATCH, KubeError, resource_path, status_patch

JSON = dict[str, Any]
T = TypeVar("T")
Key = tuple[str, str]
# Kopf indexes: (namespace, name) -> bodies, and (namespace, sandbox) -> slot entries.
SandboxIndex = kopf.Index[Key, JSON]
SlotIndex = kopf.Index[Key, JSON]

API_VERSION = "sandbox.dev/v1alpha1"
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

    def wakeup(self, namespace: str, name: str) -> asyncio.Event:
        return self.wakeups.setdefault((namespace, name), asyncio.Event())

    def wake(self, namespace: str, name: str) -> None:
        self.wakeup(namespace, name).set()

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
        "done": build.terminal(status),
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
        rt: Runtime,
        scheduler: Scheduler,
        body: kopf.Body,
        sandboxes: SandboxIndex,
        slots: SlotIndex,
        stopped: kopf.DaemonStopped,
        logger: kopf.Logger,
    ) -> None:
        self.rt, self.scheduler, self.body = rt, scheduler, body
        self.sandboxes, self.slots, self.stopped, self.logger = sandboxes, slots, stopped, logger
        meta = body["metadata"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.uid: str = meta["uid"]
        self.created: str = meta.get("creationTimestamp", "")
        self.generation: int = meta.get("generation", 1)
        self.status: JSON = dict(body.get("status") or {})
        self.spec: ExecutionSpec | None = None
        self.endpoint: str | None = None
        self.resolved_env: dict[str, str] | None = None
        self.attempt = 0

    # -- status ------------------------------------------------------------------

    async def write(self, changes: JSON) -> None:
        """Patch status when it changed. Every write lands before the next step:
        the recorded state is what a restarted operator starts from."""
        if "sandbox" not in self.status:
            # Which sandbox, recorded with the first write (one write fewer per run).
            one_shot = (self.body.get("spec") or {}).get("sandboxTemplate") is not None
            changes = {"sandbox": self.sandbox_name(), "oneShot": one_shot or None, **changes}
        status = build.build_status(self.status, changes, self.generation, now_utc())
        patch = status_patch(self.status, status)
        if patch is None:
            return
        path = resource_path(API_VERSION, "executions", self.namespace, self.name, "status")
        written = await self.rt.kube.patch(path, patch, MERGE_PATCH)
        if written is None:
            raise Stop()  # the Execution is gone
        self.status = status

    async def finish(self, outcome: build.Outcome, record: JSON | None = None) -> None:
        now = now_utc()
        changes: JSON = {
            "phase": outcome.phase.value,
            "reason": outcome.reason,
            "message": outcome.message or None,
            "completionTime": iso(now),
        }
        if record is not None:
            changes.update(
                build.record_fields(record, self.rt.settings.execution_output_tail_bytes)
            )
        if "duration" not in changes and self.status.get("startTime"):
            elapsed = (now - parse_time(self.status["startTime"])).total_seconds()
            changes["duration"] = build.format_duration(elapsed)
        await self.write(changes)
        sandbox = self.status.get("sandbox") or ""
        self.scheduler.release(self.namespace, sandbox, self.name)
        # A slot is free: the queued Executions of this sandbox look again now.
        for entry in self.slots.get((self.namespace, sandbox), []):
            if not entry["done"] and entry["name"] != self.name:
                self.scheduler.wake(self.namespace, entry["name"])
        metrics.EXECUTIONS.labels(outcome.phase.value, outcome.reason).inc()
        if self.created:
            metrics.EXECUTION_SECONDS.observe((now - parse_time(self.created)).total_seconds())
        kind = "info" if outcome.phase is ExecutionPhase.SUCCEEDED else "warn"
        event(dict(self.body), kind, outcome.reason, outcome.message or outcome.phase.value)
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

    async def wait(self, reason: str, message: str) -> None:
        """Stay Queued for `reason`; fail once the configured bound has passed,
        unless the wait is for a slot (a busy sandbox is not a broken one)."""
        bound = parse_duration(self.rt.settings.execution_sandbox_wait)
        overdue = self.created and now_utc() - parse_time(self.created) > bound
        if overdue and reason != build.REASON_CONCURRENCY_LIMIT:
            await self.fail(
                reason, f"{message} (gave up after {self.rt.settings.execution_sandbox_wait})"
            )
            return
        await self.write(
            {"phase": ExecutionPhase.QUEUED.value, "reason": reason, "message": message}
        )
        # Waits on the indexes are free; a wait for a Secret asks the API server.
        await self.pause(
            SECRET_POLL_SECONDS if reason == build.REASON_SECRET_NOT_FOUND else WAIT_POLL_SECONDS
        )

    # -- the sandbox ---------------------------------------------------------------

    def sandbox_name(self) -> str:
        name = sandbox_of(
            {
                "metadata": self.body["metadata"],
                "spec": self.body.get("spec"),
                "status": self.status,
            }
        )
        assert name is not None
        return name

    def sandbox(self) -> JSON | None:
        return next(iter(self.sandboxes.get((self.namespace, self.sandbox_name()), [])), None)

    async def token(self, sandbox: JSON) -> str | None:
        return await agent_token(self.rt, sandbox)

    async def ensure_one_shot(self, template: SandboxSpec) -> None:
        sandbox = build.build_one_shot_sandbox(dict(self.body["metadata"]), template)
        path = resource_path(API_VERSION, "sandboxes", self.namespace)
        if await self.rt.kube.create(path, sandbox) is not None:
            event(
                dict(self.body), "info", "SandboxCreated", f"one-shot sandbox {self.sandbox_name()}"
            )

    async def resume(self, sandbox: JSON) -> None:
        """Ask the Sandbox controller to resume an idle-paused sandbox (an annotation,
        not a spec change: the spec belongs to whoever applied it)."""
        path = resource_path(API_VERSION, "sandboxes", self.namespace, sandbox["metadata"]["name"])
        # Sub-second precision: a pause is recorded to the second, and a resume in
        # that same second must still count as later than the pause.
        moment = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        await self.rt.kube.patch(path, {"metadata": {"annotations": {RESUME_ANNOTATION: moment}}})
        event(
            dict(self.body),
            "info",
            "SandboxResumed",
            f"resuming sandbox {sandbox['metadata']['name']}",
        )

    async def env(self) -> dict[str, str] | tuple[str, str]:
        """Resolved environment, or (reason, message) when a Secret is not there (yet).
        Read once: a queued Execution must not read Secrets at every look around."""
        assert self.spec is not None
        if self.resolved_env is not None:
            return self.resolved_env
        resolved: dict[str, str] = {}
        for var in self.spec.env:
            if var.value is not None:
                resolved[var.name] = var.value
                continue
            assert var.value_from is not None
            ref = var.value_from.secret_key_ref
            secret = await self.rt.kube.get(
                resource_path("v1", "secrets", self.namespace, ref.name)
            )
            encoded = (secret or {}).get("data", {}).get(ref.key)
            if encoded is None:
                where = (
                    f"secret {ref.name!r} has no key {ref.key!r}"
                    if secret
                    else f"secret {ref.name!r} not found"
                )
                return build.REASON_SECRET_NOT_FOUND, f"spec.env[{var.name}]: {where}"
            resolved[var.name] = base64.b64decode(encoded).decode(errors="replace")
        self.resolved_env = resolved
        return resolved

    # -- the steps -----------------------------------------------------------------

    async def drive(self) -> None:
        """The daemon body: take the Execution to its end. API errors are retried by
        Kopf (the daemon restarts and picks up from the recorded status)."""
        with contextlib.suppress(Stop):
            try:
                await self.run()
            except KubeError as exc:
                if exc.status >= 500 or exc.status == 429:
                    raise kopf.TemporaryError(f"API server: {exc}", delay=1) from exc
                raise

    async def run(self) -> None:
        try:
            self.spec = ExecutionSpec.model_validate(self.body.get("spec") or {})
        except ValidationError as exc:
            if not build.terminal(self.status):
                await self.fail(build.REASON_INVALID_SPEC, readable(exc))
        while not build.terminal(self.status):
            if self.deleting():
                return  # the deletion handler cancels what runs
            if self.status.get("podUID"):
                await self.follow()
            else:
                await self.start()
        await self.after()

    async def start(self) -> None:
        """Not started yet: find the sandbox, a slot, then record and send the command."""
        assert self.spec is not None
        if self.cancel_requested():
            await self.finish(
                build.Outcome(
                    ExecutionPhase.CANCELLED, build.REASON_CANCELLED, "cancelled before it started"
                )
            )
            return
        name = self.sandbox_name()
        sandbox = self.sandbox()
        if sandbox is None or sandbox["metadata"].get("deletionTimestamp"):
            if self.spec.sandbox_template is not None and sandbox is None:
                await self.ensure_one_shot(self.spec.sandbox_template)
                await self.wait(build.REASON_SANDBOX_STARTING, f"creating sandbox {name}")
            else:
                await self.wait(build.REASON_SANDBOX_NOT_FOUND, f"sandbox {name} does not exist")
            return
        sb_status = sandbox.get("status") or {}
        if sb_status.get("phase") == "Failed":
            await self.fail(
                build.REASON_SANDBOX_FAILED,
                f"sandbox {name} failed: {sb_status.get('message') or _why_not_ready(sb_status)}",
            )
            return
        try:
            sb_spec = SandboxSpec.model_validate(sandbox.get("spec") or {})
        except ValidationError:
            await self.wait(build.REASON_SANDBOX_STARTING, f"sandbox {name} has an invalid spec")
            return
        if effective_paused(sandbox, sb_spec):
            if sb_spec.paused:
                await self.wait(
                    build.REASON_SANDBOX_PAUSED, f"sandbox {name} is paused (spec.paused)"
                )
                return
            if not self.status.get("sandboxResumed"):
                await self.resume(sandbox)
                await self.write({"sandboxResumed": True})
            await self.wait(
                build.REASON_SANDBOX_RESUMING, f"resuming sandbox {name}, paused when idle"
            )
            return
        endpoint, pod_uid = sb_status.get("agentEndpoint"), sb_status.get("podUID")
        if sb_status.get("phase") != "Running" or not endpoint or not pod_uid:
            await self.wait(
                build.REASON_SANDBOX_STARTING, f"waiting for sandbox {name} to be ready"
            )
            return
        env = await self.env()
        if isinstance(env, tuple):
            await self.wait(*env)
            return
        async with self.scheduler.slot_lock:
            claimed = self.scheduler.claimed.setdefault((self.namespace, name), set())
            entries = list(self.slots.get((self.namespace, name), []))
            limit = self.rt.settings.max_executions_per_sandbox
            if not may_start(self.name, self.created, entries, claimed, limit):
                free = False
            else:
                claimed.add(self.name)
                free = True
        if not free:
            await self.wait(
                build.REASON_CONCURRENCY_LIMIT,
                f"{limit} executions already run in sandbox {name}; waiting in creation order",
            )
            return
        if self.deleting() or self.cancel_requested():
            self.scheduler.release(self.namespace, name, self.name)
            return
        # The intent is recorded before the command is sent: see the module docstring.
        await self.write(
            {
                "phase": ExecutionPhase.RUNNING.value,
                "reason": build.REASON_STARTED,
                "message": None,
                "podUID": pod_uid,
                "startTime": iso(now_utc()),
            }
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
                await self.rt.agents.write_file(
                    endpoint, token, file.path, file.content.encode(), file.mode
                )
            record = await self.rt.agents.start(
                endpoint, token, build.agent_request(self.spec, self.uid, env)
            )
        except AgentError as exc:
            if exc.refused:
                await self.fail(build.REASON_START_FAILED, str(exc))
            else:
                self.logger.warning("agent unavailable, will try again: %s", exc)
                await self.backoff()
            return
        self.attempt = 0
        await self.write({"agentExecutionId": record["id"]})

    async def backoff(self) -> None:
        metrics.AGENT_ERRORS.inc()
        await self.pause(AGENT_RETRY_SECONDS[min(self.attempt, len(AGENT_RETRY_SECONDS) - 1)])
        self.attempt += 1

    async def follow(self) -> None:
        """Started: wait for the agent to report the end (or cancel it)."""
        name = self.sandbox_name()
        sandbox = self.sandbox()
        if sandbox is None or sandbox["metadata"].get("deletionTimestamp"):
            await self.fail(
                build.REASON_SANDBOX_DELETED, f"sandbox {name} was deleted while the command ran"
            )
            return
        sb_status = sandbox.get("status") or {}
        if sb_status.get("podUID") != self.status["podUID"]:
            await self.fail(
                build.REASON_LOST,
                f"the pod of sandbox {name} ended or was replaced while the command ran; "
                "the outcome is unknown and the command is not run again",
            )
            return
        if sb_status.get("phase") == "Failed":
            await self.fail(
                build.REASON_SANDBOX_FAILED, f"sandbox {name} failed while the command ran"
            )
            return
        endpoint = sb_status.get("agentEndpoint") or self.endpoint
        token = await self.token(sandbox)
        if not endpoint or not token:
            await self.pause(WAIT_POLL_SECONDS)  # pod restarting: its status will say more
            return
        try:
            record = await self.observe(endpoint, token)
        except AgentError as exc:
            if exc.status == 404 and self.status.get("agentExecutionId"):
                await self.fail(
                    build.REASON_LOST,
                    "the sandbox agent no longer knows this execution; the outcome is unknown",
                )
            elif exc.refused:
                await self.fail(build.REASON_START_FAILED, str(exc))
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
                build.REASON_SANDBOX_DELETED,
                f"sandbox {name} was deleted while the command ran ({outcome.message})",
            )
        await self.finish(outcome, record)

    async def observe(self, endpoint: str, token: str) -> JSON | None:
        """The agent's record after one wait (None: woken or not yet started)."""
        agents = self.rt.agents
        execution_id = self.status.get("agentExecutionId")
        if not execution_id:
            found = await agents.find(endpoint, token, self.uid)
            if found is None:
                env = await self.env()
                if isinstance(env, tuple):
                    await self.fail(*env)
                    return None
                await self.send(endpoint, env)
                return None
            await self.write({"agentExecutionId": found["id"]})
            execution_id = found["id"]
        if self.cancel_requested():
            grace = self.rt.settings.execution_cancel_grace_seconds
            return await agents.cancel(endpoint, token, execution_id, grace)
        poll = self.rt.settings.execution_poll_seconds
        return await self.race(agents.execution(endpoint, token, execution_id, wait_seconds=poll))

    async def after(self) -> None:
        """Finished: remove a one-shot sandbox, then the Execution after its TTL."""
        if self.status.get("oneShot"):
            name = self.sandbox_name()
            path = resource_path(API_VERSION, "sandboxes", self.namespace, name)
            await self.rt.kube.delete(path)
        ttl = (self.body.get("spec") or {}).get("ttlSecondsAfterFinished")
        if ttl is None or not self.status.get("completionTime"):
            return
        finished = parse_time(self.status["completionTime"])
        left = ttl - (now_utc() - finished).total_seconds()
        if left > 0 and await self.stopped.wait(left):
            return
        meta = self.body["metadata"]
        await self.rt.kube.delete(
            resource_path(API_VERSION, "executions", self.namespace, self.name), uid=meta["uid"]
        )


def _why_not_ready(sandbox_status: JSON) -> str:
    ready = conditions.find(sandbox_status, "Ready") or {}
    return str(ready.get("message") or ready.get("reason") or "no detail")


async def deleted(
    rt: Runtime, scheduler: Scheduler, body: JSON, sandboxes: SandboxIndex, logger: kopf.Logger
) -> None:
    """Finalizer: kill the process group of a running command, remove a one-shot sandbox."""
    meta, status = body["metadata"], body.get("status") or {}
    scheduler.forget(meta["namespace"], meta["name"])
    sandbox_name = sandbox_of(body)
    sandbox = next(iter(sandboxes.get((meta["namespace"], sandbox_name or ""), [])), None)
    if not build.terminal(status) and status.get("podUID") and sandbox is not None:
        sb_status = sandbox.get("status") or {}
        endpoint = sb_status.get("agentEndpoint")
        if endpoint and sb_status.get("podUID") == status["podUID"]:
            token = await agent_token(rt, sandbox)
            if token:
                await _cancel(
                    rt, endpoint, token, meta["uid"], status.get("agentExecutionId"), logger
                )
    if sandbox_name and status.get("oneShot"):
        await rt.kube.delete(
            resource_path(API_VERSION, "sandboxes", meta["namespace"], sandbox_name)
        )
    if sandbox_name:
        scheduler.release(meta["namespace"], sandbox_name, meta["name"])


async def _cancel(
    rt: Runtime, endpoint: str, token: str, uid: str, execution_id: str | None, logger: kopf.Logger
) -> None:
    try:
        if not execution_id:
            found = await rt.agents.find(endpoint, token, uid)
            execution_id = found["id"] if found else None
        if execution_id:
            await rt.agents.cancel(
                endpoint, token, execution_id, rt.settings.execution_cancel_grace_seconds
            )
            logger.info("cancelled agent execution %s", execution_id)
    except AgentError as exc:
        if exc.status == 404:
            return
        raise kopf.TemporaryError(f"could not cancel the command: {exc}", delay=2) from exc
