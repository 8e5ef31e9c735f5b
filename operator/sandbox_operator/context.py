"""The operator's process-wide context: settings and clients, made once at startup.

Every controller receives it; it holds no controller's logic, only what they
share: the API and agent clients, per-Sandbox locks and last-written status,
and the agent tokens read so far.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

import kopf

from sandbox_operator.agent_client import AgentClient, LimitCounters
from sandbox_operator.checkpointd import Checkpoints
from sandbox_operator.config import Settings
from sandbox_operator.errors import Backoffs
from sandbox_operator.identity import TOKEN_KEY, children_ref, names
from sandbox_operator.kube import Api
from sandbox_operator.resources import SECRETS
from sandbox_operator.timetable import Timetable

JSON = dict[str, Any]
Key = tuple[str, str]


@dataclass
class OperatorContext:
    settings: Settings
    kube: Api
    agents: AgentClient
    # One reconciliation per Sandbox at a time: create/update handlers, the timer
    # and pod events all converge the same object and must not interleave.
    locks: dict[Key, asyncio.Lock] = field(default_factory=dict)
    # One quota admission per namespace at a time: each counts what the ones
    # before it admitted.
    namespace_locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    # The status this process last wrote per Sandbox. The operator is the only
    # writer of status, so this is fresher than a body Kopf received earlier.
    statuses: dict[Key, JSON] = field(default_factory=dict)
    # The same for SandboxTemplates, by UID (a namesake created later starts
    # afresh): a timer's pass may hold a body older than what the last pass wrote.
    template_statuses: dict[str, JSON] = field(default_factory=dict)
    # Agent tokens by (namespace, sandbox UID): a sandbox's token never changes,
    # and a namesake created later has another UID.
    tokens: dict[Key, str] = field(default_factory=dict)
    # Volume binding mode by StorageClass name: classes are immutable in that field.
    binding_modes: dict[str, str] = field(default_factory=dict)
    # The spec env (as JSON) the agent of a Sandbox's current pod was given, by
    # (namespace, UID of the Sandbox that owns the pod: a claimer shares its
    # member's), with that pod's UID: a new pod is given it again, and forget()
    # drops it with the Sandbox (keyed by pod UID, it grew for ever).
    environments: dict[Key, tuple[str, str]] = field(default_factory=dict)
    # Pods this process created, by (namespace, Sandbox name), until the pod index
    # shows them: a pass that runs in between (the claim's ADDED event, a retried
    # creation handler) would otherwise find no pod and create it and its
    # siblings again, for nothing but 409s (thousands at a few thousand Sandboxes).
    created_pods: dict[Key, JSON] = field(default_factory=dict)
    # The sandbox container's cgroup counters at the last look, and when, by
    # (namespace, Sandbox UID): PidLimitReached and CpuThrottled come from how
    # they grew.
    # Lost on restart; the first look after one only sets the baseline.
    limit_counters: dict[Key, tuple[datetime, LimitCounters]] = field(default_factory=dict)
    # Pool members a claim of this process is taking or took: when (monotonic
    # seconds) and the claiming Sandbox's UID. Other claims skip them instead of
    # racing for the same one until the index shows the claim.
    reserved: dict[Key, tuple[float, str]] = field(default_factory=dict)
    # A claiming Sandbox's pool outcome (claimed or cold, with what it inherits) by
    # (namespace, Sandbox UID), from the decision until its status shows it. A pass
    # that holds an older body (the claim's status goes out with Kopf's patch,
    # after the handler) takes this decision up instead of deciding again: two
    # decisions would announce a cold start and claim a member for one Sandbox.
    pool_decisions: dict[Key, JSON] = field(default_factory=dict)
    # Per SandboxPool: set to have its loop make a pass now (handlers.pool).
    pool_wakeups: dict[Key, asyncio.Event] = field(default_factory=dict)
    # Refusal streaks by object, shared by all of an object's triggers (errors.py).
    backoffs: Backoffs = field(default_factory=Backoffs)
    # When each Sandbox needs its next pass, by (namespace, name, UID), and the
    # clock that runs the passes (handlers.sandbox.deadlines). Made in
    # __post_init__ (the settings).
    timetable: Timetable = field(init=False)
    # The node components that save pods whole (pauseMode Memory). Made in __post_init__.
    checkpoints: Checkpoints = field(init=False)
    # Where Events go: the EventRecorder (events.py) in the operator, a list in unit
    # tests; Kopf's own poster (one Event per call) when nothing else is given.
    post: Callable[[JSON, str, str, str], None] = field(default_factory=lambda: post_event)
    # Events of what happens once in an object's life (None: `post`).
    post_once: Callable[[JSON, str, str, str, str], None] | None = None

    def __post_init__(self) -> None:
        self.timetable = Timetable(
            self.settings.resync_interval_seconds, self.settings.reconcile_interval_seconds
        )
        self.checkpoints = Checkpoints(self.settings, self.kube)

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())

    def pool_wakeup(self, namespace: str, name: str) -> asyncio.Event:
        return self.pool_wakeups.setdefault((namespace, name), asyncio.Event())

    def wake_pool(self, namespace: str, name: str) -> None:
        """Ask a SandboxPool's loop for a pass now (a member changed or was claimed)."""
        self.pool_wakeup(namespace, name).set()

    def namespace_lock(self, namespace: str) -> asyncio.Lock:
        return self.namespace_locks.setdefault(namespace, asyncio.Lock())

    def status_seen(self, namespace: str, name: str, status: JSON | None) -> None:
        """A Sandbox's event carries `status`: the copy kept since this process
        wrote it is not needed once the event shows the same (events come in
        order; a later write keeps its own), and it is 2 KiB a Sandbox."""
        known = self.statuses.get((namespace, name))
        if known is not None and known == status:
            del self.statuses[(namespace, name)]

    def current(self, body: JSON) -> JSON:
        """A Sandbox `body` with the status this process last wrote (fresher than
        Kopf's copy: the operator is the only writer of status)."""
        meta = body["metadata"]
        known = self.statuses.get((meta["namespace"], meta["name"]))
        return body if known is None else {**body, "status": known}

    def sandboxes_in(self, index: Mapping[Key, Any], namespace: str) -> list[JSON]:
        """The namespace's Sandboxes in a Kopf index by (namespace, name), each as `current`."""
        return [
            self.current(body)
            for (ns, _), store in index.items()
            if ns == namespace
            for body in store
        ]

    def known_pod(self, namespace: str, name: str, indexed: JSON | None) -> JSON | None:
        """A Sandbox's pod: the index's, or, until the index has caught up with
        it, the one this process created."""
        if indexed is not None:
            self.created_pods.pop((namespace, name), None)
            return indexed
        return self.created_pods.get((namespace, name))

    def forget(self, namespace: str, name: str, uid: str | None = None) -> None:
        self.locks.pop((namespace, name), None)
        self.statuses.pop((namespace, name), None)
        self.created_pods.pop((namespace, name), None)
        if uid is not None:
            self.tokens.pop((namespace, uid), None)
            self.limit_counters.pop((namespace, uid), None)
            self.pool_decisions.pop((namespace, uid), None)
            self.environments.pop((namespace, uid), None)
            self.backoffs.streaks.pop(uid, None)
            self.timetable.drop((namespace, name, uid))

    async def agent_token(self, sandbox: JSON) -> str | None:
        """The bearer token of a sandbox's agent, read from its Secret once (a pool
        member's, for a Sandbox that claimed one)."""
        ref = children_ref(sandbox)
        key = (ref.namespace, ref.uid)
        token = self.tokens.get(key)
        if token:
            return token
        path = SECRETS.path(ref.namespace, names(ref.name)["secret"])
        encoded = ((await self.kube.get(path)) or {}).get("data", {}).get(TOKEN_KEY)
        if not encoded:
            return None
        token = base64.b64decode(encoded).decode()
        self.tokens[key] = token
        return token

    def drop_token(self, sandbox: JSON) -> None:
        """Forget a token the agent refused (read again next time)."""
        ref = children_ref(sandbox)
        self.tokens.pop((ref.namespace, ref.uid), None)

    def event(self, body: JSON, kind: str, reason: str, message: str) -> None:
        """A Kubernetes Event on one of our objects: `kind` is "info" or "warn"."""
        self.post(body, kind, reason, message)

    def event_once(self, body: JSON, kind: str, reason: str, message: str, key: str = "") -> None:
        """An Event posted once per object, reason and `key` (events.EventRecorder)."""
        if self.post_once is None:
            self.post(body, kind, reason, message)
        else:
            self.post_once(body, kind, reason, message, key)


def post_event(body: JSON, kind: str, reason: str, message: str) -> None:
    """Post an Event in the background, through Kopf.

    kopf.event, not kopf.info: the latter obeys the posting level, which is set
    to WARNING so that routine handler chatter stays out of Events."""
    kopf.event(
        cast(kopf.Body, body),
        type="Normal" if kind == "info" else "Warning",
        reason=reason,
        message=message,
    )
