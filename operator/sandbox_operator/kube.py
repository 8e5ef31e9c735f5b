"""A small async Kubernetes API client on aiohttp.

The `kubernetes` package resolves credentials (kubeconfig or in-cluster
service account); requests go through one pooled aiohttp session, so the Kopf
event loop never blocks on I/O and no response is deserialised into generated
model classes we would only turn back into dicts.

Why aiohttp and not httpx (which the agent client uses): with a thousand
Sandboxes reconciling at once, httpcore's connection pool spent about 90% of
the operator's CPU matching queued requests to connections (measured with
py-spy during `benchmarks/sandbox_scale.py`). aiohttp is already installed as
Kopf's own HTTP client, so this adds no dependency.
"""

from __future__ import annotations

import json
import os
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from sandbox_operator import wirejson
from sandbox_operator.resources import EVENTS

JSON = dict[str, Any]

_IN_CLUSTER_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
_TOKEN_REREAD_SECONDS = 60.0

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
_METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


def status_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any] | None:
    """The merge patch that turns status `old` into `new`; None when nothing changed
    (every write costs the API server). Keys gone from `new` are nulled: a merge
    patch would keep them otherwise."""
    if new == old:
        return None
    return {"status": {**{k: None for k in old if k not in new}, **new}}


async def newest_warning(kube: Api, namespace: str, selector: str) -> JSON | None:
    """The newest Warning Event in `namespace` matching a field selector
    (involvedObject.*, reason): what the cluster recorded about an object."""
    listed = await kube.get(
        EVENTS.path(namespace), params={"fieldSelector": f"{selector},type=Warning"}
    )
    items = (listed or {}).get("items") or []
    if not items:
        return None
    newest: JSON = max(items, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return newest


@dataclass(frozen=True)
class Response:
    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        return wirejson.loads(self.content)


class KubeError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class ShuttingDown(ConnectionError):
    """The operator is stopping and its clients are closed: nothing more is sent. A
    ConnectionError, so a handler still running then is retried (by the next
    process) like one that lost the API server, not logged as a bug."""

    def __init__(self, client: str) -> None:
        super().__init__(f"the operator is shutting down; the {client} client is closed")


class Refused(KubeError):
    """The API server refused to create an object (a 4xx other than 409 and 429)."""

    def __init__(self, error: KubeError, kind: str, name: str) -> None:
        super().__init__(error.status, error.reason, error.message)
        self.kind = kind
        self.name = name

    @property
    def permanent(self) -> bool:
        """The same object will be refused again (invalid), unlike a quota or a policy
        refusal (403), which can change without the object changing."""
        return self.status in (400, 422)

    @property
    def quota(self) -> bool:
        """A ResourceQuota has no room (403 Forbidden, "exceeded quota: ..."): the
        message names the quota, the request, the usage and the limit."""
        return self.status == 403 and "exceeded quota" in self.message

    def __str__(self) -> str:
        return f"the API server refused to create {self.kind} {self.name}: {self.message}"


class Api(Protocol):
    """The few calls the controllers make: what a test double has to provide."""

    async def get(self, path: str, params: dict[str, str] | None = None) -> JSON | None: ...

    async def create(self, path: str, body: JSON) -> JSON | None: ...

    async def patch(self, path: str, body: Any, content_type: str = ...) -> JSON | None: ...

    async def delete(
        self,
        path: str,
        *,
        grace_seconds: int | None = None,
        propagation: str = "Background",
        uid: str | None = None,
        resource_version: str | None = None,
    ) -> bool: ...

    async def close(self) -> None: ...


class Kube:
    def __init__(
        self,
        base_url: str,
        verify: ssl.SSLContext | bool,
        token: str | None = None,
        token_file: Path | None = None,
        connections: int = 64,
    ) -> None:
        self._connections = connections
        self._token = token
        self._token_file = token_file
        self._token_read_at = 0.0
        self._base_url = base_url.rstrip("/")
        self._verify = verify
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _http(self) -> aiohttp.ClientSession:
        if self._closed:
            raise ShuttingDown("Kubernetes API")
        # Created lazily: an aiohttp session belongs to the running event loop.
        if self._session is None:
            # At most `connections` requests in flight; the rest wait their turn for a
            # connection, unbounded: a deadline that counts the wait failed
            # requests that never left this process (TimeoutError from a
            # handler, retried minutes later, at 3,000 Sandboxes). Once sent, a
            # request has 30 s between reads of its answer.
            connector = aiohttp.TCPConnector(ssl=self._verify, limit=self._connections)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=30),
            )
        return self._session

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None, connections: int = 64) -> Kube:
        """In-cluster credentials when running in a pod, else the kubeconfig
        (`kubeconfig`, else $KUBECONFIG read now, not when `kubernetes` was imported)."""
        configuration = k8s_client.Configuration()
        in_cluster = _IN_CLUSTER_TOKEN.exists()
        if in_cluster:
            k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig or os.environ.get("KUBECONFIG"),
                client_configuration=configuration,
            )
        context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
        if configuration.cert_file:
            context.load_cert_chain(configuration.cert_file, configuration.key_file)
        token = None
        auth = configuration.api_key.get("authorization") or configuration.api_key.get(
            "BearerToken"
        )
        if auth:
            token = auth.removeprefix("Bearer ").strip()
        return cls(
            configuration.host,
            context if configuration.verify_ssl else False,
            token=token,
            # Projected service-account tokens rotate: re-read the file, never cache forever.
            token_file=_IN_CLUSTER_TOKEN if in_cluster else None,
            connections=connections,
        )

    def _headers(self) -> dict[str, str]:
        if self._token_file and time.monotonic() - self._token_read_at > _TOKEN_REREAD_SECONDS:
            self._token = self._token_file.read_text().strip()
            self._token_read_at = time.monotonic()
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
        accept: str | None = None,
    ) -> Response:
        headers = self._headers()
        if accept is not None:
            headers["Accept"] = accept
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body).encode()
        async with self._http().request(
            method, self._base_url + path, data=data, params=params, headers=headers
        ) as response:
            return Response(response.status, await response.read())

    async def watch(
        self, path: str, params: dict[str, str] | None = None, *, timeout_seconds: int = 300
    ) -> AsyncIterator[JSON]:
        """The watch events (`{"type", "object"}`) of a collection from
        `params["resourceVersion"]`, until the server ends the watch (after about
        `timeout_seconds`). KubeError for an error answer; an ERROR event (410
        Gone: the version is too old) is yielded for the caller to relist."""
        query = {**(params or {}), "watch": "1", "timeoutSeconds": str(timeout_seconds)}
        timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_seconds + 30)
        async with self._http().get(
            self._base_url + path, params=query, headers=self._headers(), timeout=timeout
        ) as response:
            if response.status >= 400:
                self._raise(Response(response.status, await response.read()))
            # One JSON document per line; objects can exceed aiohttp's line limit.
            pending = b""
            async for chunk in response.content.iter_any():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        event: JSON = wirejson.loads(line)
                        yield event

    @staticmethod
    def _raise(response: Response) -> None:
        try:
            payload = response.json()
            reason, message = payload.get("reason", ""), payload.get("message", response.text)
        except ValueError:
            reason, message = "", response.text
        raise KubeError(response.status_code, reason, message)

    def _object(self, response: Response, absent: int) -> JSON | None:
        """The object in a response; None for the `absent` status; KubeError otherwise."""
        if response.status_code == absent:
            return None
        if response.status_code >= 400:
            self._raise(response)
        result: JSON = response.json()
        return result

    async def get(self, path: str, params: dict[str, str] | None = None) -> JSON | None:
        """The object, or None when it does not exist."""
        return self._object(await self.request("GET", path, params=params), absent=404)

    async def list_metadata(self, path: str, params: dict[str, str] | None = None) -> list[JSON]:
        """The metadata of every object of a collection, in pages of 500: the API
        server sends each object's metadata alone (PartialObjectMetadata), a
        fraction of what a full listing of pods or Sandboxes costs it."""
        found: list[JSON] = []
        query = {**(params or {}), "limit": "500"}
        while True:
            response = await self.request("GET", path, params=query, accept=_METADATA_LIST)
            if response.status_code >= 400:
                self._raise(response)
            page = response.json()
            found += [item["metadata"] for item in page.get("items") or []]
            more = (page.get("metadata") or {}).get("continue")
            if not more:
                return found
            query["continue"] = more

    async def create(self, path: str, body: JSON) -> JSON | None:
        """Create; None when it already exists (409), so callers stay idempotent.
        Raises Refused when the API server will not have it (invalid, quota, policy)."""
        try:
            return self._object(await self.request("POST", path, body=body), absent=409)
        except KubeError as exc:
            if 400 <= exc.status < 500 and exc.status != 429:
                name = body.get("metadata", {}).get("name", "")
                raise Refused(exc, body.get("kind", "object"), name) from exc
            raise

    async def patch(self, path: str, body: Any, content_type: str = MERGE_PATCH) -> JSON | None:
        """Patch; None when the object is gone."""
        response = await self.request("PATCH", path, body=body, content_type=content_type)
        return self._object(response, absent=404)

    async def delete(
        self,
        path: str,
        *,
        grace_seconds: int | None = None,
        propagation: str = "Background",
        uid: str | None = None,
        resource_version: str | None = None,
    ) -> bool:
        """Delete; False when it was already gone (or, with preconditions, changed).
        `uid` guards against a namesake; `resource_version` against any write since."""
        body: JSON = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        preconditions = {
            key: value
            for key, value in (("uid", uid), ("resourceVersion", resource_version))
            if value
        }
        if preconditions:
            body["preconditions"] = preconditions
        response = await self.request("DELETE", path, body=body)
        if response.status_code in (404, 409):
            return False
        if response.status_code >= 400:
            self._raise(response)
        return True

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
