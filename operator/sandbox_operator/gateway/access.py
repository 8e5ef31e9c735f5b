"""Who may do what: Kubernetes tokens through TokenReview and SubjectAccessReview,
or a scoped token the gateway minted. Answers are cached briefly, in bounded
memory, so a warm gateway asks the API server nothing per call."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, TypeVar

from sandbox_operator.api.common import GROUP
from sandbox_operator.gateway import metrics
from sandbox_operator.gateway.signing import Claims, Keys, SigningError
from sandbox_operator.kube import Api, KubeError
from sandbox_operator.resources import SANDBOXES, Resource

JSON = dict[str, Any]
V = TypeVar("V")

TOKEN_REVIEWS = Resource("authentication.k8s.io/v1", "tokenreviews", namespaced=False)
ACCESS_REVIEWS = Resource("authorization.k8s.io/v1", "subjectaccessreviews", namespaced=False)
# A refused token is remembered for less time than an accepted one: a mistyped
# token is corrected soon, and a flood of bad ones costs one review each per window.
REFUSED_TOKEN_SECONDS = 5.0
# A bearer token as RFC 6750 spells it (b64token), of a sane length: anything
# else is refused before it is hashed, parsed or sent to the API server.
BEARER = re.compile(r"[A-Za-z0-9._~+/-]{1,16384}=*")


class Operation(Enum):
    """What a request does to a sandbox, and the RBAC check that admits it:
    (verb, subresource of `sandboxes`); the value is its name in scoped tokens."""

    EXEC = "exec"
    FILES_READ = "files:read"
    FILES_WRITE = "files:write"
    VIEW = "view"
    PORTS = "ports"

    @property
    def rbac(self) -> tuple[str, str]:
        return _RBAC[self]

    def describe(self) -> str:
        verb, sub = self.rbac
        resource = f"sandboxes/{sub}" if sub else "sandboxes"
        return f"{verb} {resource}.{GROUP}"


_RBAC = {
    Operation.EXEC: ("create", "exec"),
    Operation.FILES_READ: ("get", "files"),
    Operation.FILES_WRITE: ("update", "files"),
    Operation.VIEW: ("get", ""),
    Operation.PORTS: ("get", "ports"),
}


class Denied(Exception):
    """A request the gateway refuses: 401 (who are you?) or 403 (not allowed)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Caller:
    user: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Set for a scoped token: what it allows, on which Sandbox object.
    scope: Claims | None = None
    # When the credential stops being valid (epoch seconds), where it says so:
    # a scoped token's expiry, a Kubernetes token's `exp` claim. Nothing the
    # gateway mints for this caller outlives it, and a cached answer ends there.
    expires: float | None = None

    def lifetime(self, wanted: int, now: float) -> int:
        """The expiry (epoch seconds) of a credential minted for this caller that
        asks for `wanted` seconds: never later than the caller's own."""
        end = now + wanted
        if self.expires is not None:
            end = min(end, self.expires)
        return int(end)


@dataclass
class _Entry(Generic[V]):
    value: V
    expires: float
    refresh: float


class TtlCache(Generic[V]):
    """At most `size` answers, each trusted for its own time to live (LRU beyond).

    `fetch` asks once for many: concurrent misses of one key wait for the same
    answer. An answer in use is asked again in the background once three
    quarters of its life have passed, so a busy caller never waits on a review
    and a warm gateway's reviews do not grow with its calls."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict[Any, _Entry[V]] = OrderedDict()
        self.pending: dict[Any, asyncio.Future[V]] = {}
        self.refreshing: set[asyncio.Task[None]] = set()

    def get(self, key: Any) -> V | None:
        found = self.entries.get(key)
        if found is None or found.expires < time.monotonic():
            return None
        self.entries.move_to_end(key)
        return found.value

    def put(self, key: Any, value: V, ttl: float) -> None:
        now = time.monotonic()
        self.entries[key] = _Entry(value, now + ttl, now + ttl * 0.75)
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    async def fetch(
        self, key: Any, load: Callable[[], Awaitable[V]], ttl: Callable[[V], float]
    ) -> tuple[V, bool]:
        """(the answer, whether it came from the cache)."""
        now = time.monotonic()
        found = self.entries.get(key)
        if found is not None and found.expires >= now:
            self.entries.move_to_end(key)
            if found.refresh <= now and key not in self.pending:
                task = asyncio.create_task(self._refresh(key, load, ttl))
                self.refreshing.add(task)
                task.add_done_callback(self.refreshing.discard)
            return found.value, True
        waiting = self.pending.get(key)
        if waiting is not None:
            return await asyncio.shield(waiting), True
        return await self._load(key, load, ttl), False

    async def _load(
        self, key: Any, load: Callable[[], Awaitable[V]], ttl: Callable[[V], float]
    ) -> V:
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self.pending[key] = future
        try:
            value = await load()
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters re-raise it, nobody else has to
            raise
        finally:
            self.pending.pop(key, None)
        self.put(key, value, ttl(value))
        future.set_result(value)
        return value

    async def _refresh(
        self, key: Any, load: Callable[[], Awaitable[V]], ttl: Callable[[V], float]
    ) -> None:
        # A failed refresh leaves the answer in place until it expires.
        with contextlib.suppress(Exception):
            await self._load(key, load, ttl)


def jwt_expiry(token: str) -> float | None:
    """The `exp` claim of a JWT (ServiceAccount and OIDC tokens), read only after
    the API server accepted the token; None for tokens that carry none."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        exp = claims.get("exp") if isinstance(claims, dict) else None
    except ValueError:
        return None
    return float(exp) if isinstance(exp, int | float) and not isinstance(exp, bool) else None


class Access:
    def __init__(
        self, kube: Api, keys: Keys, token_seconds: float, access_seconds: float, size: int
    ) -> None:
        self.kube = kube
        self.keys = keys
        self.token_seconds = token_seconds
        self.access_seconds = access_seconds
        # Keyed by the token's digest: the cache never holds a usable token.
        self.callers: TtlCache[Caller | None] = TtlCache(size)
        self.decisions: TtlCache[bool] = TtlCache(size * 4)

    async def caller(self, authorization: str | None) -> Caller:
        """Who sends `authorization` (a bearer token); Denied 401 when nobody."""
        if not authorization or not authorization.lower().startswith("bearer "):
            raise Denied(401, "unauthenticated", "send a bearer token (Authorization: Bearer ...)")
        token = authorization[7:].strip()
        if not BEARER.fullmatch(token):
            raise Denied(401, "invalid_token", "a bearer token is letters, digits and -._~+/=")
        if Keys.is_scoped(token):
            try:
                claims = self.keys.verify_token(token)
            except SigningError as exc:
                raise Denied(401, "invalid_token", str(exc)) from exc
            return Caller(
                user=f"scoped:{claims.namespace}/{claims.name}",
                scope=claims,
                expires=float(claims.expires),
            )
        digest = hashlib.sha256(token.encode()).hexdigest()
        found, hit = await self.callers.fetch(
            digest,
            lambda: self._review(token),
            lambda caller: self.token_seconds if caller is not None else REFUSED_TOKEN_SECONDS,
        )
        if hit:
            metrics.CACHE_HITS.labels("token").inc()
        if found is None:
            raise Denied(401, "unauthenticated", "the token was not accepted by the API server")
        if found.expires is not None and found.expires <= time.time():
            # A review is cached for a while; the token's own end comes first.
            raise Denied(401, "invalid_token", "the token has expired")
        return found

    async def _review(self, token: str) -> Caller | None:
        metrics.REVIEWS.labels("token").inc()
        try:
            answer = await self.kube.create(
                TOKEN_REVIEWS.path(),
                {
                    "apiVersion": TOKEN_REVIEWS.api_version,
                    "kind": "TokenReview",
                    "spec": {"token": token},
                },
            )
        except KubeError as exc:
            raise Denied(503, "review_failed", f"could not check the token: {exc}") from exc
        status = (answer or {}).get("status") or {}
        if not status.get("authenticated"):
            return None
        user = status.get("user") or {}
        extra = tuple(sorted((k, tuple(v)) for k, v in (user.get("extra") or {}).items()))
        return Caller(
            user=str(user.get("username", "")),
            uid=str(user.get("uid", "")),
            groups=tuple(user.get("groups") or ()),
            extra=extra,
            expires=jwt_expiry(token),
        )

    async def check(
        self, caller: Caller, operation: Operation, namespace: str, name: str, uid: str | None
    ) -> None:
        """Denied 403 (naming the permission) unless `caller` may do `operation` on
        the sandbox `namespace/name` (`uid`: the object there now, None when there
        is none). Decided the same whether it exists or not, so that a refusal
        tells a caller nothing about what exists."""
        if caller.scope is not None:
            claims = caller.scope
            if (claims.namespace, claims.name) != (namespace, name):
                raise Denied(403, "forbidden", "this token is for another sandbox")
            if uid is not None and claims.uid != uid:
                raise Denied(
                    403, "forbidden", "this token is for a sandbox of that name that was deleted"
                )
            if operation.value not in claims.operations:
                raise Denied(403, "forbidden", f"this token does not allow {operation.value!r}")
            return
        verb, sub = operation.rbac
        if not await self.allowed(caller, verb, namespace, name, sub=sub):
            raise Denied(
                403,
                "forbidden",
                f"{caller.user} may not {operation.describe()} in namespace {namespace}",
            )

    async def allowed(
        self,
        caller: Caller,
        verb: str,
        namespace: str,
        name: str = "",
        *,
        sub: str = "",
        group: str = GROUP,
        resource: str = SANDBOXES.plural,
    ) -> bool:
        """Whether RBAC lets `caller` (a Kubernetes identity, not a scoped token) do
        `verb` on `resource` (of `group`; `sub`resource) named `name` in `namespace`
        (`name` empty: any, or a create or list). Cached like every decision."""
        assert caller.scope is None, "a scoped token is decided by its claims"
        key = (
            caller.user,
            caller.groups,
            caller.extra,
            verb,
            group,
            resource,
            sub,
            namespace,
            name,
        )
        allowed, hit = await self.decisions.fetch(
            key,
            lambda: self._allowed(caller, verb, group, resource, sub, namespace, name),
            lambda _: self.access_seconds,
        )
        if hit:
            metrics.CACHE_HITS.labels("access").inc()
        return allowed

    async def _allowed(
        self,
        caller: Caller,
        verb: str,
        group: str,
        resource: str,
        sub: str,
        namespace: str,
        name: str,
    ) -> bool:
        metrics.REVIEWS.labels("access").inc()
        attributes = {"namespace": namespace, "verb": verb, "group": group, "resource": resource}
        if name:
            attributes["name"] = name
        if sub:
            attributes["subresource"] = sub
        spec: JSON = {
            "user": caller.user,
            "groups": list(caller.groups),
            "resourceAttributes": attributes,
        }
        if caller.uid:
            spec["uid"] = caller.uid
        if caller.extra:
            spec["extra"] = {k: list(v) for k, v in caller.extra}
        try:
            answer = await self.kube.create(
                ACCESS_REVIEWS.path(),
                {
                    "apiVersion": ACCESS_REVIEWS.api_version,
                    "kind": "SubjectAccessReview",
                    "spec": spec,
                },
            )
        except KubeError as exc:
            raise Denied(503, "review_failed", f"could not check the permission: {exc}") from exc
        return bool(((answer or {}).get("status") or {}).get("allowed"))
