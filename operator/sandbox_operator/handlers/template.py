"""SandboxTemplate builds: the setup steps run in a build Sandbox, then its
workspace becomes the template's base snapshot.

Level-based: every pass looks at what exists for the current setup digest
(the Snapshot, the build Sandbox, the step Executions, all named after the
digest) and takes the next step, so an operator restart resumes a build where
it stood. A build that failed stays failed until the setup changes. A pass
ends where it finds its outcome (Settled); the status is written once, there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import ValidationError

from sandbox_operator import metrics
from sandbox_operator.api.common import readable
from sandbox_operator.api.execution import ExecutionPhase
from sandbox_operator.api.sandbox import SandboxPhase
from sandbox_operator.api.snapshot import SnapshotPhase
from sandbox_operator.api.template import (
    SandboxTemplateSpec,
    SandboxTemplateStatus,
    TemplateCondition,
    TemplateReason,
)
from sandbox_operator.builders import template as build
from sandbox_operator.builders.conditions import FALSE, TRUE, Cond, find, merge
from sandbox_operator.builders.sandbox import settings_problem
from sandbox_operator.clock import iso, now_utc, parse_time
from sandbox_operator.context import OperatorContext
from sandbox_operator.kube import MERGE_PATCH, status_patch
from sandbox_operator.resources import (
    CLUSTER_SANDBOX_TEMPLATES,
    EXECUTIONS,
    LABEL_TEMPLATE,
    SANDBOX_TEMPLATES,
    SANDBOXES,
    SNAPSHOTS,
)

JSON = dict[str, Any]
R = TemplateReason
READY = TemplateCondition.READY
# How soon a build in progress is looked at again.
BUILD_POLL_SECONDS = 2.0
_FAILED = {R.SETUP_FAILED, R.SNAPSHOT_FAILED}
_RUNNING = {None, ExecutionPhase.QUEUED.value, ExecutionPhase.RUNNING.value}


@dataclass(frozen=True)
class Outcome:
    """Where a pass leaves a template: its Ready condition and status fields (by
    model field name), and how the pass ends."""

    cond: Cond
    fields: JSON = field(default_factory=dict)
    # A build under way: looked at again in this many seconds.
    retry: float | None = None
    # Failed until the spec changes.
    permanent: bool = False
    # A build Sandbox to delete once the status says why (a failed build: a
    # restart between the two finds the failure recorded, not a build to start).
    remove: str | None = None


class Settled(Exception):
    """A pass's end, raised where it is found: `Build.run` writes its status
    (once) and ends the pass as the outcome says."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.cond.message)
        self.outcome = outcome


def building(message: str, **fields: Any) -> Settled:
    """A build under way."""
    return Settled(Outcome(Cond(READY, FALSE, R.BUILDING, message), fields, BUILD_POLL_SECONDS))


def failed(digest: str, names: dict[str, str], message: str, **fields: Any) -> Settled:
    """A setup that failed: final until the setup changes."""
    metrics.TEMPLATE_BUILDS.labels("failed").inc()
    fields = {"setup_hash": digest, "build_sandbox": None, **fields}
    cond = Cond(READY, FALSE, R.SETUP_FAILED, message)
    return Settled(Outcome(cond, fields, permanent=True, remove=names["sandbox"]))


def template_status(
    old: SandboxTemplateStatus, outcome: Outcome, generation: int, now: str
) -> SandboxTemplateStatus:
    """The status `outcome` gives a template whose status was `old`. Pure."""
    return old.evolve(
        observed_generation=generation,
        conditions=merge(old.conditions, {READY: outcome.cond}, generation, now),
        **outcome.fields,
    )


class Build:
    """One pass over one template."""

    def __init__(self, ctx: OperatorContext, body: JSON, logger: kopf.Logger) -> None:
        self.ctx = ctx
        self.body = body
        self.logger = logger
        meta = body["metadata"]
        # A ClusterSandboxTemplate has no namespace, and no setup to build.
        self.namespace: str = meta.get("namespace") or ""
        self.name: str = meta["name"]
        self.resource = SANDBOX_TEMPLATES if self.namespace else CLUSTER_SANDBOX_TEMPLATES
        self.old = SandboxTemplateStatus.model_validate(body.get("status") or {})

    async def write(self, outcome: Outcome) -> None:
        """The status `outcome` gives, patched only when it changed; an Event when
        Ready's reason changes to a final one."""
        cond = outcome.cond
        generation = self.body["metadata"].get("generation", 0)
        status = template_status(self.old, outcome, generation, iso(now_utc()))
        before = find(self.old.conditions, READY)
        patch = status_patch(self.body.get("status") or {}, status.to_wire())
        if patch is not None:
            await self.ctx.kube.patch(
                self.resource.path(self.namespace, self.name, "status"), patch, MERGE_PATCH
            )
        self.body["status"], self.old = status.to_wire(), status
        self.ctx.template_statuses[self.body["metadata"]["uid"]] = self.body["status"]
        if before is None or before.reason != cond.reason:
            if cond.reason in _FAILED or cond.reason == R.INVALID_SPEC:
                self.ctx.event(self.body, "warn", reason=cond.reason, message=cond.message)
            elif cond.reason == R.READY:
                self.ctx.event(self.body, "info", reason="BaseReady", message=cond.message)

    async def run(self) -> None:
        """One pass: its status is written once, where it ended."""
        try:
            await self.converge()
            return  # nothing to write (a failed build stays as its status says)
        except Settled as settled:
            outcome = settled.outcome
        await self.write(outcome)
        if outcome.remove is not None:
            await self.remove_build_sandbox(outcome.remove)
        if outcome.permanent:
            raise kopf.PermanentError(outcome.cond.message)
        if outcome.retry is not None:
            raise kopf.TemporaryError(outcome.cond.message, delay=outcome.retry)

    async def converge(self) -> None:
        """Take the next step of the build: Settled with where the pass ends, or
        nothing when there is nothing to write."""
        try:
            spec = SandboxTemplateSpec.model_validate(self.body.get("spec") or {})
        except ValidationError as exc:
            invalid = Cond(READY, FALSE, R.INVALID_SPEC, readable(exc))
            raise Settled(Outcome(invalid, permanent=True)) from exc
        # What no Sandbox of this template could run here: said now, not by each
        # Sandbox (or pool member) that fails on it.
        problem = settings_problem(spec.sandbox, self.ctx.settings, at="spec.sandbox")
        if problem is not None:
            raise Settled(Outcome(Cond(READY, FALSE, R.INVALID_SPEC, problem), permanent=True))
        digest = build.setup_hash(spec)
        if digest is None:
            empty = "no setup steps: sandboxes start with an empty workspace"
            fields = {"setup_hash": None, "base_snapshot": None, "build_sandbox": None}
            raise Settled(Outcome(Cond(READY, TRUE, R.NO_SETUP, empty), fields))
        names = build.build_names(self.name, digest)
        ready = find(self.old.conditions, READY)
        if self.old.setup_hash == digest and ready is not None and ready.reason in _FAILED:
            await self.remove_build_sandbox(names["sandbox"])
            return
        await self.snapshot_settled(digest, names)
        sandbox = await self.ctx.kube.get(SANDBOXES.path(self.namespace, names["sandbox"]))
        if sandbox is None:
            await self.ctx.kube.create(
                SANDBOXES.path(self.namespace),
                build.build_sandbox(self.body, spec, names["sandbox"]),
            )
            metrics.TEMPLATE_BUILDS.labels("started").inc()
            starting = f"starting build sandbox {names['sandbox']}"
            raise building(starting, build_sandbox=names["sandbox"])
        log = await self.run_steps(spec, digest, names, sandbox)
        await self.ctx.kube.create(
            SNAPSHOTS.path(self.namespace),
            build.build_base_snapshot(self.body, names["sandbox"], names["snapshot"]),
        )
        raise building(f"taking base snapshot {names['snapshot']}", build_log=log)

    async def snapshot_settled(self, digest: str, names: dict[str, str]) -> None:
        """Settled once this digest's snapshot exists (ready, failed, or being
        taken); nothing while there is none."""
        snapshot = await self.ctx.kube.get(SNAPSHOTS.path(self.namespace, names["snapshot"]))
        if snapshot is None:
            return
        status = snapshot.get("status") or {}
        phase = status.get("phase")
        if phase == SnapshotPhase.READY:
            finished = self.old.base_snapshot != names["snapshot"]
            if finished:
                await self.observe_duration(names["sandbox"])
            await self.remove_build_sandbox(names["sandbox"])
            await self.prune(names["snapshot"], names["sandbox"])
            if finished:
                metrics.TEMPLATE_BUILDS.labels("succeeded").inc()
            done = Cond(READY, TRUE, R.READY, f"base snapshot {names['snapshot']} is ready")
            fields = {"setup_hash": digest, "base_snapshot": names["snapshot"]}
            raise Settled(Outcome(done, {**fields, "build_sandbox": None}))
        if phase == SnapshotPhase.FAILED:
            why = next(
                (c.get("message") for c in status.get("conditions") or [] if c["type"] == "Ready"),
                "",
            )
            metrics.TEMPLATE_BUILDS.labels("failed").inc()
            lost = f"base snapshot {names['snapshot']}: {why}"
            cond = Cond(READY, FALSE, R.SNAPSHOT_FAILED, lost)
            raise Settled(Outcome(cond, {"setup_hash": digest}, remove=names["sandbox"]))
        raise building(f"taking base snapshot {names['snapshot']}")

    async def run_steps(
        self, spec: SandboxTemplateSpec, digest: str, names: dict[str, str], sandbox: JSON
    ) -> str | None:
        """The build log once every step succeeded; Settled while they run, or when
        one failed."""
        sandbox_status = sandbox.get("status") or {}
        ready: JSON = next(
            (c for c in sandbox_status.get("conditions") or [] if c.get("type") == "Ready"), {}
        )
        if sandbox_status.get("phase") == SandboxPhase.FAILED:
            raise failed(
                digest,
                names,
                f"build sandbox {names['sandbox']} failed ({ready.get('reason')}):"
                f" {ready.get('message')}",
            )
        if ready.get("status") != TRUE:
            why = ready.get("message") or "starting"
            raise building(f"waiting for build sandbox {names['sandbox']}: {why}")
        executions: list[JSON | None] = []
        for index, step in enumerate(spec.setup):
            name = build.step_execution_name(names["sandbox"], index)
            execution = await self.ctx.kube.get(EXECUTIONS.path(self.namespace, name))
            executions.append(execution)
            where = f"step {step.name} ({index + 1}/{len(spec.setup)})"
            log = build.build_log(spec.setup, executions)
            if execution is None:
                await self.ctx.kube.create(
                    EXECUTIONS.path(self.namespace),
                    build.build_step(self.body, names["sandbox"], index, step),
                )
                raise building(f"{where} queued", build_log=log)
            status = execution.get("status") or {}
            phase: str | None = status.get("phase")
            if phase is None or phase in _RUNNING:
                raise building(f"{where} {(phase or 'queued').lower()}", build_log=log)
            if phase != ExecutionPhase.SUCCEEDED:
                code = status.get("exitCode")
                detail = f"exit code {code}" if code is not None else status.get("message")
                raise failed(
                    digest,
                    names,
                    f"{where} {phase.lower()} ({detail}); see status.buildLog",
                    build_log=log,
                )
        return build.build_log(spec.setup, executions)

    async def observe_duration(self, build_sandbox: str) -> None:
        """A finished build's duration, from its build Sandbox's creation (gone after a
        restart between its removal and the status write: not observed then)."""
        sandbox = await self.ctx.kube.get(SANDBOXES.path(self.namespace, build_sandbox))
        if sandbox is not None:
            started = parse_time(sandbox["metadata"]["creationTimestamp"])
            metrics.TEMPLATE_BUILD_SECONDS.observe((now_utc() - started).total_seconds())

    async def remove_build_sandbox(self, name: str) -> None:
        await self.ctx.kube.delete(SANDBOXES.path(self.namespace, name))

    async def prune(self, base: str, build_sandbox: str) -> None:
        """Base snapshots of older builds (all but the current and the previous one)
        and the step Executions of other builds."""
        selector = {"labelSelector": f"{LABEL_TEMPLATE}={self.name}"}
        for resource in (SNAPSHOTS, EXECUTIONS):
            listed = await self.ctx.kube.get(resource.path(self.namespace), params=selector)
            items = [i for i in (listed or {}).get("items") or [] if self._owned(i)]
            if resource is SNAPSHOTS:
                kept = build.bases_to_keep(base, items)
            else:
                names = (i["metadata"]["name"] for i in items)
                kept = {n for n in names if n.startswith(f"{build_sandbox}-step-")}
            for item in items:
                meta = item["metadata"]
                if meta["name"] not in kept:
                    await self.ctx.kube.delete(
                        resource.path(self.namespace, meta["name"]), uid=meta["uid"]
                    )

    def _owned(self, item: JSON) -> bool:
        uid = self.body["metadata"]["uid"]
        return any(o.get("uid") == uid for o in item["metadata"].get("ownerReferences") or [])


async def reconcile(ctx: OperatorContext, body: JSON, logger: kopf.Logger) -> None:
    meta = body["metadata"]
    async with ctx.lock(meta.get("namespace") or "", f"template:{meta['name']}"):
        # Build on the status this process last wrote: writes send the whole status,
        # so a pass from an older body would put back what a newer pass replaced
        # (a build log without its last steps).
        known = ctx.template_statuses.get(meta["uid"])
        await Build(ctx, body if known is None else {**body, "status": known}, logger).run()
