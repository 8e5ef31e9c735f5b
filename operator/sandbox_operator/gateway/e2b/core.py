"""What every part of the E2B adapter shares.

- Sandbox IDs. An E2B sandbox ID is the Sandbox's own name: the adapter
  names the Sandboxes it creates with a dash-free DNS label (`new_id`), so the
  ID maps to the name both ways with nothing stored. The namespace comes from
  the caller: the namespace its API key is bound to on the control plane, and
  the one written in the access token on the data plane. No request looks a
  sandbox up across namespaces.
- The access token (E2B's `envdAccessToken`): handed out by create and
  connect to a caller RBAC allowed commands and files on that sandbox, sent
  back by the SDK on every data-plane request (`X-Access-Token`, or
  `E2B-Traffic-Access-Token` for the interpreter's context calls). An HMAC
  over the Sandbox object (namespace, name, UID) with the gateway's signing
  keys: the gateway recomputes it (E2B's signed file URLs are hashed with it),
  a namesake created after a delete refuses it, and a key rotation retires it.
- The call into a sandbox's agent, with the agent token the gateway holds.
- E2B's error shapes: `{"code": <status>, "message"}` on the control plane,
  and the 502 "... was not found" that the SDKs read as "not running".
- What an endpoint is (`Endpoint`): each part lists its own, app.py routes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import string
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from sandbox_operator.clock import parse_time
from sandbox_operator.gateway.e2b.keys import ApiKeys
from sandbox_operator.gateway.signing import SigningError
from sandbox_operator.gateway.table import Route

if TYPE_CHECKING:
    from sandbox_operator.gateway.app import Gateway

JSON = dict[str, Any]

# The ports E2B's SDKs name in E2b-Sandbox-Port (and in a host's first label).
ENVD_PORT = 49983
INTERPRETER_PORT = 49999
# Headers of the data plane.
SANDBOX_ID_HEADER = "E2b-Sandbox-Id"
SANDBOX_PORT_HEADER = "E2b-Sandbox-Port"
ACCESS_TOKEN_HEADER = "X-Access-Token"
TRAFFIC_TOKEN_HEADER = "E2B-Traffic-Access-Token"
# The version of E2B's sandbox daemon whose protocol the adapter speaks: the
# SDKs enable features by it. 0.6.4 turns on what the adapter serves: closing
# stdin (0.5.2), octet-stream uploads (0.5.7), entries in watch events (0.6.3)
# and watches of network mounts (0.6.4). File metadata (0.6.2) is the one
# feature in that range it refuses, with a 400 that says so.
ENVD_VERSION = "0.6.4"

# A sandbox ID: a Sandbox name that is one DNS label without dashes (E2B's
# SDKs and hosts split on the dash), starting with a letter.
ID = re.compile(r"[a-z][a-z0-9]{2,62}")
_ALPHABET = string.ascii_lowercase + string.digits
_TOKEN_PREFIX = "e2bat1"
_TOKEN = re.compile(r"e2bat1\.[A-Za-z0-9_-]{1,128}\.[A-Za-z0-9_-]{1,128}\.[A-Za-z0-9_-]{43}")


def whole(text: str, digits: int) -> int | None:
    """The number `text` spells in at most `digits` ASCII decimal digits, else
    None. Not `str.isdigit()` alone: it is true of other scripts' digits and of
    superscripts ('²'), which int() refuses, and int() refuses more than 4,300
    digits; a caller's text must fail as a bad value, never as an exception."""
    if not 0 < len(text) <= digits or not text.isascii() or not text.isdigit():
        return None
    return int(text)


def new_id() -> str:
    """A fresh sandbox ID (and Sandbox name): 20 characters, 100 bits of chance."""
    return "i" + "".join(secrets.choice(_ALPHABET) for _ in range(19))


def is_id(text: str) -> bool:
    return bool(ID.fullmatch(text))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class E2BError(Exception):
    """A control-plane answer in E2B's shape: `{"code": status, "message"}`."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.headers = dict(headers or {})

    def response(self) -> web.Response:
        body = json.dumps({"code": self.status, "message": self.message})
        return web.Response(
            status=self.status, text=body, content_type="application/json", headers=self.headers
        )


def not_running(sandbox_id: str) -> E2BError:
    """What a data-plane request to a sandbox that is not running gets: E2B's SDKs
    read a 502 whose message says "was not found" as `SandboxNotRunning`."""
    return E2BError(502, f"The sandbox {sandbox_id} was not found")


def lease_ended(route: Route, now: float | None = None) -> bool:
    """Whether the sandbox's lease (spec.lifecycle.expiresAt) has passed."""
    if not route.lease:
        return False
    try:
        end = parse_time(route.lease).timestamp()
    except ValueError:
        return False  # admission checks the format; nothing to decide on otherwise
    return (time.time() if now is None else now) >= end


@dataclass(frozen=True)
class Target:
    """The sandbox a data-plane request reaches, ready for calls."""

    id: str
    route: Route
    # The agent's bearer token (never leaves the gateway).
    agent_token: str

    @property
    def namespace(self) -> str:
        return self.route.namespace

    @property
    def endpoint(self) -> str:
        assert self.route.endpoint is not None  # a Target is only made for a ready route
        return self.route.endpoint


ControlHandler = Callable[[web.Request, dict[str, str]], Awaitable[web.StreamResponse]]
DataHandler = Callable[[web.Request, Target, dict[str, str]], Awaitable[web.StreamResponse]]
SignedTarget = Callable[[web.Request, str], Awaitable[Target]]
CONTROL = 0  # Endpoint.port of a control-plane endpoint


@dataclass(frozen=True)
class Endpoint:
    """One route of the listener (each part of the adapter lists its own; app.py
    dispatches): `port` 0 for the control plane, else the sandbox port it serves
    (core.ENVD_PORT, core.INTERPRETER_PORT); `path` a regular expression whose
    named groups are passed to the handler."""

    port: int
    method: str
    path: str
    handler: ControlHandler | DataHandler
    # A data-plane route that E2B's signed URLs reach (its /files): a request
    # with a `signature` and no access token gets its sandbox from here, which
    # verifies the signature first.
    signed: SignedTarget | None = None

    def match(self, method: str, path: str) -> dict[str, str] | None:
        if method != self.method and not (self.method == "GET" and method == "HEAD"):
            return None
        found = re.fullmatch(self.path, path)
        return found.groupdict() if found else None


class Adapter:
    """The E2B adapter's state: the gateway it translates onto."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        # X-API-KEY -> Kubernetes identity and namespace (the control plane's callers).
        self.api_keys = ApiKeys(gateway)

    # -- the access token ------------------------------------------------------------

    def access_token(self, namespace: str, name: str, uid: str) -> str:
        kid, key = self.gateway.keys._signing_key()
        return self._token(kid, key, namespace, name, uid)

    def access_tokens(self, namespace: str, name: str, uid: str) -> list[str]:
        """The Sandbox's access token under every key that verifies: a signed file
        URL made from a token minted before a key rotation still verifies."""
        keys = self.gateway.keys
        keys.reload()
        return [self._token(kid, key, namespace, name, uid) for kid, key in keys.keys.items()]

    def _token(self, kid: str, key: bytes, namespace: str, name: str, uid: str) -> str:
        head = f"{_TOKEN_PREFIX}.{_b64(namespace.encode())}.{_b64(kid.encode())}"
        return f"{head}.{_b64(self._mac(key, head, name, uid))}"

    @staticmethod
    def _mac(key: bytes, head: str, name: str, uid: str) -> bytes:
        return hmac.new(key, f"{head}\n{name}\n{uid}".encode(), hashlib.sha256).digest()

    @staticmethod
    def token_namespace(token: str) -> str | None:
        """The namespace an access token was minted in (unverified), or None when
        it is not an access token at all."""
        if not _TOKEN.fullmatch(token):
            return None
        try:
            return _unb64(token.split(".")[1]).decode()
        except (ValueError, UnicodeDecodeError):
            return None

    def verify_access(self, token: str, route: Route | None) -> bool:
        """Whether `token` is the access token of exactly this Sandbox object
        (False for None: decided after the same work, to tell nothing)."""
        if not _TOKEN.fullmatch(token):
            return False
        head, _, given = token.rpartition(".")
        try:
            kid = _unb64(head.split(".")[2]).decode()
            key = self.gateway.keys._key(kid)
        except (ValueError, UnicodeDecodeError, SigningError):
            return False
        namespace, name, uid = (route.namespace, route.name, route.uid) if route else ("", "", "")
        expected = _b64(self._mac(key, head, name, uid))
        matches = hmac.compare_digest(expected, given)
        return matches and route is not None and self.token_namespace(token) == namespace

    # -- reaching a sandbox ----------------------------------------------------------

    async def target(self, sandbox_id: str, token: str | None) -> Target:
        """The ready sandbox `sandbox_id` names for a data-plane request with
        access token `token`. 401 without a valid token for it; the 502 of a
        sandbox that is not running when it is gone, paused or never was."""
        if not token:
            raise E2BError(401, "send the sandbox's access token in X-Access-Token")
        namespace = self.token_namespace(token)
        if namespace is None or not is_id(sandbox_id):
            raise E2BError(401, "the access token is not valid for this sandbox")
        table = self.gateway.table
        route = table.get(namespace, sandbox_id)
        if not self.verify_access(token, route):
            raise E2BError(401, "the access token is not valid for this sandbox")
        assert route is not None
        if route.paused or route.deleting or lease_ended(route):
            # A paused E2B sandbox comes back through connect, not by being called;
            # a deleted one is gone for E2B (is_running() is False) from the delete
            # on, and one past its lease whenever the operator's next pass comes.
            raise not_running(sandbox_id)
        current = route
        if not route.ready or table.token(route) is None:
            current = (
                await table.wait(
                    namespace,
                    sandbox_id,
                    lambda r: (
                        r is None or r.uid != route.uid or (r.ready and table.token(r) is not None)
                    ),
                    self.gateway.settings.resume_wait_seconds,
                )
                or route
            )
        agent_token = table.token(current)
        if current.uid != route.uid or not current.ready or agent_token is None:
            raise not_running(sandbox_id)
        return Target(sandbox_id, current, agent_token)

    async def leaving(self, target: Target, wait: float = 2.0) -> bool:
        """Whether the sandbox is going away (deleted, paused, past its lease, no
        longer ready), waiting up to `wait` seconds for the route table to say
        so: a stream its pod's end broke may be read before the watch event
        that explains it. What dies with its sandbox is the sandbox's end for
        E2B's SDKs, not an error of the call."""
        table = self.gateway.table
        uid = target.route.uid

        def gone(route: Route | None) -> bool:
            return (
                route is None
                or route.uid != uid
                or route.deleting
                or route.paused
                or not route.ready
                or lease_ended(route)
            )

        return gone(await table.wait(target.namespace, target.id, gone, wait))

    async def agent(
        self,
        target: Target,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        json_body: Any = None,
        data: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> aiohttp.ClientResponse:
        """A request to the sandbox's agent (`path` after `/v1/`); the caller
        reads the answer and releases it (`async with` or `.release()`). A
        sandbox that cannot be reached is not running, as E2B says it."""
        outgoing = {"Authorization": f"Bearer {target.agent_token}", **(headers or {})}
        try:
            return await self.gateway.upstreams.session.request(
                method,
                f"{target.endpoint}/v1/{path}",
                params=params,
                json=json_body,
                data=data,
                headers=outgoing,
                allow_redirects=False,
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise E2BError(502, f"The sandbox {target.id} could not be reached: {exc}") from exc


def json_response(body: object, status: int = 200) -> web.Response:
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")
