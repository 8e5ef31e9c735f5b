"""`kubectl sandbox exec` in one request, on the standard library alone.

The client (`SandboxClient`) first imports httpx, pydantic and the generated
models, then reads the Sandbox and looks for the gateway's Service, and only
then sends the command: more than twice what `kubectl exec` takes. `exec` is
the command people type most, so the CLI tries this way first: the kubeconfig
as the client reads it (`sandbox_sdk.config`), the gateway's Service, and the
command, over one connection to the API server (`sandbox_sdk._http11`).

Whatever this way does not cover goes to the client, which does it as it does
everywhere (`Handoff` says where things stood):

- an answer that is an error: nothing ran, and the client sends the same body
  again (the same idempotency key: the agent runs a command at most once),
  then retries or reports it in its own words;
- a stream that breaks or ends early: the client reattaches to the execution
  from the last cursor;
- `gateway="port-forward"`, and a kubeconfig that needs a ServiceAccount made
  first (a client certificate only, no `sandbox-sdk` account yet).
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sandbox_sdk import config as cluster_config
from sandbox_sdk._http11 import Connection
from sandbox_sdk._wire import (
    DEFAULT_SERVICE,
    GATEWAY_LABEL,
    JSON,
    PROXIED_AUTHORIZATION,
    SDK_ACCOUNT,
    dns_base,
    event_of,
    proxy_base,
    service_env,
    service_of,
)
from sandbox_sdk.errors import SandboxError, ServerError
from sandbox_sdk.types import OutputEvent

CONNECT_SECONDS = 10.0
HEADERS = {"Accept": "application/json", "User-Agent": "sandbox-sdk"}


class Handoff(Exception):
    """The client takes over. With `execution_id`, the command runs: reattach
    from `cursor`; without, send the command's body again."""

    def __init__(self, why: str, execution_id: str | None = None, cursor: int = 0) -> None:
        super().__init__(why)
        self.execution_id = execution_id
        self.cursor = cursor


@dataclass
class Route:
    """Where the command goes: `prefix` comes before `/v1/namespaces/...`."""

    namespace: str
    connection: Connection
    prefix: str
    headers: dict[str, str] = field(default_factory=dict)


def _connect(url: str, context: ssl.SSLContext | bool | None) -> tuple[Connection, str]:
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme != "https":
        return Connection(host, parts.port or 80, None, CONNECT_SECONDS), parts.path.rstrip("/")
    if not isinstance(context, ssl.SSLContext):
        insecure = context is False  # the kubeconfig's insecure-skip-tls-verify
        context = ssl.create_default_context()
        if insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
    return Connection(host, parts.port or 443, context, CONNECT_SECONDS), parts.path.rstrip("/")


def _call(
    connection: Connection,
    method: str,
    path: str,
    headers: dict[str, str],
    body: JSON | None = None,
) -> tuple[int, Any]:
    payload = b"" if body is None else json.dumps(body).encode()
    sent = {**HEADERS, **headers, **({"Content-Type": "application/json"} if payload else {})}
    response = connection.request(method, path, sent, payload)
    data = response.read()
    try:
        return response.status, json.loads(data) if data else None
    except ValueError:
        return response.status, None


def route(options: cluster_config.ConnectionOptions) -> Route:
    """The way to the gateway and its token, as the client finds them
    (`sandbox_sdk._sync.gateway`), or Handoff."""
    mode = options.gateway or os.environ.get("SANDBOX_GATEWAY_MODE") or "auto"
    if mode not in ("auto", "dns", "direct", "proxy"):
        raise Handoff(f"gateway mode {mode}")
    try:
        config = options.cluster()
        ns = options.namespace_in(config)
        url = options.gateway_url or os.environ.get("SANDBOX_GATEWAY_URL")
        if config is None:
            raise Handoff("no kubeconfig")
        api, api_prefix = _connect(config.server, config.ssl_context)
        api_token = config.credentials.token() if config.credentials is not None else None
        api_headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
        token = _gateway_token(config, api_token, api, api_prefix, api_headers, ns)
        if url:
            direct, prefix = _connect(url.rstrip("/"), None)
            return Route(ns, direct, prefix, {"Authorization": f"Bearer {token}"})
        service = service_env() or _labelled(api, api_prefix, api_headers) or DEFAULT_SERVICE
    except (OSError, SandboxError) as exc:
        raise Handoff(f"{type(exc).__name__}: {exc}") from exc
    if mode == "auto":
        mode = "dns" if config.in_cluster else "proxy"
    if mode in ("dns", "direct"):
        api.close()
        direct, prefix = _connect(dns_base(service), None)
        return Route(ns, direct, prefix, {"Authorization": f"Bearer {token}"})
    headers = {**api_headers, PROXIED_AUTHORIZATION: f"Bearer {token}"}
    return Route(ns, api, api_prefix + proxy_base(service), headers)


def _gateway_token(
    config: cluster_config.ClusterConfig,
    api_token: str | None,
    api: Connection,
    prefix: str,
    headers: dict[str, str],
    namespace: str,
) -> str:
    """The kubeconfig's bearer token, else a ServiceAccount's (as `Gateway.token`)."""
    account = os.environ.get("SANDBOX_SERVICE_ACCOUNT")
    if api_token and not (account and config.certificate_only):
        return api_token
    path = f"{prefix}/api/v1/namespaces/{namespace}/serviceaccounts/{account or SDK_ACCOUNT}/token"
    request = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"expirationSeconds": 600},
    }
    status, issued = _call(api, "POST", path, headers, request)
    token = ((issued or {}).get("status") or {}).get("token") if status < 300 else None
    if not token:
        raise Handoff(f"TokenRequest for {account or SDK_ACCOUNT}: HTTP {status}")
    return str(token)


def _labelled(api: Connection, prefix: str, headers: dict[str, str]) -> tuple[str, str, int] | None:
    query = urllib.parse.urlencode({"labelSelector": GATEWAY_LABEL})
    status, listed = _call(api, "GET", f"{prefix}/api/v1/services?{query}", headers)
    if status >= 300:
        return None  # not allowed to list Services cluster-wide: the default
    found = service_of((listed or {}).get("items") or [])
    return found[0] if found is not None else None


def events(way: Route, name: str, body: JSON, read_timeout: float) -> Iterator[OutputEvent]:
    """The command's output events, through to its exit event; Handoff on an
    error answer or a stream that breaks."""
    path = f"{way.prefix}/v1/namespaces/{way.namespace}/sandboxes/{name}/executions/stream"
    headers = {**HEADERS, **way.headers, "Content-Type": "application/json"}
    try:
        response = way.connection.request("POST", path, headers, json.dumps(body).encode())
    except OSError as exc:
        raise Handoff(f"{type(exc).__name__}: {exc}") from exc
    if response.status >= 400:
        raise Handoff(f"HTTP {response.status}")
    execution_id = response.headers.get("x-execution-id")
    cursor, said = 0, False
    try:
        way.connection.settimeout(read_timeout)
        for line in response.lines():
            if not line.strip():
                continue
            kind, event, named = event_of(json.loads(line))
            execution_id = named or execution_id
            if event is not None:
                cursor = event.cursor if event.cursor is not None else cursor
                said = True
                yield event
            if kind == "finished":
                return
    except (OSError, ValueError) as exc:
        why = f"the stream broke off: {type(exc).__name__}: {exc}"
    else:
        why = "the stream ended before the command did"
    if execution_id is None and said:
        # Output was shown, and the run cannot be named: sending the body again
        # would show it twice.
        raise ServerError(why)
    raise Handoff(why, execution_id, cursor)
