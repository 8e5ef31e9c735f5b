"""E2B API keys: who sends `X-API-KEY`, as a Kubernetes identity, and the
namespace its E2B sandboxes live in.

Two kinds of key are accepted:

- A Kubernetes bearer token (a ServiceAccount's, an OIDC user's): reviewed
  like any token the gateway gets (TokenReview). Its sandboxes live in the
  ServiceAccount's own namespace, or in `e2b_default_namespace` for a user.
- A key in E2B's own shape, `e2b_` and 40 hex digits, which some SDK versions
  insist on. It is minted on the gateway's main listener by a caller RBAC lets
  `create serviceaccounts/token` for a ServiceAccount, and acts as that
  ServiceAccount (its user name, UID and groups) in its namespace, for every
  RBAC decision: the permission to mint it already lets one act as the
  ServiceAccount, so the key grants nothing more. It is kept as its SHA-256 in
  a Secret of the gateway's own namespace, named after that hash, so a lookup
  is one GET (cached for `e2b_key_seconds`); deleting the Secret, or the
  ServiceAccount, revokes it.

    POST   /v1/namespaces/{ns}/e2bkeys         {"serviceAccount": sa}  -> 201, the key, once
    GET    /v1/namespaces/{ns}/e2bkeys         the keys of ServiceAccounts the caller may act as
    DELETE /v1/namespaces/{ns}/e2bkeys/{id}    revoke (id: the key's SHA-256, as listed)
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from aiohttp import web

from sandbox_operator.api.common import DNS_LABEL_PATTERN, DNS_SUBDOMAIN_PATTERN, GROUP
from sandbox_operator.clock import iso, parse_time
from sandbox_operator.gateway.access import REFUSED_TOKEN_SECONDS, Caller, Denied, TtlCache
from sandbox_operator.gateway.app import Refusal, credentials
from sandbox_operator.kube import KubeError
from sandbox_operator.resources import SECRETS, Resource

if TYPE_CHECKING:
    from sandbox_operator.gateway.app import Gateway

JSON = dict[str, Any]

SERVICE_ACCOUNTS = Resource("v1", "serviceaccounts")
KEY = re.compile(r"e2b_[0-9a-f]{40}")
DIGEST = re.compile(r"[0-9a-f]{64}")
SECRET_PREFIX = "e2b-key-"
SECRET_TYPE = f"{GROUP}/e2b-key"
# On each key's Secret: the namespace the key acts in (listing a namespace's keys).
LABEL_KEY_NAMESPACE = f"{GROUP}/e2b-key-namespace"
MANAGED_BY = "sandbox-gateway"
# `system:serviceaccount:<namespace>:<name>`, the user name of a ServiceAccount.
SA_USER = re.compile(r"system:serviceaccount:([a-z0-9][-a-z0-9]{0,62}):([a-z0-9][-.a-z0-9]{0,252})")
# A minted key lives until revoked unless asked for less (between these bounds).
MIN_KEY_SECONDS = 600
MAX_KEY_SECONDS = 366 * 86400


def new_key() -> str:
    """A fresh key in E2B's shape: 160 random bits."""
    return "e2b_" + secrets.token_hex(20)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def secret_name(key_digest: str) -> str:
    return SECRET_PREFIX + key_digest


def service_account_caller(namespace: str, name: str, uid: str) -> Caller:
    """The identity the API server gives a token of ServiceAccount namespace/name."""
    return Caller(
        user=f"system:serviceaccount:{namespace}:{name}",
        uid=uid,
        groups=(
            "system:serviceaccounts",
            f"system:serviceaccounts:{namespace}",
            "system:authenticated",
        ),
    )


def home_namespace(caller: Caller, default: str) -> str:
    """Where a Kubernetes identity's E2B sandboxes live: a ServiceAccount's own
    namespace, `default` for anyone else."""
    found = SA_USER.fullmatch(caller.user)
    return found.group(1) if found else default


@dataclass(frozen=True)
class KeyRecord:
    """What a key's Secret says."""

    digest: str
    namespace: str
    service_account: str
    service_account_uid: str
    expires: float | None = None

    def caller(self) -> Caller:
        found = service_account_caller(
            self.namespace, self.service_account, self.service_account_uid
        )
        return Caller(found.user, found.uid, found.groups, expires=self.expires)


def _decode(data: JSON, field: str) -> str:
    value = data.get(field)
    return base64.b64decode(value).decode() if isinstance(value, str) else ""


def record_of(secret: JSON) -> KeyRecord | None:
    """The key a Secret holds, or None when it is not a well-formed key Secret."""
    if secret.get("type") != SECRET_TYPE:
        return None
    data = secret.get("data") or {}
    try:
        expires_at = _decode(data, "expiresAt")
        record = KeyRecord(
            digest=_decode(data, "sha256"),
            namespace=_decode(data, "namespace"),
            service_account=_decode(data, "serviceAccount"),
            service_account_uid=_decode(data, "serviceAccountUID"),
            expires=parse_time(expires_at).timestamp() if expires_at else None,
        )
    except (ValueError, UnicodeDecodeError):
        return None
    if not DIGEST.fullmatch(record.digest) or not record.namespace or not record.service_account:
        return None
    return record


def key_secret(
    key_digest: str,
    namespace: str,
    account: JSON,
    creator: str,
    now: datetime,
    expires: datetime | None,
) -> JSON:
    """The Secret that stands for a key (its hash, never the key)."""
    meta = account["metadata"]
    fields = {
        "sha256": key_digest,
        "namespace": namespace,
        "serviceAccount": meta["name"],
        "serviceAccountUID": meta.get("uid", ""),
        "createdAt": iso(now),
        **({"expiresAt": iso(expires)} if expires else {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": SECRET_TYPE,
        "metadata": {
            "name": secret_name(key_digest),
            "labels": {"app.kubernetes.io/managed-by": MANAGED_BY, LABEL_KEY_NAMESPACE: namespace},
            # Who minted it, for people reading the Secret (not a credential).
            "annotations": {f"{GROUP}/e2b-key-created-by": creator[:1024]},
        },
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in fields.items()},
    }


def key_state(record: KeyRecord, account: JSON | None, now: float) -> tuple[str, str]:
    """Whether a key still works, and why not: `Orphaned` when its ServiceAccount
    is gone or is a namesake made after a delete (the key never works again),
    `Expired` past its end; `Active` otherwise."""
    if account is None:
        return "Orphaned", f"ServiceAccount {record.service_account} no longer exists"
    if account["metadata"].get("uid", "") != record.service_account_uid:
        return "Orphaned", f"ServiceAccount {record.service_account} was deleted and made again"
    if record.expires is not None and record.expires <= now:
        return "Expired", "past its expiresAt"
    return "Active", ""


def described(secret: JSON, record: KeyRecord, state: tuple[str, str]) -> JSON:
    """A key as the list shows it (never the key itself)."""
    data = secret.get("data") or {}
    entry: JSON = {
        "id": record.digest,
        "namespace": record.namespace,
        "serviceAccount": record.service_account,
        "state": state[0],
        "createdAt": _decode(data, "createdAt"),
        "createdBy": (secret["metadata"].get("annotations") or {}).get(
            f"{GROUP}/e2b-key-created-by", ""
        ),
    }
    if record.expires is not None:
        entry["expiresAt"] = iso(datetime.fromtimestamp(record.expires, UTC))
    if state[1]:
        entry["reason"] = state[1]
    return entry


@dataclass(frozen=True)
class Identity:
    """Who sends an API key, and where its E2B sandboxes live."""

    caller: Caller
    namespace: str


class ApiKeys:
    def __init__(self, gateway: Gateway) -> None:
        # Settings are read when keys are used, not when the adapter is made.
        self.gateway = gateway
        self._records: TtlCache[KeyRecord | None] | None = None

    @property
    def namespace(self) -> str | None:
        return self.gateway.settings.e2b_keys_namespace

    @property
    def ttl(self) -> float:
        return self.gateway.settings.e2b_key_seconds

    @property
    def records(self) -> TtlCache[KeyRecord | None]:
        """Keyed by the key's digest: the cache never holds a usable key."""
        if self._records is None:
            self._records = TtlCache(self.gateway.settings.cache_entries)
        return self._records

    # -- X-API-KEY -> identity ----------------------------------------------------------

    async def identify(self, api_key: str | None) -> Identity:
        """The identity behind an `X-API-KEY`; Denied 401 when there is none (503
        when the API server cannot be asked)."""
        if not api_key:
            raise Denied(401, "unauthenticated", "send an API key in X-API-KEY")
        if KEY.fullmatch(api_key):
            record = await self._record(digest(api_key))
            if record is None:
                raise Denied(401, "invalid_key", "the API key is not valid")
            if record.expires is not None and record.expires <= time.time():
                raise Denied(401, "invalid_key", "the API key has expired")
            return Identity(record.caller(), record.namespace)
        caller = await self.gateway.access.caller("Bearer " + api_key)
        if caller.scope is not None:
            raise Denied(401, "invalid_key", "a scoped token is not an API key")
        return Identity(caller, home_namespace(caller, self.gateway.settings.e2b_default_namespace))

    async def _record(self, key_digest: str) -> KeyRecord | None:
        if self.namespace is None:
            return None
        found, _ = await self.records.fetch(
            key_digest,
            lambda: self._load(key_digest),
            lambda record: self.ttl if record is not None else min(self.ttl, REFUSED_TOKEN_SECONDS),
        )
        return found

    async def _load(self, key_digest: str) -> KeyRecord | None:
        """The key's Secret, if it holds this very digest and its ServiceAccount is
        still the one it was minted for (a namesake made after a delete is not)."""
        assert self.namespace is not None
        kube = self.gateway.kube
        try:
            secret = await kube.get(SECRETS.path(self.namespace, secret_name(key_digest)))
            record = record_of(secret) if secret is not None else None
            if record is None or not hmac.compare_digest(record.digest, key_digest):
                return None
            account = await kube.get(
                SERVICE_ACCOUNTS.path(record.namespace, record.service_account)
            )
        except KubeError as exc:
            raise Denied(503, "review_failed", f"could not check the API key: {exc}") from exc
        if account is None or account["metadata"].get("uid", "") != record.service_account_uid:
            return None
        return record

    # -- the main listener's key endpoints ------------------------------------------------

    def add_routes(self, app: web.Application) -> None:
        base = "/v1/namespaces/{namespace}/e2bkeys"
        app.router.add_post(base, self.create)
        app.router.add_get(base, self.list)
        app.router.add_delete(base + "/{id}", self.revoke)

    async def _minter(self, request: web.Request) -> tuple[Caller, str]:
        """The caller (a Kubernetes identity) and the namespace the path names."""
        caller = await self.gateway.access.caller(credentials(request))
        if caller.scope is not None:
            raise Refusal(403, "forbidden", "a scoped token cannot manage API keys")
        namespace = request.match_info["namespace"]
        if not re.fullmatch(DNS_LABEL_PATTERN, namespace) or len(namespace) > 63:
            raise Refusal(400, "invalid_request", "the namespace is not a DNS label")
        if self.namespace is None:
            raise Refusal(503, "e2b_keys_off", "E2B-shaped keys are not enabled on this gateway")
        return caller, namespace

    async def _may_act_as(self, caller: Caller, namespace: str, account: str) -> bool:
        return await self.gateway.access.allowed(
            caller, "create", namespace, account, sub="token", group="", resource="serviceaccounts"
        )

    async def create(self, request: web.Request) -> web.Response:
        request["operation"] = "e2b_key_create"
        caller, namespace = await self._minter(request)
        assert self.namespace is not None
        body = await self.gateway._json(request)
        account_name = body.get("serviceAccount")
        if (
            not isinstance(account_name, str)
            or len(account_name) > 253
            or not re.fullmatch(DNS_SUBDOMAIN_PATTERN, account_name)
        ):
            raise Refusal(400, "invalid_request", "serviceAccount: the name of a ServiceAccount")
        seconds = body.get("expirationSeconds")
        if seconds is not None and (
            isinstance(seconds, bool)
            or not isinstance(seconds, int)
            or not MIN_KEY_SECONDS <= seconds <= MAX_KEY_SECONDS
        ):
            raise Refusal(
                400,
                "invalid_request",
                f"expirationSeconds: a whole number from {MIN_KEY_SECONDS} to {MAX_KEY_SECONDS}",
            )
        if not await self._may_act_as(caller, namespace, account_name):
            raise Refusal(
                403,
                "forbidden",
                f"{caller.user} may not create serviceaccounts/token for {account_name}"
                f" in namespace {namespace}",
            )
        kube = self.gateway.kube
        try:
            account = await kube.get(SERVICE_ACCOUNTS.path(namespace, account_name))
            if account is None:
                raise Refusal(
                    404, "not_found", f"no ServiceAccount {account_name} in namespace {namespace}"
                )
            now = datetime.now(UTC).replace(microsecond=0)
            expires = datetime.fromtimestamp(now.timestamp() + seconds, UTC) if seconds else None
            key = new_key()
            secret = key_secret(digest(key), namespace, account, caller.user, now, expires)
            created = await kube.create(SECRETS.path(self.namespace), secret)
        except KubeError as exc:
            raise Refusal(503, "key_store_failed", f"could not store the key: {exc}") from exc
        if created is None:  # 160 random bits met an existing key: not in this universe
            raise Refusal(503, "key_store_failed", "could not store the key; try again")
        answer = {
            "key": key,
            "id": digest(key),
            "namespace": namespace,
            "serviceAccount": account_name,
            "createdAt": iso(now),
            **({"expiresAt": iso(expires)} if expires else {}),
        }
        return web.json_response(answer, status=201, headers={"Cache-Control": "no-store"})

    async def list(self, request: web.Request) -> web.Response:
        request["operation"] = "e2b_key_list"
        caller, namespace = await self._minter(request)
        assert self.namespace is not None
        try:
            listed = await self.gateway.kube.get(
                SECRETS.path(self.namespace),
                params={"labelSelector": f"{LABEL_KEY_NAMESPACE}={namespace}"},
            )
        except KubeError as exc:
            raise Refusal(503, "key_store_failed", f"could not list the keys: {exc}") from exc
        items = []
        accounts: dict[str, JSON | None] = {}
        for secret in (listed or {}).get("items") or []:
            record = record_of(secret)
            if record is None or record.namespace != namespace:
                continue
            if not await self._may_act_as(caller, namespace, record.service_account):
                continue
            name = record.service_account
            if name not in accounts:
                path = SERVICE_ACCOUNTS.path(namespace, name)
                try:
                    accounts[name] = await self.gateway.kube.get(path)
                except KubeError as exc:
                    raise Refusal(503, "key_store_failed", f"could not check a key: {exc}") from exc
            state = key_state(record, accounts[name], time.time())
            items.append(described(secret, record, state))
        items.sort(key=lambda item: (item["createdAt"], item["id"]))
        return web.json_response({"items": items})

    async def revoke(self, request: web.Request) -> web.Response:
        """A key is revoked by whoever may mint it; to anyone else, and for an id
        that names nothing, the answer is the same 404."""
        request["operation"] = "e2b_key_revoke"
        caller, namespace = await self._minter(request)
        assert self.namespace is not None
        key_digest = request.match_info["id"]
        missing = Refusal(404, "not_found", f"no key {key_digest[:64]} in namespace {namespace}")
        if not DIGEST.fullmatch(key_digest):
            raise missing
        path = SECRETS.path(self.namespace, secret_name(key_digest))
        try:
            secret = await self.gateway.kube.get(path)
            record = record_of(secret) if secret is not None else None
            if secret is None or record is None or record.namespace != namespace:
                raise missing
            if not await self._may_act_as(caller, namespace, record.service_account):
                raise missing
            await self.gateway.kube.delete(path, uid=secret["metadata"].get("uid"))
        except KubeError as exc:
            raise Refusal(503, "key_store_failed", f"could not revoke the key: {exc}") from exc
        # This replica forgets it at once; the others within e2b_key_seconds.
        self.records.entries.pop(key_digest, None)
        return web.Response(status=204)
