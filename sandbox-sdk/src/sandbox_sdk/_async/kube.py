"""A small async client of the Kubernetes API: JSON in, JSON out, over httpx."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from sandbox_sdk.config import ClusterConfig
from sandbox_sdk.errors import SandboxError, ServerError, from_response

JSON = dict[str, Any]
GROUP = "sandbox.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
MERGE_PATCH = "application/merge-patch+json"


def resource_path(plural: str, namespace: str, name: str | None = None) -> str:
    base = f"/apis/{API_VERSION}/namespaces/{namespace}/{plural}"
    return f"{base}/{name}" if name else base


def core_path(
    plural: str, namespace: str | None = None, name: str | None = None, sub: str = ""
) -> str:
    path = f"/api/v1/namespaces/{namespace}/{plural}" if namespace else f"/api/v1/{plural}"
    if name:
        path += f"/{name}"
    return path + (f"/{sub}" if sub else "")


class _BearerAuth(httpx.Auth):
    """The current token of the source on every request (sources re-read rotated
    files and refresh exec-plugin tokens themselves)."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config

    def auth_flow(self, request: httpx.Request) -> Any:
        source = self.config.credentials
        token = source.token() if source is not None else None
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        yield request


def _error(response: httpx.Response) -> SandboxError:
    try:
        body = response.json()
    except ValueError:
        body = None
    return from_response(
        response.status_code,
        body,
        f"{response.request.method} {response.request.url.path}: HTTP {response.status_code}"
        f" {response.text[:200]}",
    )


class AsyncKube:
    """The API server of a `ClusterConfig`."""

    def __init__(self, config: ClusterConfig, timeout: float = 30.0) -> None:
        self.config = config
        self.timeout = timeout
        self.http = self._client(config, timeout, http2=False)
        self._events: httpx.AsyncClient | None = None

    @staticmethod
    def _client(config: ClusterConfig, timeout: float, *, http2: bool) -> httpx.AsyncClient:
        # trust_env=False: an HTTP(S)_PROXY of the environment must not route a
        # cluster's API server (often on a private address) through a proxy.
        return httpx.AsyncClient(
            base_url=config.server,
            verify=config.ssl_context,
            auth=_BearerAuth(config),
            timeout=timeout,
            trust_env=False,
            http2=http2,
            headers={"Accept": "application/json", "User-Agent": "sandbox-sdk"},
        )

    @property
    def events(self) -> httpx.AsyncClient:
        """An HTTP/2 client for the API server, opened on first use, for a request
        with a body whose answer is an event stream (a code run, a command).
        Over HTTP/1.1 the API server's service proxy cuts such an answer now
        and then between two events (26 in 1,500 to a plain server that pauses
        between two chunks; none over HTTP/2, and none for a GET or an empty
        body). Not for everything: httpx's HTTP/2 uploads crawl (2-3 MiB/s
        against 70-100 over HTTP/1.1), and a WebSocket needs HTTP/1.1's upgrade."""
        if self._events is None:
            self._events = self._client(self.config, self.timeout, http2=True)
        return self._events

    async def aclose(self) -> None:
        await self.http.aclose()
        if self._events is not None:
            await self._events.aclose()

    async def request(
        self,
        method: str,
        path: str,
        body: JSON | None = None,
        *,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> JSON:
        try:
            response = await self.http.request(
                method,
                path,
                content=None if body is None else json.dumps(body).encode(),
                params=params,
                headers={"Content-Type": content_type} if body is not None else None,
            )
        except httpx.TransportError as exc:
            raise ServerError(
                f"the API server {self.config.server} could not be reached: {exc}"
            ) from exc
        if response.status_code >= 400:
            raise _error(response)
        payload = response.json() if response.content else {}
        return payload if isinstance(payload, dict) else {"items": payload}

    async def get(self, path: str, params: dict[str, str] | None = None) -> JSON:
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: JSON) -> JSON:
        return await self.request("POST", path, body)

    async def patch(self, path: str, body: JSON) -> JSON:
        return await self.request("PATCH", path, body, content_type=MERGE_PATCH)

    async def delete(self, path: str) -> JSON:
        return await self.request("DELETE", path)

    async def list(self, path: str, params: dict[str, str] | None = None) -> list[JSON]:
        items: list[JSON] = []
        query = dict(params or {})
        while True:
            page = await self.get(path, query)
            items.extend(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items
            query["continue"] = token

    async def watch(
        self, path: str, params: dict[str, str], timeout_seconds: float
    ) -> AsyncIterator[JSON]:
        """Watch events of a collection until the server ends the watch."""
        query = {**params, "watch": "1", "timeoutSeconds": str(max(1, int(timeout_seconds)))}
        timeout = httpx.Timeout(10.0, read=timeout_seconds + 30)
        async with self.http.stream("GET", path, params=query, timeout=timeout) as response:
            if response.status_code >= 400:
                await response.aread()
                raise _error(response)
            async for line in response.aiter_lines():
                if line:
                    yield json.loads(line)
