"""The route table: which sandbox is where, fed by watches, read by every request.

Two watches (Sandboxes, and the agent-token Secrets the operator labels) keep
an in-memory map current; a proxied call reads it and asks the API server
nothing. A watch that breaks is listed again from scratch, so the table never
drifts for long from the cluster.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from pydantic import ValidationError

from sandbox_operator.effective import effectively_paused, sandbox_spec
from sandbox_operator.identity import TOKEN_KEY, names
from sandbox_operator.kube import Kube, KubeError
from sandbox_operator.resources import (
    LABEL_MANAGED_BY,
    LABEL_POOL,
    LABEL_SANDBOX,
    MANAGED_BY,
    RESUME_ANNOTATION,
    SANDBOXES,
    SECRETS,
)

JSON = dict[str, Any]
Key = tuple[str, str]
log = logging.getLogger("sandbox_gateway.table")

RELIST_BACKOFF = (0.5, 1.0, 2.0, 5.0, 10.0)
# Where a sandbox container sees its workspace unless its spec says otherwise.
WORKSPACE = "/workspace"


@dataclass(frozen=True)
class Port:
    number: int
    name: str
    public: bool


@dataclass(frozen=True)
class Route:
    """What a request needs to know of one sandbox (no body is kept)."""

    namespace: str
    name: str
    uid: str
    endpoint: str | None
    pod_ip: str | None
    phase: str
    ready: bool
    # The Ready condition's reason and message (why it is not ready).
    reason: str
    message: str
    # Paused by its spec (a person's decision) or by its idle policy.
    paused: bool
    paused_by_spec: bool
    ports: dict[int, Port] = field(default_factory=dict)
    resume_requested: str = ""
    # (name, UID) of the pool member whose pod and token serve this sandbox.
    served_by: tuple[str, str] | None = None
    # The UID of the Sandbox that claimed this one (a pool member), if any.
    claimed_by: str = ""
    # The SandboxPool this one waits in, unclaimed, if any.
    pool: str = ""
    # Where the workspace is mounted in the sandbox container (spec.workspace.mountPath).
    workspace: str = WORKSPACE
    # The lease's end (spec.lifecycle.expiresAt), as written; "" when none.
    lease: str = ""
    # Deleted, its finalizer not yet done: its pod is going away.
    deleting: bool = False


def route_of(body: JSON) -> Route:
    meta = body["metadata"]
    status = body.get("status") or {}
    ready = next(
        (c for c in status.get("conditions") or [] if c.get("type") == "Ready"),
        {"status": "False", "reason": "Pending", "message": "not observed yet"},
    )
    try:
        spec = sandbox_spec(body)
        paused, by_spec = effectively_paused(body, spec), spec.paused
        ports = {p.port: Port(p.port, p.name, p.public) for p in spec.network.exposed_ports}
        # As it runs: a template (or a pool's) may say where the workspace is.
        home, lease = spec.workspace.mount_path or WORKSPACE, spec.lifecycle.expires_at or ""
    except ValidationError:
        paused, by_spec, ports, home, lease = False, False, {}, WORKSPACE, ""
    pool = status.get("pool") or {}
    member = (pool["member"], pool["memberUid"]) if pool.get("memberUid") else None
    claimer = next(
        (
            str(o.get("uid"))
            for o in meta.get("ownerReferences") or []
            if o.get("controller") and o.get("kind") == "Sandbox"
        ),
        "",
    )
    return Route(
        namespace=meta["namespace"],
        name=meta["name"],
        uid=meta["uid"],
        endpoint=status.get("agentEndpoint"),
        pod_ip=status.get("podIP"),
        phase=str(status.get("phase") or "Pending"),
        ready=ready.get("status") == "True" and bool(status.get("agentEndpoint")),
        reason=str(ready.get("reason") or ""),
        message=str(ready.get("message") or ""),
        paused=paused,
        paused_by_spec=by_spec,
        ports=ports,
        resume_requested=(meta.get("annotations") or {}).get(RESUME_ANNOTATION, ""),
        served_by=member,
        claimed_by=claimer,
        pool=(meta.get("labels") or {}).get(LABEL_POOL, ""),
        workspace=home,
        lease=lease,
        deleting=bool(meta.get("deletionTimestamp")),
    )


def token_of(secret: JSON) -> tuple[str, str, str] | None:
    """(sandbox, owner UID, token) of an agent-token Secret, or None for another
    Secret. Only the one the operator names and controls counts: a look-alike
    (the labels and an owner reference copied under another name) must neither
    replace a sandbox's token nor, deleted, take it away."""
    meta = secret["metadata"]
    sandbox = (meta.get("labels") or {}).get(LABEL_SANDBOX)
    encoded = (secret.get("data") or {}).get(TOKEN_KEY)
    owners = [
        o
        for o in meta.get("ownerReferences") or []
        if o.get("kind") == "Sandbox" and o.get("controller") and o.get("name") == sandbox
    ]
    if not sandbox or not encoded or not owners or meta.get("name") != names(sandbox)["secret"]:
        return None
    return sandbox, str(owners[0]["uid"]), base64.b64decode(encoded).decode()


class RouteTable:
    def __init__(self, kube: Kube, namespaces: list[str] | None = None) -> None:
        self.kube = kube
        self.namespaces = namespaces or [""]
        self.routes: dict[Key, Route] = {}
        # (namespace, sandbox) -> (owner UID, token): a token belongs to one Sandbox object.
        self.tokens: dict[Key, tuple[str, str]] = {}
        self._tick = asyncio.Event()
        self._synced: dict[str, asyncio.Event] = {}
        self.tasks: list[asyncio.Task[None]] = []

    # -- reading ----------------------------------------------------------------

    def get(self, namespace: str, name: str) -> Route | None:
        return self.routes.get((namespace, name))

    def token(self, route: Route) -> str | None:
        """The agent token of exactly this Sandbox object (never a namesake's); for
        one served by a pool member, the member's, once the member is seen to be
        this Sandbox's (its controller) and not only named in its status."""
        name, uid = route.name, route.uid
        if route.served_by is not None:
            member = self.get(route.namespace, route.served_by[0])
            if member is None or member.uid != route.served_by[1]:
                return None
            if member.claimed_by != route.uid:
                return None
            name, uid = member.name, member.uid
        owner, token = self.tokens.get((route.namespace, name), ("", ""))
        return token if owner == uid and token else None

    async def wait(
        self, namespace: str, name: str, test: Callable[[Route | None], bool], seconds: float
    ) -> Route | None:
        """The route once `test` holds for it, or whatever it is after `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            route = self.get(namespace, name)
            left = deadline - time.monotonic()
            if test(route) or left <= 0:
                return route
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._tick.wait()

    @property
    def synced(self) -> bool:
        return bool(self._synced) and all(e.is_set() for e in self._synced.values())

    # -- feeding -----------------------------------------------------------------

    def _changed(self) -> None:
        self._tick.set()
        self._tick = asyncio.Event()

    def _apply_sandbox(self, kind: str, body: JSON) -> None:
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if kind == "DELETED":
            self.routes.pop(key, None)
        else:
            self.routes[key] = route_of(body)

    def _apply_secret(self, kind: str, body: JSON) -> None:
        found = token_of(body)
        if found is None:
            return
        sandbox, owner, token = found
        key = (body["metadata"]["namespace"], sandbox)
        if kind == "DELETED":
            if self.tokens.get(key, ("", ""))[0] == owner:
                self.tokens.pop(key, None)
        else:
            self.tokens[key] = (owner, token)

    def start(self) -> None:
        selector = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
        for namespace in self.namespaces:
            for path, params, apply, wipe in (
                (SANDBOXES.path(namespace or None), {}, self._apply_sandbox, self.routes),
                (
                    SECRETS.path(namespace or None),
                    {"labelSelector": selector},
                    self._apply_secret,
                    self.tokens,
                ),
            ):
                name = f"{path}?{params}"
                self._synced[name] = asyncio.Event()
                self.tasks.append(
                    asyncio.create_task(self._follow(name, path, params, apply, wipe, namespace))
                )

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _follow(
        self,
        name: str,
        path: str,
        params: dict[str, str],
        apply: Callable[[str, JSON], None],
        wipe: dict[Key, Any],
        namespace: str,
    ) -> None:
        """List, then watch from the list's version; list again whenever the watch
        cannot go on (410 Gone, an error, a broken connection)."""
        failures = 0
        while True:
            try:
                listed = await self.kube.get(path, params=params or None)
                assert listed is not None, f"{path} not found"
                for key in [k for k in wipe if not namespace or k[0] == namespace]:
                    del wipe[key]
                for item in listed.get("items") or []:
                    apply("ADDED", item)
                self._changed()
                self._synced[name].set()
                version = listed["metadata"]["resourceVersion"]
                failures = 0
                while True:
                    watch_params = {
                        **params,
                        "resourceVersion": version,
                        "allowWatchBookmarks": "true",
                    }
                    async for event in self.kube.watch(path, watch_params):
                        obj = event.get("object") or {}
                        if event.get("type") == "ERROR":
                            raise KubeError(int(obj.get("code", 500)), "", str(obj))
                        version = obj["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            apply(event["type"], obj)
                            self._changed()
            except asyncio.CancelledError:
                raise
            except (KubeError, aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                delay = RELIST_BACKOFF[min(failures, len(RELIST_BACKOFF) - 1)]
                failures += 1
                log.warning("watch of %s ended (%s); listing again in %gs", path, exc, delay)
                await asyncio.sleep(delay)
