"""E2B's control plane (E2B_API_URL): sandboxes made, found, listed, leased,
paused, resumed and killed, as Sandbox custom resources.

Every request is decided in the same order: the API key names a Kubernetes
identity and its namespace (401, keys.py); RBAC, by SubjectAccessReview for
that identity on `sandboxes` in that namespace, allows the verb (403); only
then is the sandbox looked up (404), in that namespace alone. The gateway's
own ServiceAccount then makes the change. A key of one namespace never
reaches a sandbox of another: the ID is a name, looked up in the key's
namespace only.

    POST   /sandboxes, /v2/sandboxes                create      create sandboxes (+ exec, files)
    GET    /sandboxes, /v2/sandboxes                list        list sandboxes
    GET    /sandboxes/{id}                          info        get
    DELETE /sandboxes/{id}                          kill        delete
    POST   /sandboxes/{id}/timeout                  lease       patch
    POST   /sandboxes/{id}/refreshes                lease+      patch
    POST   /sandboxes/{id}/pause                    pause       patch
    POST   /sandboxes/{id}/resume                   resume      patch (+ exec, files)
    POST   /sandboxes/{id}/connect, /v2/.../connect connect     patch (+ exec, files)
    GET    /sandboxes/{id}/metrics                  metrics     get
    GET    /sandboxes/metrics?sandbox_ids=          metrics     get (each)

The lease is `spec.lifecycle.expiresAt` (and `onExpiry`: Delete, or Pause for
autoPause), which the operator enforces with the gateway down too; E2B's pause
is `spec.paused` (the lease is lifted while paused: a paused E2B sandbox stays
until killed), and connect resumes either kind of pause in one patch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from sandbox_operator.api.common import DNS_SUBDOMAIN_PATTERN
from sandbox_operator.api.sandbox import SandboxReason
from sandbox_operator.clock import iso, iso_precise
from sandbox_operator.gateway.access import Denied
from sandbox_operator.gateway.e2b import core, listing, shapes, usage
from sandbox_operator.gateway.e2b.core import CONTROL, Adapter, E2BError, Endpoint, json_response
from sandbox_operator.gateway.e2b.keys import Identity
from sandbox_operator.gateway.table import Route
from sandbox_operator.kube import KubeError, Refused
from sandbox_operator.resources import (
    CLUSTER_SANDBOX_TEMPLATES,
    RESUME_ANNOTATION,
    SANDBOX_POOLS,
    SANDBOX_TEMPLATES,
    SANDBOXES,
)

JSON = dict[str, Any]
log = logging.getLogger("sandbox_gateway.e2b")

ID = r"(?P<id>[^/]+)"
# A cold start that cannot get further without someone changing something.
_STUCK = {
    SandboxReason.INVALID_SPEC,
    SandboxReason.IMAGE_PULL,
    SandboxReason.TEMPLATE_NOT_FOUND,
    SandboxReason.POOL_NOT_FOUND,
    SandboxReason.QUOTA_EXCEEDED,
    SandboxReason.RUNTIME_NO_PYTHON,
}
# The RBAC checks before an access token is handed out.
_TOKEN_CHECKS = (("create", "exec"), ("update", "files"))
# Optimistic writes of the lease are tried this often against concurrent ones.
_PATCH_TRIES = 3


class Control:
    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter
        self.gateway = adapter.gateway
        self.settings = adapter.gateway.settings

    def endpoints(self) -> list[Endpoint]:
        create_v1 = self._create(default_timeout=15)
        create_v2 = self._create(default_timeout=300)
        return [
            Endpoint(CONTROL, "POST", "/sandboxes", create_v1),
            Endpoint(CONTROL, "POST", "/v2/sandboxes", create_v2),
            Endpoint(CONTROL, "GET", "/sandboxes", self.list_v1),
            Endpoint(CONTROL, "GET", "/v2/sandboxes", self.list_v2),
            # Before /sandboxes/{id}: "metrics" is a well-formed ID.
            Endpoint(CONTROL, "GET", "/sandboxes/metrics", self.metrics_many),
            Endpoint(CONTROL, "GET", f"/sandboxes/{ID}", self.info),
            Endpoint(CONTROL, "DELETE", f"/sandboxes/{ID}", self.kill),
            Endpoint(CONTROL, "POST", f"/sandboxes/{ID}/timeout", self.timeout),
            Endpoint(CONTROL, "POST", f"/sandboxes/{ID}/refreshes", self.refresh),
            Endpoint(CONTROL, "POST", f"/sandboxes/{ID}/pause", self.pause),
            Endpoint(CONTROL, "POST", f"/sandboxes/{ID}/resume", self.resume),
            Endpoint(CONTROL, "POST", f"/sandboxes/{ID}/connect", self._connect(required=True)),
            Endpoint(CONTROL, "POST", f"/v2/sandboxes/{ID}/connect", self._connect(required=False)),
            Endpoint(CONTROL, "GET", f"/sandboxes/{ID}/metrics", self.metrics_one),
        ]

    # -- who, may they, which sandbox ------------------------------------------------------

    async def identify(self, request: web.Request) -> Identity:
        try:
            return await self.adapter.api_keys.identify(request.headers.get("X-API-KEY"))
        except Denied as exc:
            raise E2BError(exc.status, exc.message) from exc

    async def permit(self, who: Identity, verb: str, name: str = "", sub: str = "") -> None:
        try:
            allowed = await self.gateway.access.allowed(
                who.caller, verb, who.namespace, name, sub=sub
            )
        except Denied as exc:  # the API server could not be asked
            raise E2BError(exc.status, exc.message) from exc
        if not allowed:
            resource = f"sandboxes/{sub}" if sub else "sandboxes"
            raise E2BError(
                403, f"{who.caller.user} may not {verb} {resource} in namespace {who.namespace}"
            )

    async def sandbox(self, who: Identity, sandbox_id: str, *checks: tuple[str, str]) -> JSON:
        """The Sandbox `sandbox_id` names in the caller's namespace, once RBAC allows
        each (verb, subresource) of `checks` on it; 404 when it is not there (or is a
        pool member, which only its claimer's name reaches)."""
        if not core.is_id(sandbox_id):
            raise not_found(sandbox_id)
        for verb, sub in checks:
            await self.permit(who, verb, sandbox_id, sub)
        body = await self._kube(self.gateway.kube.get(SANDBOXES.path(who.namespace, sandbox_id)))
        if body is None or shapes.is_pool_member(body):
            raise not_found(sandbox_id)
        return body

    async def view(self, who: Identity, sandbox_id: str, *checks: tuple[str, str]) -> shapes.View:
        body = await self.sandbox(who, sandbox_id, *checks)
        found = shapes.view_of(body, datetime.now(UTC))
        if found is None:
            raise not_found(sandbox_id)
        return found

    @staticmethod
    async def _kube(call: Awaitable[JSON | None]) -> JSON | None:
        try:
            return await call
        except Refused as exc:
            raise E2BError(429 if exc.quota else 400, exc.message) from exc
        except KubeError as exc:
            if exc.status == 409:
                raise E2BError(409, f"the sandbox changed meanwhile: {exc.message}") from exc
            raise E2BError(503, f"the Kubernetes API failed: {exc.message}") from exc

    async def body(self, request: web.Request, *, required: bool = True) -> JSON:
        """A small JSON object body, within the head deadline; {} when optional and absent."""
        try:
            async with asyncio.timeout(self.settings.head_seconds):
                raw = await request.read()
        except TimeoutError as exc:
            raise E2BError(408, "the body did not arrive in time") from exc
        except RequestPayloadError as exc:  # a Content-Encoding that does not decode
            raise E2BError(400, f"the body could not be read: {exc}") from None
        if not raw.strip() and not required:
            return {}
        try:
            found = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise E2BError(400, "the body must be a JSON object") from exc
        if not isinstance(found, dict):
            raise E2BError(400, "the body must be a JSON object")
        return found

    def token(self, view: shapes.View) -> str:
        return self.adapter.access_token(view.namespace, view.id, view.uid)

    # -- create -------------------------------------------------------------------------

    def _create(
        self, *, default_timeout: int
    ) -> Callable[[web.Request, dict[str, str]], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request, params: dict[str, str]) -> web.StreamResponse:
            return await self.create(request, default_timeout)

        return handler

    async def create(self, request: web.Request, default_timeout: int) -> web.Response:
        who = await self.identify(request)
        ask = shapes.parse_create(
            await self.body(request), default_timeout, self.settings.e2b_max_timeout_seconds
        )
        # The reviews at once, and then the lookups at once: a create waits for
        # two round trips to the API server before its own, not six.
        await ordered(
            self.permit(who, "create"),
            *(self.permit(who, verb, "", sub) for verb, sub in _TOKEN_CHECKS),
        )
        ref: JSON
        pools: JSON | None
        ref, pools = await ordered(
            self.template(who.namespace, ask.template),
            self._kube(self.gateway.kube.get(SANDBOX_POOLS.path(who.namespace))),
        )
        pool = warm_pool(pools, ref)
        now = datetime.now(UTC)
        wait = self.settings.e2b_ready_wait_seconds
        body = shapes.sandbox_body(core.new_id(), ask, ref, pool, now, wait)
        made = await self._kube(self.gateway.kube.create(SANDBOXES.path(who.namespace), body))
        if made is None:  # a namesake: 100 random bits met; the caller may try again
            raise E2BError(503, "could not name the sandbox; try again")
        name, uid = made["metadata"]["name"], made["metadata"]["uid"]
        path = SANDBOXES.path(who.namespace, name)
        try:
            await self.ready(who.namespace, name, uid, starting=True)
            # The lease runs from now, when the sandbox can first be used; a warm
            # claim's first one already does.
            first = made["spec"]["lifecycle"]["expiresAt"]
            lease = shapes.lease_after_start(first, datetime.now(UTC), ask.timeout)
            if lease is not None:
                patch = {"metadata": {"uid": uid}, "spec": {"lifecycle": {"expiresAt": lease}}}
                made = await self._kube(self.gateway.kube.patch(path, patch))
                if made is None:
                    raise not_found(name)
        except BaseException:
            # Nothing half-made is left behind, whatever went wrong (the caller
            # leaving included).
            with contextlib.suppress(Exception):
                await asyncio.shield(self.gateway.kube.delete(path, uid=uid))
            raise
        view = shapes.view_of(made, now)
        assert view is not None
        log.info("e2b: %s created %s/%s from %s", who.caller.user, who.namespace, name, ref["name"])
        return json_response(shapes.created(view, self.token(view), self.settings.e2b_domain), 201)

    async def template(self, namespace: str, asked: str) -> JSON:
        """The (Cluster)SandboxTemplate an E2B template name stands for: through the
        configured aliases, then as is; the namespace's own first."""
        name = self.settings.e2b_templates.get(asked, asked)
        if len(name) <= 253 and re.fullmatch(DNS_SUBDOMAIN_PATTERN, name):
            kube = self.gateway.kube
            own: JSON | None
            cluster: JSON | None
            own, cluster = await ordered(
                self._kube(kube.get(SANDBOX_TEMPLATES.path(namespace, name))),
                self._kube(kube.get(CLUSTER_SANDBOX_TEMPLATES.path(name=name))),
            )
            if own is not None:
                return {"kind": "SandboxTemplate", "name": name}
            if cluster is not None:
                return {"kind": "ClusterSandboxTemplate", "name": name}
        raise E2BError(
            404,
            f"template {asked!r} not found: no SandboxTemplate {name!r} in namespace"
            f" {namespace} and no ClusterSandboxTemplate {name!r}",
        )

    async def ready(self, namespace: str, name: str, uid: str, *, starting: bool) -> Route:
        """The route of the sandbox once it is Ready with its agent token known
        (bounded by e2b_ready_wait_seconds); an E2B error when it will not be."""
        table = self.gateway.table

        def settled(route: Route | None) -> bool:
            if route is None or route.uid != uid:
                return route is not None
            if route.ready and not route.paused and table.token(route) is not None:
                return True
            return starting and route.reason in _STUCK

        route = await table.wait(namespace, name, settled, self.settings.e2b_ready_wait_seconds)
        if route is None or route.uid != uid:
            raise not_found(name)
        if route.ready and not route.paused and table.token(route) is not None:
            return route
        why = f"{route.reason}: {route.message}" if route.reason else "not observed yet"
        # A create that failed deleted its sandbox: the SDK's automatic retry of a
        # 429 or 504 would make another in the same conditions, past its own
        # request timeout, and hide this message behind a timeout of its own.
        once = {"Should-Retry": "false"} if starting else {}
        if route.reason == SandboxReason.QUOTA_EXCEEDED:
            raise E2BError(429, f"no room for the sandbox ({why})", once)
        if route.reason in _STUCK:
            status = 400 if route.reason != SandboxReason.IMAGE_PULL else 500
            raise E2BError(status, why, once)
        wait = self.settings.e2b_ready_wait_seconds
        raise E2BError(504, f"the sandbox was not ready within {wait:g} s ({why})", once)

    # -- read ---------------------------------------------------------------------------

    async def info(self, request: web.Request, params: dict[str, str]) -> web.Response:
        who = await self.identify(request)
        view = await self.view(who, params["id"], ("get", ""))
        return json_response(shapes.detail(view, self.settings.e2b_domain))

    async def list_v1(self, request: web.Request, params: dict[str, str]) -> web.Response:
        return await self.list(request, v2=False)

    async def list_v2(self, request: web.Request, params: dict[str, str]) -> web.Response:
        return await self.list(request, v2=True)

    async def list(self, request: web.Request, *, v2: bool) -> web.Response:
        """The E2B sandboxes of the caller's namespace (made through this API), as
        RBAC's `list sandboxes` there allows; filtered, ordered and paged here."""
        who = await self.identify(request)
        query = listing.parse_list(request.query, v2=v2)
        await self.permit(who, "list")
        listed = await self._kube(
            self.gateway.kube.get(
                SANDBOXES.path(who.namespace),
                params={"labelSelector": listing.label_selector(query.metadata)},
            )
        )
        now = datetime.now(UTC)
        views = [
            view
            for body in (listed or {}).get("items") or []
            if not shapes.is_pool_member(body) and (view := shapes.view_of(body, now)) is not None
        ]
        shown, following = listing.page(views, query)
        headers = {}
        if following is not None:
            headers["X-Next-Token"] = listing.encode_token(following)
        if RUNNING_STATE in query.states:
            headers["X-Total-Running"] = str(listing.running_total(views, query))
        return web.Response(
            text=json.dumps([shapes.listed(v) for v in shown]),
            content_type="application/json",
            headers=headers,
        )

    # -- the lease -------------------------------------------------------------------------

    async def timeout(self, request: web.Request, params: dict[str, str]) -> web.Response:
        """The lease ends `timeout` seconds from now, sooner or later than before
        (0: now)."""
        who = await self.identify(request)
        seconds = shapes.integer(
            await self.body(request), "timeout", None, 0, self.settings.e2b_max_timeout_seconds
        )
        view = await self.view(who, params["id"], ("patch", ""))
        await self.lease(view, seconds, extend_only=False)
        return web.Response(status=204)

    async def refresh(self, request: web.Request, params: dict[str, str]) -> web.Response:
        """Older SDKs' keep-alive: the lease lasts at least `duration` more seconds."""
        who = await self.identify(request)
        seconds = shapes.integer(await self.body(request, required=False), "duration", 60, 0, 3600)
        view = await self.view(who, params["id"], ("patch", ""))
        await self.lease(view, seconds, extend_only=True)
        return web.Response(status=204)

    async def lease(
        self, view: shapes.View, seconds: int, *, extend_only: bool, extra: JSON | None = None
    ) -> None:
        """Write the lease's end (`seconds` from now; with `extend_only`, never
        earlier than it is), with `extra` fields in the same patch, guarded by the
        object's UID and, for the comparison, its resourceVersion."""
        path = SANDBOXES.path(view.namespace, view.id)
        kube = self.gateway.kube
        for attempt in range(_PATCH_TRIES):
            now = datetime.now(UTC)
            body = await self._kube(kube.get(path))
            current = shapes.view_of(body, now) if body is not None else None
            if body is None or current is None or current.uid != view.uid:
                raise not_found(view.id)
            end = now.replace(microsecond=0) + timedelta(seconds=seconds)
            if extend_only and current.expires_at is not None and current.expires_at >= end:
                if not extra:
                    return  # it lasts long enough already
                end = current.expires_at
            meta = {"uid": view.uid, "resourceVersion": body["metadata"].get("resourceVersion")}
            patch: JSON = {"metadata": meta, "spec": {"lifecycle": {"expiresAt": iso(end)}}}
            merge(patch, extra or {})
            try:
                written = await kube.patch(path, patch)
            except KubeError as exc:
                if exc.status == 409 and attempt + 1 < _PATCH_TRIES:
                    continue  # written by someone else meanwhile: decide again
                status = 409 if exc.status == 409 else 503
                raise E2BError(status, f"could not write the lease: {exc.message}") from exc
            if written is None:
                raise not_found(view.id)
            return

    # -- pause and resume ---------------------------------------------------------------------

    async def pause(self, request: web.Request, params: dict[str, str]) -> web.Response:
        """E2B's pause is `spec.paused` (the operator stops the pod, keeps the
        workspace); the lease is lifted, so a paused sandbox stays until killed or
        resumed. 409 when it is paused already."""
        who = await self.identify(request)
        await self.body(request, required=False)  # memory snapshots: not here, ignored
        view = await self.view(who, params["id"], ("patch", ""))
        if view.state == PAUSED_STATE:
            raise E2BError(409, f"sandbox {view.id} is already paused")
        patch = {
            "metadata": {"uid": view.uid},
            "spec": {"paused": True, "lifecycle": {"expiresAt": None}},
        }
        written = await self._kube(
            self.gateway.kube.patch(SANDBOXES.path(view.namespace, view.id), patch)
        )
        if written is None:
            raise not_found(view.id)
        return web.Response(status=204)

    def _connect(
        self, *, required: bool
    ) -> Callable[[web.Request, dict[str, str]], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request, params: dict[str, str]) -> web.StreamResponse:
            who = await self.identify(request)
            body = await self.body(request, required=required)
            seconds = shapes.integer(
                body, "timeout", None if required else 300, 1, self.settings.e2b_max_timeout_seconds
            )
            return await self.connect(who, params["id"], seconds, resume_only=False)

        return handler

    async def resume(self, request: web.Request, params: dict[str, str]) -> web.Response:
        """Older SDKs' resume: like connect, for a paused sandbox only (409 else);
        `autoPause` sets what the new lease's end does."""
        who = await self.identify(request)
        body = await self.body(request, required=False)
        seconds = shapes.integer(body, "timeout", 15, 1, self.settings.e2b_max_timeout_seconds)
        auto_pause = body.get("autoPause")
        if auto_pause is not None and not isinstance(auto_pause, bool):
            raise E2BError(400, "autoPause must be true or false")
        return await self.connect(
            who, params["id"], seconds, resume_only=True, auto_pause=auto_pause
        )

    async def connect(
        self,
        who: Identity,
        sandbox_id: str,
        seconds: int,
        *,
        resume_only: bool,
        auto_pause: bool | None = None,
    ) -> web.Response:
        """A running sandbox's lease is extended (never shortened): 200. A paused
        one is resumed, whichever way it was paused, with a new lease, in one
        patch, and answered once Ready: 201."""
        checks = (("patch", ""), *_TOKEN_CHECKS)
        view = await self.view(who, sandbox_id, *checks)
        paused = view.state == PAUSED_STATE
        if resume_only and not paused:
            raise E2BError(409, f"sandbox {view.id} is already running")
        extra: JSON = {}
        if auto_pause is not None:
            on_expiry = shapes.ON_EXPIRY_PAUSE if auto_pause else shapes.ON_EXPIRY_DELETE
            extra["spec"] = {"lifecycle": {"onExpiry": on_expiry}}
        if paused:
            if view.paused_by_spec:
                merge(extra, {"spec": {"paused": False}})
            if view.paused_by_operator:
                moment = iso_precise(datetime.now(UTC))
                merge(extra, {"metadata": {"annotations": {RESUME_ANNOTATION: moment}}})
        await self.lease(view, seconds, extend_only=not paused, extra=extra or None)
        await self.ready(view.namespace, view.id, view.uid, starting=False)
        return json_response(
            shapes.created(view, self.token(view), self.settings.e2b_domain), 201 if paused else 200
        )

    # -- metrics ------------------------------------------------------------------------------

    async def metrics_one(self, request: web.Request, params: dict[str, str]) -> web.Response:
        who = await self.identify(request)
        start, end = (_epoch(request.query, name) for name in ("start", "end"))
        view = await self.view(who, params["id"], ("get", ""))
        found = await usage.measure(self.adapter, view)
        shown = [found] if found and usage.overlaps(found["timestampUnix"], start, end) else []
        return json_response(shown)

    async def metrics_many(self, request: web.Request, params: dict[str, str]) -> web.Response:
        """The latest sample of each of `sandbox_ids` the caller may read and that
        runs; the others are left out, as E2B does."""
        who = await self.identify(request)
        ids = [i for i in request.query.get("sandbox_ids", "").split(",") if i]
        if not 1 <= len(ids) <= 100 or len(set(ids)) != len(ids):
            raise E2BError(400, "sandbox_ids: 1 to 100 distinct sandbox IDs, comma-separated")
        found: JSON = {}
        for sandbox_id in ids:
            try:
                view = await self.view(who, sandbox_id, ("get", ""))
            except E2BError as exc:
                if exc.status in (403, 404):
                    continue
                raise
            measured = await usage.measure(self.adapter, view)
            if measured is not None:
                found[sandbox_id] = measured
        return json_response({"sandboxes": found})

    # -- kill -------------------------------------------------------------------------------

    async def kill(self, request: web.Request, params: dict[str, str]) -> web.Response:
        who = await self.identify(request)
        view = await self.view(who, params["id"], ("delete", ""))
        deleted = await self._kube_delete(view)
        if not deleted:
            raise not_found(view.id)
        # E2B's SDKs ask `isRunning()` right after a kill: answered from the route
        # table, which learns of the deletion from its watch. Waiting (briefly)
        # until it has, the answer is False however loaded the API server is.
        await self.gateway.table.wait(
            view.namespace,
            view.id,
            lambda route: route is None or route.uid != view.uid or route.deleting,
            KILL_SEEN_SECONDS,
        )
        return web.Response(status=204)

    async def _kube_delete(self, view: shapes.View) -> bool:
        try:
            return await self.gateway.kube.delete(
                SANDBOXES.path(view.namespace, view.id), uid=view.uid
            )
        except KubeError as exc:
            raise E2BError(503, f"could not delete the sandbox: {exc.message}") from exc


RUNNING_STATE, PAUSED_STATE = shapes.RUNNING, shapes.PAUSED
# How long a kill waits for the gateway's own route table to see the deletion.
KILL_SEEN_SECONDS = 5.0


def _epoch(query: Any, name: str) -> int | None:
    text = query.get(name)
    if text is None:
        return None
    number = core.whole(text, 12)
    if number is None:
        raise E2BError(400, f"{name}: Unix time in seconds")
    return number


def not_found(sandbox_id: str) -> E2BError:
    return E2BError(404, f"sandbox {sandbox_id[:64]!r} not found")


def merge(into: JSON, more: JSON) -> None:
    """`more` merged into `into`, objects by key (a JSON merge patch's own rule)."""
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value


def warm_pool(listed: JSON | None, ref: JSON) -> str | None:
    """Of a list of the namespace's SandboxPools, the one of template `ref` with
    the most ready members, so the sandbox is a warm claim; None for a cold start."""
    best, most = None, 0
    for pool in (listed or {}).get("items") or []:
        wanted = (pool.get("spec") or {}).get("templateRef") or {}
        kind = wanted.get("kind") or "SandboxTemplate"
        ready = (pool.get("status") or {}).get("ready") or 0
        if (kind, wanted.get("name")) == (ref["kind"], ref["name"]) and ready > most:
            best, most = pool["metadata"]["name"], ready
    return best


async def ordered(*calls: Awaitable[Any]) -> list[Any]:
    """The results of `calls`, run at once; when some fail, the first of them in
    the order given is raised (whichever the API server answered first), so an
    answer does not depend on timing."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
