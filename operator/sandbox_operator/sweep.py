"""After a peering pause: forget the objects that were deleted meanwhile.

A paused replica's watches are closed (peering.py), and when the pause ends
Kopf lists every object again; it sends nothing for an object deleted in
between (finalized by the replica that was active, or a child the garbage
collector took), and keeps such an object's values in every index until the
process restarts. The replica then acted on them: a Sandbox finalized by
another replica still counted against its namespace's SandboxQuota, a pod
deleted meanwhile still looked alive, an Execution finished elsewhere still
held its slot.

So when a pause begins, this notes which objects the indexes hold (Kopf's
own key of each: namespace, name, UID), and when it ends lists each kind of
object once (metadata only) and drops from every index of that kind the
noted objects the listing lacks, and this process's state of them (`Gone`).
Only noted objects: one created after the pause ended is in an index without
being in a listing made before it was created, and is not gone. Nothing is
dropped by guess or on a timeout: a listing that fails is tried again (the
noted objects wait; a second pause adds to them).

Kopf keeps the keys private: `held` and `_drop` are the two places that read
and change them (tests/unit/test_sweep.py runs them on Kopf's own Index).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, cast

import aiohttp
from kopf._core.engines import indexing as kopf_indexing
from kopf._core.engines.indexing import Index

from sandbox_operator import metrics
from sandbox_operator.indexes import SOURCES, Indexes, Source
from sandbox_operator.kube import Kube, KubeError
from sandbox_operator.resources import Resource
from sandbox_operator.timetable import Pause

# Kopf's key of an object in its indexes (the namespace None for a cluster-scoped one).
Key = tuple[str | None, str, str]
# What the rest of the operator forgets of an object that is gone.
Gone = Callable[[Resource, Key], None]

logger = logging.getLogger(__name__)


def held(index: Mapping[Any, Any]) -> set[Key]:
    """The objects `index` holds values of (Kopf's reverse map of the index)."""
    return set(_kopf_index(index).__dict__["_Index__reverse"])


def _drop(index: Mapping[Any, Any], key: Key) -> None:
    _kopf_index(index)._discard(cast(kopf_indexing.Key, key))


def _kopf_index(index: Mapping[Any, Any]) -> Index[Any, Any]:
    if not isinstance(index, Index) or "_Index__reverse" not in index.__dict__:
        raise TypeError(f"not an index of a supported Kopf version: {type(index).__name__}")
    return index


class Sweep:
    """The objects noted at a pause's start, and the listing that settles them."""

    def __init__(
        self,
        kube: Kube,
        indexes: Indexes,
        namespaces: list[str],
        gone: Gone,
        settle_seconds: float = 2.0,
        retry_seconds: float = 5.0,
    ) -> None:
        self._kube = kube
        self._indexes = indexes
        # Where the operator watches: these namespaces, or all of them (empty).
        self._namespaces = namespaces
        self._gone = gone
        # How long after a pause the listing waits: events Kopf received
        # before the pause are handled by then, and cannot index an object
        # again after it was dropped.
        self.settle_seconds = settle_seconds
        self.retry_seconds = retry_seconds
        self._noted: dict[Source, set[Key]] = {}

    def note(self) -> None:
        """What every index holds now, kind by kind: the objects that may be
        deleted unseen while the watches are closed."""
        for field, source in SOURCES.items():
            keys = held(getattr(self._indexes, field))
            if keys:  # a standby's indexes are empty: nothing to list after its pause
                self._noted.setdefault(source, set()).update(keys)

    async def sweep(self) -> int:
        """List each noted kind and forget its noted objects the listing lacks;
        how many were forgotten. A kind whose listing fails stays noted."""
        forgotten = 0
        for source, noted in list(self._noted.items()):
            missing = noted - await self._listed(source)
            for key in missing:
                for field, of in SOURCES.items():
                    if of == source:
                        _drop(getattr(self._indexes, field), key)
                self._gone(source.resource, key)
            if missing:
                metrics.FORGOTTEN_AFTER_PAUSE.labels(source.resource.plural).inc(len(missing))
                names = ", ".join(sorted(f"{ns}/{name}" for ns, name, _ in missing)[:10])
                logger.info(
                    "%d %s deleted while this replica was paused, forgotten: %s%s",
                    len(missing),
                    source.resource.plural,
                    names,
                    " ..." if len(missing) > 10 else "",
                )
            forgotten += len(missing)
            del self._noted[source]
        return forgotten

    async def _listed(self, source: Source) -> set[Key]:
        params = {"labelSelector": source.selector} if source.selector else None
        found: set[Key] = set()
        everywhere: list[str | None] = [None]
        for namespace in self._namespaces or everywhere:
            path = source.resource.path(namespace)
            for meta in await self._kube.list_metadata(path, params):
                found.add((meta.get("namespace"), meta["name"], meta["uid"]))
        return found

    async def run(self, pause: Pause) -> None:
        """Note at each pause's start, sweep after its end; until cancelled."""
        while True:
            await pause.wait_for(True)
            self.note()
            await pause.wait_for(False)
            await asyncio.sleep(self.settle_seconds)
            while self._noted and not pause.is_on():
                try:
                    await self.sweep()
                    continue
                except (KubeError, aiohttp.ClientError, TimeoutError) as exc:
                    logger.warning("listing after a pause failed (%s): trying again", exc)
                except Exception:
                    logger.exception("forgetting what was deleted during a pause failed")
                await asyncio.sleep(self.retry_seconds)
