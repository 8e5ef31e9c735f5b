"""High availability: several replicas, one active, through Kopf peering.

Each replica writes a keep-alive with its priority into the peering object
(ClusterKopfPeering, or a KopfPeering per watched namespace); a replica that
sees a live peer of higher priority pauses: it closes its watches, stops its
daemons and timers, and the Sandboxes' clock starts no pass (follow_pauses).
Kopf pauses every peer of *equal* priority, so no two replicas may share one.

What the operator keeps in memory (the Execution scheduler's held slots and
wake-ups, the per-namespace quota admission lock, caches) is used by the
active replica alone: a standby's watches are closed and it runs no handler,
daemon, timer or clock pass. On takeover Kopf lists every object again, so the
indexes and the resume handlers rebuild that state from the API server; a
replica that was active before its pause goes on with the times its clock
kept, for the Sandboxes the listing after the pause shows (timetable.py),
each pass reading its Sandbox from the index anew, and forgets the objects
deleted during the pause, of which Kopf sends no event (sweep.py). Gauges of a
replica that was paused keep their last values: only the active one's are
current.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from datetime import UTC, datetime
from typing import Any

import kopf
from kopf._cogs.aiokits.aiotoggles import ToggleSet
from kopf._core.engines import daemons as kopf_daemons

from sandbox_operator.kube import Kube
from sandbox_operator.resources import CLUSTER_PEERINGS, PEERINGS
from sandbox_operator.timetable import Pause

# How long a replica waits, its keep-alive written, before Kopf first reads its
# peers: replicas started together (a new release's) each see the others'
# keep-alives at that first read. See announce().
SETTLE_SECONDS = 2.0
# Kopf's identity of a replica: the pod's name, when the chart gives it.
IDENTITY_ENV = "POD_ID"
# Start times are taken to the millisecond; the nonce only breaks ties between
# replicas started within the same millisecond.
_NONCE_RANGE = 1000


def priority(started_ms: int, nonce: int) -> int:
    """A replica's priority: the earlier it started, the higher.

    A replica that restarts (or a new one of a rolling update) therefore never
    outranks the one already working, which would otherwise be paused in the
    middle of its work for nothing; the oldest live replica is the active one,
    and when it dies the next oldest takes over. Distinct by the nonce, since
    peers of equal priority pause each other."""
    return -(started_ms * _NONCE_RANGE + nonce % _NONCE_RANGE)


def configure(settings: kopf.OperatorSettings, lifetime_seconds: int) -> None:
    """Priority and lifetime for peering. Run replicas with `--peering NAME`: that
    makes the peering mandatory, so a replica starts paused until it has seen its
    peers (without it Kopf acts before it knows them)."""
    if settings.peering.standalone:
        return
    settings.peering.priority = priority(time.time_ns() // 1_000_000, secrets.randbelow(10**9))
    # A SIGKILLed replica leaves its last keep-alive behind: the others wait for
    # it to expire (Kopf refreshes it every 1-5 s at this size, so that it never
    # lapses while the replica lives). Expiry compares the writer's clock with
    # the reader's: node clocks must agree to well within this lifetime.
    settings.peering.lifetime = lifetime_seconds


async def ensure_objects(
    kube: Kube, settings: kopf.OperatorSettings, namespaces: list[str]
) -> None:
    """The peering objects, made by the operator rather than the chart: on a
    `helm upgrade` from a release without the peering CRDs helm could not map a
    chart object of theirs (the CRDs arrive with a hook). Kopf writes only
    their status and never creates one: without it a replica would stay paused."""
    if settings.peering.standalone or not settings.peering.mandatory:
        return  # `--standalone`, or Kopf's guess without `--peering`: nothing to make
    name = settings.peering.name
    if settings.peering.clusterwide:
        body = {"apiVersion": CLUSTER_PEERINGS.api_version, "kind": "ClusterKopfPeering"}
        await kube.create(CLUSTER_PEERINGS.path(), {**body, "metadata": {"name": name}})
        return
    for namespace in namespaces:
        meta = {"name": name, "namespace": namespace}
        kind = {"apiVersion": PEERINGS.api_version, "kind": "KopfPeering"}
        await kube.create(PEERINGS.path(namespace), {**kind, "metadata": meta})


async def announce(kube: Kube, settings: kopf.OperatorSettings, namespaces: list[str]) -> None:
    """Write this replica's keep-alive before Kopf starts, then wait SETTLE_SECONDS.

    Kopf writes the first keep-alive and reads the peers at the same moment,
    after the startup handlers. Two replicas started together could each read
    the peering object before the other had written to it, and both act for a
    moment: both handled the same new Sandbox, and the one that stayed active
    was left waiting for an event that never came (a CI run's e2e test, the
    audit log showing the two replicas' patches 0.4 s apart). Written here,
    and waited for, every replica of a start is in the object when any of them
    first reads it; the one that started first stays active, the others pause
    before they handle anything.

    Only with the identity Kopf itself uses (the pod's name, from the chart's
    POD_ID): a record under any other name would be a live peer of this
    replica's own priority, which pauses every replica."""
    identity = os.environ.get(IDENTITY_ENV)
    if settings.peering.standalone or not settings.peering.mandatory or not identity:
        return
    record = {
        "priority": settings.peering.priority,
        "lifetime": settings.peering.lifetime,
        "lastseen": datetime.now(UTC).isoformat(),
    }
    name = settings.peering.name
    paths = (
        [CLUSTER_PEERINGS.path(name=name)]
        if settings.peering.clusterwide
        else [PEERINGS.path(namespace, name) for namespace in namespaces]
    )
    for path in paths:
        await kube.patch(path, {"status": {identity: record}})
    await asyncio.sleep(SETTLE_SECONDS)


# Kopf's set of pause toggles (one per peering object with a conflict), as
# Kopf handed it to its daemon killer at start (see follow_pauses).
_PAUSES: list[Pause] = []


def follow_pauses() -> None:
    """Have Kopf show this module whether the operator is paused.

    The Sandboxes' clock (timetable.py) is the operator's own task, not a Kopf
    daemon, so Kopf does not stop it on a pause; it must stop itself. Kopf
    keeps the pause state in one toggle set that it gives only to its own
    tasks, the first of them its daemon killer, made before any startup
    handler runs: this wraps that function to keep the set. Call it before
    Kopf starts (at the import of the handlers' module). A Kopf that no longer
    makes its daemon killer so leaves the set unknown: `pause()` then refuses
    to run a clock beside peering (tests/unit/test_peering.py fails first)."""
    original = kopf_daemons.daemon_killer
    if getattr(original, "keeps_pauses", False):
        return

    def daemon_killer(*, operator_paused: ToggleSet, **kwargs: Any) -> Any:
        _PAUSES[:] = [operator_paused]
        return original(operator_paused=operator_paused, **kwargs)

    daemon_killer.keeps_pauses = True  # type: ignore[attr-defined]
    kopf_daemons.daemon_killer = daemon_killer


def pause(settings: kopf.OperatorSettings) -> Pause | None:
    """Whether the operator is paused, for a task of its own that must pause with it
    (None: `--standalone`, never paused)."""
    if _PAUSES:
        return _PAUSES[0]
    if settings.peering.standalone:
        return None
    raise RuntimeError(
        "Kopf's pause state is unknown (peering.follow_pauses did not see Kopf start its"
        " daemon killer): this Kopf version is not supported with peering; run with"
        " --standalone or a supported Kopf"
    )
