"""Kubernetes Events, aggregated as the kubelet's event correlator does.

The same object, type, reason and message again raises the `count` (and
`lastTimestamp`) of the Event already posted instead of adding one more: a
Sandbox whose pod the API server refuses every retry shows one Event whose
count grows, not a thousand. The Event's name is derived from what it says and
from this process (a restarted operator starts new counts, as a restarted
kubelet does), so the count is known here and a repeat is one PATCH.
Posting never fails a handler: a refused or lost Event is logged and dropped.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any

from sandbox_operator.clock import iso, now_utc
from sandbox_operator.kube import Api, KubeError
from sandbox_operator.resources import EVENTS

JSON = dict[str, Any]
log = logging.getLogger(__name__)

COMPONENT = "sandbox-operator"
# What kubectl and Kopf keep of a message; longer ones are cut in the middle.
MAX_MESSAGE = 1024
# Events this process remembers the count of (least recently posted go first).
REMEMBERED = 10_000
# Where cluster-scoped objects' Events go.
DEFAULT_NAMESPACE = "default"


def _cut(message: str) -> str:
    if len(message) <= MAX_MESSAGE:
        return message
    half = (MAX_MESSAGE - 3) // 2
    return f"{message[:half]}...{message[-(MAX_MESSAGE - 3 - half) :]}"


def event_name(obj_name: str, key: tuple[str, ...]) -> str:
    """`<object>.<digest>`: a DNS subdomain of <= 253 characters."""
    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]
    return f"{obj_name[: 253 - 17]}.{digest}"


def build_event(
    body: JSON,
    kind: str,
    reason: str,
    message: str,
    now: str,
    instance: str | None,
    once_key: str = "",
) -> JSON:
    """A new core/v1 Event about `body` (count 1): named for this process
    (`instance`) and what it says, or (None) for the object, reason and key."""
    meta = body["metadata"]
    namespace = meta.get("namespace") or DEFAULT_NAMESPACE
    event_type = "Normal" if kind == "info" else "Warning"
    message = _cut(message)
    # Without an instance: one Event per object, reason and key, whoever posts it.
    key = (
        (meta.get("uid", ""), event_type, reason, once_key)
        if instance is None
        else (instance, meta.get("uid", ""), event_type, reason, message)
    )
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": event_name(meta["name"], key), "namespace": namespace},
        "involvedObject": {
            "apiVersion": body.get("apiVersion", ""),
            "kind": body.get("kind", ""),
            "name": meta["name"],
            "namespace": meta.get("namespace", ""),
            "uid": meta.get("uid", ""),
        },
        "type": event_type,
        "reason": reason,
        "message": message,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


class EventRecorder:
    """Posts Events in the background (handlers do not wait for them)."""

    def __init__(self, kube: Api) -> None:
        self.kube = kube
        self.instance = secrets.token_hex(8)
        # Event path -> the count last written.
        self.counts: OrderedDict[str, int] = OrderedDict()
        # One post at a time: two posts of one Event must not both create it.
        self.lock = asyncio.Lock()
        self.tasks: set[asyncio.Task[None]] = set()

    def post(self, body: JSON, kind: str, reason: str, message: str) -> None:
        """Schedule an Event (`kind` "info" or "warn") about `body`."""
        event = build_event(body, kind, reason, message, iso(now_utc()), self.instance)
        self._spawn(self.record(event))

    def post_once(self, body: JSON, kind: str, reason: str, message: str, key: str = "") -> None:
        """Schedule an Event that is posted once per object, reason and `key`, by
        this process or any other: for what happens once (a cold start), announced
        again after a restart in case the first post was lost."""
        event = build_event(body, kind, reason, message, iso(now_utc()), None, key)
        meta = event["metadata"]
        path = EVENTS.path(meta["namespace"], meta["name"])
        if path in self.counts:
            return
        self.counts[path] = 1
        self._spawn(self._create_once(event))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` in the background, held until done (see drain)."""
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _create_once(self, event: JSON) -> None:
        try:
            await self.kube.create(EVENTS.path(event["metadata"]["namespace"]), event)
        except KubeError as exc:  # 409 is not an error: create() answers None
            log.warning("event %s not posted: %s", event["reason"], exc)

    async def record(self, event: JSON) -> None:
        meta = event["metadata"]
        path = EVENTS.path(meta["namespace"], meta["name"])
        try:
            async with self.lock:
                count = await self._count_on(path, event)
            self.counts[path] = count
            self.counts.move_to_end(path)
            while len(self.counts) > REMEMBERED:
                self.counts.popitem(last=False)
        except KubeError as exc:
            log.warning("event %s/%s not posted: %s", event["reason"], meta["name"], exc)

    async def _count_on(self, path: str, event: JSON) -> int:
        """Raise the count of the Event at `path`, or create it; the count written."""
        collection = EVENTS.path(event["metadata"]["namespace"])
        known = self.counts.get(path)
        if known is None:
            await self.kube.create(collection, event)
            return 1
        count = known + 1
        bump = {"count": count, "lastTimestamp": event["lastTimestamp"]}
        if await self.kube.patch(path, bump) is None:
            # Gone meanwhile (Events expire): a new one.
            await self.kube.create(collection, event)
            return 1
        return count

    async def drain(self) -> None:
        """Wait for the Events in flight (at shutdown)."""
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
