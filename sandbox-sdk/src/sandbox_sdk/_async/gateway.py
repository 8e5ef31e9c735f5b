"""The way to the gateway, and the gateway token.

Where the gateway is (the first that applies):

- `gateway_url=` or `$SANDBOX_GATEWAY_URL`: that URL, directly;
- otherwise its Service (`$SANDBOX_GATEWAY_SERVICE` as `namespace/name[:port]`,
  else the Service labelled `app.kubernetes.io/name=sandbox-gateway`, else
  `sandbox-system/sandbox-operator-gateway:80`), reached
  - in a pod: by its cluster DNS name (`http://name.namespace.svc:port`);
  - from a kubeconfig: through the API server's service proxy
    (`/api/v1/namespaces/NS/services/http:NAME:PORT/proxy/...`), as
    `kubectl get --raw` would; the API server keeps `Authorization` for itself,
    so the gateway token travels in `X-Sandbox-Authorization`;
  - with `gateway="port-forward"`: through `kubectl port-forward` to the Service.

Which token the gateway gets (it reviews it with TokenReview, then RBAC):

- `gateway_token=` (a scoped token the gateway minted, or any Kubernetes token);
- else the bearer token the API server gets (kubeconfig token, exec plugin,
  the pod's ServiceAccount);
- else (a kubeconfig with a client certificate only, e.g. kind's or a local
  admin's): a short-lived token of a ServiceAccount (TokenRequest). It is the
  one named by `service_account=` / `$SANDBOX_SERVICE_ACCOUNT`, or `sandbox-sdk`
  in the sandbox's namespace, which the SDK creates if missing and binds to the
  chart's `<release>-user` ClusterRole (RBAC lets a user bind only what they
  hold). The gateway then sees that ServiceAccount, not the certificate's user.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from sandbox_sdk._async.kube import AsyncKube, core_path
from sandbox_sdk._async_io import sleep
from sandbox_sdk._wire import (
    DEFAULT_SERVICE,
    GATEWAY_LABEL,
    PROXIED_AUTHORIZATION,
    SDK_ACCOUNT,
    dns_base,
    proxy_base,
    service_env,
    service_of,
)
from sandbox_sdk.errors import (
    ConfigError,
    Conflict,
    Forbidden,
    NotFound,
    SandboxError,
    ServerError,
    from_response,
)
from sandbox_sdk.models.agent_codes import AgentErrorCode

if TYPE_CHECKING:
    from sandbox_sdk._async.websocket import AsyncWebSocket

JSON = dict[str, Any]
TOKEN_SECONDS = 3600
# Answers that say "try again": nothing ran (the agent creates no record then).
_RETRY_STATUS = {429, 502}
_RETRY_CODES: set[str] = {
    AgentErrorCode.RUNNER_UNAVAILABLE,
    AgentErrorCode.RUNTIME_RESTARTING,
    # The gateway's own (it has no document that lists them).
    "sandbox_unreachable",
    "review_failed",
}
_BACKOFF = (0.1, 0.3, 0.7, 1.5)


async def read_to_end(lines: AsyncIterator[str]) -> None:
    """Read a streamed answer to its end once its last event has come (the end
    follows at once): httpx closes a connection left mid-answer instead of
    using it again, which would cost the next call a new connection (a TLS
    handshake, through the API server). A failure here loses nothing: the last
    event is in hand."""
    with contextlib.suppress(httpx.TransportError, httpx.StreamError):
        async for _ in lines:
            pass


@dataclass
class Location:
    """How requests reach the gateway: `base` is a URL prefix before `/v1/...`;
    `via_api_server` says whether they go through the API server's client."""

    base: str
    via_api_server: bool
    service: tuple[str, str, int] | None = None
    describe: str = ""


class PortForward:
    """`kubectl port-forward` to the gateway Service on a free local port."""

    def __init__(self, service: tuple[str, str, int], kubeconfig_args: list[str]) -> None:
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            raise ConfigError('gateway="port-forward" needs kubectl on PATH')
        ns, name, port = service
        self.proc = subprocess.Popen(
            [kubectl, *kubeconfig_args, "port-forward", "-n", ns, f"svc/{name}", f":{port}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "Forwarding from 127.0.0.1:PORT -> 8080"
        if "127.0.0.1:" not in line:
            self.close()
            raise ConfigError(f"kubectl port-forward failed: {line.strip()}")
        self.local_port = int(line.split("127.0.0.1:", 1)[1].split()[0])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


class AsyncGateway:
    """Requests to `/v1/namespaces/{ns}/sandboxes/{name}/...` of the gateway."""

    def __init__(
        self,
        kube: AsyncKube | None,
        *,
        url: str | None = None,
        token: str | None = None,
        mode: str | None = None,
        service_account: str | None = None,
        timeout: float = 60.0,
        kubeconfig_args: list[str] | None = None,
    ) -> None:
        self.kube = kube
        self.url = url or os.environ.get("SANDBOX_GATEWAY_URL")
        self.explicit_token = token
        self.mode = mode or os.environ.get("SANDBOX_GATEWAY_MODE") or "auto"
        if self.mode not in ("auto", "direct", "dns", "proxy", "port-forward"):
            raise ConfigError(f"gateway={self.mode!r}: one of auto, dns, proxy, port-forward")
        self.service_account = service_account or os.environ.get("SANDBOX_SERVICE_ACCOUNT")
        self.timeout = timeout
        self.kubeconfig_args = kubeconfig_args or []
        self.location: Location | None = None
        self.forward: PortForward | None = None
        self.direct: httpx.AsyncClient | None = None
        # namespace -> (refresh after, token) for ServiceAccount tokens.
        self.account_tokens: dict[str, tuple[float, str]] = {}
        self.release: str | None = None

    async def aclose(self) -> None:
        if self.direct is not None:
            await self.direct.aclose()
        if self.forward is not None:
            self.forward.close()

    # -- where ------------------------------------------------------------------

    async def _service(self) -> tuple[str, str, int]:
        explicit = service_env()
        if explicit is not None:
            return explicit
        if self.kube is not None:
            try:
                found = await self.kube.list(
                    core_path("services"), {"labelSelector": GATEWAY_LABEL}
                )
            except SandboxError:
                found = []  # not allowed to list Services cluster-wide: the default
            labelled = service_of(found)
            if labelled is not None:
                service, self.release = labelled
                return service
        return DEFAULT_SERVICE

    async def locate(self) -> Location:
        if self.location is not None:
            return self.location
        if self.url:
            self.location = Location(self.url.rstrip("/"), False, describe=f"{self.url} (direct)")
        else:
            if self.kube is None:
                raise ConfigError(
                    "no gateway: pass gateway_url= (or set SANDBOX_GATEWAY_URL), or run"
                    " with a kubeconfig or inside a pod"
                )
            service = await self._service()
            mode = self.mode
            if mode == "auto":
                mode = "dns" if self.kube.config.in_cluster else "proxy"
            if mode in ("dns", "direct"):
                base = dns_base(service)
                self.location = Location(base, False, service, f"{base} (cluster DNS)")
            elif mode == "proxy":
                base = proxy_base(service)
                self.location = Location(
                    base, True, service, f"{self.kube.config.server}{base} (API server proxy)"
                )
            else:
                self.forward = PortForward(service, self.kubeconfig_args)
                base = f"http://127.0.0.1:{self.forward.local_port}"
                self.location = Location(base, False, service, f"{base} (kubectl port-forward)")
        if not self.location.via_api_server and self.direct is None:
            self.direct = httpx.AsyncClient(
                timeout=self.timeout, trust_env=False, headers={"User-Agent": "sandbox-sdk"}
            )
        return self.location

    # -- who --------------------------------------------------------------------

    async def token(self, namespace: str) -> str:
        if self.explicit_token:
            return self.explicit_token
        if self.kube is None:
            raise ConfigError("no gateway token: pass gateway_token= (or token=)")
        config = self.kube.config
        if config.credentials is not None and not (
            self.service_account and config.certificate_only
        ):
            token = config.credentials.token()
            if token:
                return token
        return await self._account_token(namespace)

    async def _account_token(self, namespace: str) -> str:
        cached = self.account_tokens.get(namespace)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        assert self.kube is not None
        name = self.service_account or SDK_ACCOUNT
        path = core_path("serviceaccounts", namespace, name, "token")
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": TOKEN_SECONDS},
        }
        try:
            issued = await self.kube.create(path, body)
        except NotFound:
            if self.service_account:
                raise
            await self._provision(namespace)
            issued = await self.kube.create(path, body)
        token = str(issued["status"]["token"])
        # Refreshed well before it expires (a call may take a while).
        self.account_tokens[namespace] = (time.monotonic() + TOKEN_SECONDS * 0.8, token)
        return token

    async def _provision(self, namespace: str) -> None:
        """The `sandbox-sdk` ServiceAccount of a namespace, bound to the chart's
        user role: for kubeconfigs whose certificate the gateway cannot review."""
        assert self.kube is not None
        if self.release is None:
            await self._service()
        role = f"{self.release or 'sandbox-operator'}-user"
        labels = {"app.kubernetes.io/managed-by": "sandbox-sdk"}
        objects: list[tuple[str, JSON]] = [
            (
                core_path("serviceaccounts", namespace),
                {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": SDK_ACCOUNT}},
            ),
            (
                f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "RoleBinding",
                    "metadata": {"name": SDK_ACCOUNT, "labels": labels},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": role,
                    },
                    "subjects": [
                        {"kind": "ServiceAccount", "name": SDK_ACCOUNT, "namespace": namespace}
                    ],
                },
            ),
        ]
        for path, body in objects:
            body["metadata"].setdefault("labels", labels)
            with contextlib.suppress(Conflict):  # made by another client meanwhile
                await self.kube.create(path, body)

    # -- requests ---------------------------------------------------------------

    async def _prepare(
        self,
        namespace: str,
        name: str,
        tail: str,
        headers: dict[str, str] | None,
        *,
        events: bool = False,
    ) -> tuple[httpx.AsyncClient, str, dict[str, str]]:
        path = f"/v1/namespaces/{namespace}/sandboxes/{name}/{tail}"
        return await self._prepare_path(namespace, path, headers, events=events)

    async def _prepare_path(
        self, namespace: str, path: str, headers: dict[str, str] | None, *, events: bool = False
    ) -> tuple[httpx.AsyncClient, str, dict[str, str]]:
        location = await self.locate()
        token = await self.token(namespace)
        url = f"{location.base}{path}"
        out = dict(headers or {})
        if location.via_api_server:
            assert self.kube is not None
            out[PROXIED_AUTHORIZATION] = f"Bearer {token}"
            return self.kube.events if events else self.kube.http, url, out
        assert self.direct is not None
        out["Authorization"] = f"Bearer {token}"
        return self.direct, url, out

    async def call(
        self, namespace: str, method: str, path: str, *, json_body: Any = None
    ) -> httpx.Response:
        """One call of the gateway's own API outside a sandbox's (`path` from its
        root, e.g. `/v1/namespaces/NS/e2bkeys`), as this client, not retried (it
        may not be idempotent)."""
        http, url, hdrs = await self._prepare_path(namespace, path, None)
        body = None
        if json_body is not None:
            body = json.dumps(json_body).encode()
            hdrs["Content-Type"] = "application/json"
        timeout = httpx.Timeout(self.timeout, connect=10)
        try:
            response = await http.request(method, url, content=body, headers=hdrs, timeout=timeout)
        except httpx.TimeoutException as exc:
            raise ServerError(f"{method} {path}: no answer in time ({exc})") from exc
        except httpx.TransportError as exc:
            raise ServerError(f"the gateway could not be reached: {exc}") from exc
        if response.status_code >= 400:
            raise _error_of(response, self.location)
        return response

    async def request(
        self,
        namespace: str,
        name: str,
        method: str,
        tail: str,
        *,
        json_body: Any = None,
        params: dict[str, str] | None = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        retry: bool = True,
    ) -> httpx.Response:
        """One call; retried (same body, so the same idempotency key) while the
        answer says nothing happened, or, when `retry`, the connection failed."""
        http, url, hdrs = await self._prepare(namespace, name, tail, headers)
        body = content
        if json_body is not None:
            body = json.dumps(json_body).encode()
            hdrs["Content-Type"] = "application/json"
        request_timeout = httpx.Timeout(self.timeout if timeout is None else timeout, connect=10)
        for attempt in range(len(_BACKOFF) + 1):
            last = attempt == len(_BACKOFF)
            try:
                response = await http.request(
                    method, url, content=body, params=params, headers=hdrs, timeout=request_timeout
                )
            except httpx.TimeoutException as exc:
                raise ServerError(f"{method} {tail}: no answer in time ({exc})") from exc
            except httpx.TransportError as exc:
                if not retry or last:
                    raise ServerError(f"the gateway could not be reached: {exc}") from exc
                await sleep(_BACKOFF[attempt])
                continue
            if response.status_code < 400:
                return response
            error = _error_of(response, self.location)
            transient = response.status_code in _RETRY_STATUS or error.code in _RETRY_CODES
            if not transient or last:
                raise error
            await sleep(_BACKOFF[attempt])
        raise AssertionError("unreachable")

    @asynccontextmanager
    async def stream(
        self,
        namespace: str,
        name: str,
        method: str,
        tail: str,
        *,
        json_body: Any = None,
        params: dict[str, str] | None = None,
        content: Any = None,
        headers: dict[str, str] | None = None,
        read_timeout: float | None = None,
    ) -> AsyncIterator[httpx.Response]:
        """A streamed call: the response is open inside the `with`; errors raised.
        A JSON body asks for an event stream: HTTP/2 through the API server."""
        http, url, hdrs = await self._prepare(
            namespace, name, tail, headers, events=json_body is not None
        )
        body = content
        if json_body is not None:
            body = json.dumps(json_body).encode()
            hdrs["Content-Type"] = "application/json"
        timeout = httpx.Timeout(self.timeout, connect=10, read=read_timeout)
        try:
            async with http.stream(
                method, url, content=body, params=params, headers=hdrs, timeout=timeout
            ) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise _error_of(response, self.location)
                yield response
        except httpx.TransportError as exc:
            raise ServerError(f"{method} {tail}: the stream broke off: {exc}") from exc

    async def websocket(
        self, namespace: str, name: str, tail: str, *, params: dict[str, str] | None = None
    ) -> AsyncWebSocket:
        """A WebSocket to the agent's `tail` (a GET that upgrades), on the way this
        client reaches the gateway, whichever it is: each carries an upgrade (the
        API server's service proxy passes it on to the Service). Refusals raise
        as `request`'s do, after the same retries (opening one starts nothing);
        an answer that is not an upgrade (something on the way dropped the
        `Upgrade` header: the gateway's 426, or a 2xx of a proxy that does not
        speak WebSocket) raises ServerError with code `websocket_required`."""
        # wsproto and the framing: for terminal attachments alone, kept off the
        # start-up of every other command.
        from sandbox_sdk._async.websocket import AsyncWebSocket, handshake

        http, url, hdrs = await self._prepare(namespace, name, tail, None)
        timeout = httpx.Timeout(self.timeout, connect=10)
        for attempt in range(len(_BACKOFF) + 1):
            last = attempt == len(_BACKOFF)
            try:
                opened = await handshake(http, url, params=params, headers=hdrs, timeout=timeout)
            except httpx.TimeoutException as exc:
                raise ServerError(f"GET {tail}: no answer in time ({exc})") from exc
            except httpx.TransportError as exc:
                if last:
                    raise ServerError(f"the gateway could not be reached: {exc}") from exc
                await sleep(_BACKOFF[attempt])
                continue
            if isinstance(opened, AsyncWebSocket):
                return opened
            if opened.status_code < 400:
                raise ServerError(
                    f"GET {tail}: HTTP {opened.status_code} instead of a WebSocket (something"
                    " between here and the gateway does not pass WebSocket upgrades on)",
                    status=opened.status_code,
                    code=AgentErrorCode.WEBSOCKET_REQUIRED,
                )
            error = _error_of(opened, self.location)
            transient = opened.status_code in _RETRY_STATUS or error.code in _RETRY_CODES
            if not transient or last:
                raise error
            await sleep(_BACKOFF[attempt])
        raise AssertionError("unreachable")


def _error_of(response: httpx.Response, location: Location | None = None) -> SandboxError:
    try:
        body = response.json()
    except ValueError:
        body = None
    error = from_response(
        response.status_code, body, f"HTTP {response.status_code}: {response.text[:300]}"
    )
    if location is not None and location.via_api_server and _proxy_refused(error):
        # RBAC of the proxy itself, before the gateway saw anything: say what opens it.
        ns, name, port = location.service or DEFAULT_SERVICE
        hint = (
            f". The SDK reaches the gateway through the API server's service proxy,"
            f" which needs get/create on services/proxy 'http:{name}:{port}' in namespace"
            f" {ns}: the chart grants it to the groups of its value"
            f" gateway.serviceProxyGroups (default system:authenticated; an admin may"
            f" have emptied it), or reach the gateway directly with gateway_url= (or"
            f" $SANDBOX_GATEWAY_URL, e.g. the chart's gateway.externalURL)"
        )
        return Forbidden(
            error.message + hint, status=error.status, code=error.code, details=error.details
        )
    return error


def _proxy_refused(error: SandboxError) -> bool:
    """The API server's 403 for the service proxy (a Kubernetes Status about
    `services`), not the gateway's own 403 (`{"error": ...}`), which is about the
    sandbox and already names the permission it lacks."""
    return error.status == 403 and error.details.get("kind") == "services"
