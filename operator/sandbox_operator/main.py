"""Kopf registration: wires decorators to the per-kind handler modules. Thin.

Run with `kopf run -m sandbox_operator --all-namespaces` (or `--namespace X`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import kopf
from prometheus_client import start_http_server

from sandbox_operator import config, metrics
from sandbox_operator.agent_client import AgentClient
from sandbox_operator.api.common import GROUP
from sandbox_operator.builders.sandbox import LABEL_MANAGED_BY, LABEL_SANDBOX, MANAGED_BY
from sandbox_operator.handlers import execution, sandbox
from sandbox_operator.handlers import snapshot as snapshots
from sandbox_operator.kube import Kube

# Read at import: the timer interval is fixed when handlers are registered.
SETTINGS = config.load()
SANDBOX = (GROUP, "sandboxes")
EXECUTION = (GROUP, "executions")
SNAPSHOT = (GROUP, "snapshots")
OWN_PODS = {LABEL_MANAGED_BY: MANAGED_BY}


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    # Kopf's bookkeeping under the project's own prefix, never kopf.zalando.org.
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Watch only our own pods, filtered by the API server, not in this process.
    settings.watching.label_selectors["", "v1", "pods"] = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
    settings.execution.max_workers = SETTINGS.max_workers
    # Handler chatter stays in logs; Events are for what users should see.
    settings.posting.level = logging.WARNING
    settings.networking.connect_timeout = 10
    memo.runtime = sandbox.Runtime(
        settings=SETTINGS,
        kube=Kube.from_environment(),
        agents=AgentClient(timeout=SETTINGS.agent_timeout_seconds),
    )
    memo.scheduler = execution.Scheduler()
    if SETTINGS.metrics_port:
        start_http_server(SETTINGS.metrics_port)


@kopf.on.cleanup()
async def close(memo: Any, **_: Any) -> None:
    runtime: sandbox.Runtime = memo.runtime
    await runtime.kube.close()
    await runtime.agents.close()


@asynccontextmanager
async def _measured(kind: str, trigger: str) -> AsyncIterator[None]:
    started = time.perf_counter()
    result = "error"
    try:
        yield
        result = "ok"
    except kopf.TemporaryError:
        result = "retry"
        raise
    finally:
        metrics.RECONCILES.labels(kind, trigger, result).inc()
        metrics.RECONCILE_SECONDS.labels(kind, trigger).observe(time.perf_counter() - started)


def _runtime(memo: Any) -> sandbox.Runtime:
    runtime: sandbox.Runtime = memo.runtime
    return runtime


@kopf.on.create(*SANDBOX)
@kopf.on.update(*SANDBOX)
@kopf.on.resume(*SANDBOX)
async def sandbox_changed(
    body: kopf.Body, memo: Any, logger: kopf.Logger, reason: str, **_: Any
) -> None:
    async with _measured("Sandbox", str(reason)):
        if reason == "create":
            # Nothing exists yet: create straight away instead of asking first.
            await sandbox.reconcile(
                _runtime(memo),
                dict(body),
                logger,
                children=sandbox.Children.ENSURE,
                pod=None,
                pod_known=True,
            )
        else:
            children = sandbox.Children.CONVERGE if reason == "update" else sandbox.Children.ENSURE
            await sandbox.reconcile(_runtime(memo), dict(body), logger, children=children)


# The change handlers just reconciled a new object: the first tick can wait a full interval.
@kopf.timer(
    *SANDBOX,
    interval=SETTINGS.reconcile_interval_seconds,
    initial_delay=SETTINGS.reconcile_interval_seconds,
)
async def sandbox_tick(body: kopf.Body, memo: Any, logger: kopf.Logger, **_: Any) -> None:
    if body["metadata"].get("deletionTimestamp"):
        return
    async with _measured("Sandbox", "timer"):
        # A bad spec was already reported in status by the change handler.
        with suppress(kopf.PermanentError):
            await sandbox.reconcile(
                _runtime(memo), dict(body), logger, children=sandbox.Children.POD
            )


@kopf.on.delete(*SANDBOX)
async def sandbox_deleted(body: kopf.Body, memo: Any, logger: kopf.Logger, **_: Any) -> None:
    async with _measured("Sandbox", "delete"):
        await sandbox.teardown(_runtime(memo), dict(body), logger)


@kopf.index(*SANDBOX)
def sandbox_bodies(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    """Sandboxes by (namespace, name), so pod events find their owner without a GET.

    managedFields are dropped: they are most of a body's size and never read."""
    meta = {k: v for k, v in body["metadata"].items() if k != "managedFields"}
    return {(namespace, name): {**dict(body), "metadata": meta}}


@kopf.on.event("", "v1", "pods", labels=OWN_PODS)
async def pod_event(
    type: str,
    body: kopf.Body,
    memo: Any,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    """A sandbox pod changed: refresh its Sandbox's status, recreate it if it ended."""
    sandbox_bodies: kopf.Index[tuple[str, str], dict[str, Any]] = kwargs["sandbox_bodies"]
    meta = body["metadata"]
    name = (meta.get("labels") or {}).get(LABEL_SANDBOX)
    if not name:
        return
    owner = next(iter(sandbox_bodies.get((meta["namespace"], name), [])), None)
    if owner is None or owner["metadata"].get("deletionTimestamp"):
        return
    pod = None if type == "DELETED" else dict(body)
    async with _measured("Sandbox", "pod-event"):
        with suppress(kopf.PermanentError):
            await sandbox.reconcile(
                _runtime(memo),
                owner,
                logger,
                children=sandbox.Children.POD,
                pod=pod,
                pod_known=True,
            )


@kopf.index(*EXECUTION)
def execution_slots(namespace: str | None, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    """Executions by (namespace, sandbox): the per-sandbox queue, read without a GET."""
    return {(namespace, execution.sandbox_of(dict(body))): execution.slot_entry(dict(body))}


# One task per Execution follows it from Queued to its end. Deleting it stops
# the task at once; the deletion handler below then cancels what still runs.
@kopf.daemon(*EXECUTION, cancellation_timeout=1.0)
async def execution_daemon(
    body: kopf.Body, memo: Any, logger: kopf.Logger, stopped: kopf.DaemonStopped, **kwargs: Any
) -> None:
    await execution.Run(
        _runtime(memo),
        memo.scheduler,
        body,
        kwargs["sandbox_bodies"],
        kwargs["execution_slots"],
        stopped,
        logger,
    ).drive()


@kopf.on.delete(*EXECUTION, retries=10, errors=kopf.ErrorsMode.IGNORED)
async def execution_deleted(body: kopf.Body, memo: Any, logger: kopf.Logger, **kwargs: Any) -> None:
    async with _measured("Execution", "delete"):
        await execution.deleted(
            _runtime(memo), memo.scheduler, dict(body), kwargs["sandbox_bodies"], logger
        )


@kopf.on.create(*SNAPSHOT)
@kopf.on.resume(*SNAPSHOT)
async def snapshot_changed(
    body: kopf.Body, memo: Any, logger: kopf.Logger, reason: str, retry: int, **_: Any
) -> None:
    async with _measured("Snapshot", str(reason)):
        await snapshots.take(_runtime(memo), dict(body), logger, retry=retry)


# Only mirrors the VolumeSnapshot of a taken Snapshot (deleted or repaired behind our back).
@kopf.timer(
    *SNAPSHOT,
    interval=SETTINGS.reconcile_interval_seconds * 2,
    initial_delay=SETTINGS.reconcile_interval_seconds * 2,
)
async def snapshot_tick(body: kopf.Body, memo: Any, logger: kopf.Logger, **_: Any) -> None:
    if body["metadata"].get("deletionTimestamp"):
        return
    async with _measured("Snapshot", "timer"):
        await snapshots.observe(_runtime(memo), dict(body), logger)


@kopf.on.delete(*SNAPSHOT)
async def snapshot_deleted(body: kopf.Body, memo: Any, logger: kopf.Logger, **_: Any) -> None:
    async with _measured("Snapshot", "delete"):
        await snapshots.release(_runtime(memo), dict(body), logger)
