"""A small synchronous JSON client of the Kubernetes API, for tests and scripts.

Dicts in, dicts out: objects are read and written as the API server's JSON, so
tests index them the way the server spells them (`pod["metadata"]["uid"]`)
instead of going through the `kubernetes` package's generated models, whose
every attribute is Optional. The `kubernetes` package only resolves the
kubeconfig's credentials; requests go through one httpx.Client.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from sandbox_operator.resources import Resource

JSON = dict[str, Any]

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


class ApiError(Exception):
    """A response of status >= 400 (except a 404 from `get`).

    `body` is the server's JSON (a `Status` object as a rule), `{}` if the
    response was not a JSON object; `message` is its `message`, else the text.
    """

    def __init__(self, status: int, message: str, body: JSON) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.body = body


def api_path(
    api_version: str,
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """A REST path, built by the operator's own path function."""
    return Resource(api_version, plural).path(namespace, name, subresource)


def core_path(
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """A path in the core (`v1`) group, e.g. `core_path("pods", "ns", "p", "status")`."""
    return api_path("v1", plural, namespace, name, subresource)


def _error(response: httpx.Response) -> ApiError:
    try:
        payload = response.json()
    except ValueError:
        payload = None
    body: JSON = payload if isinstance(payload, dict) else {}
    message = body.get("message")
    return ApiError(
        response.status_code, message if isinstance(message, str) else response.text, body
    )


def _object(response: httpx.Response) -> JSON:
    if response.status_code >= 400:
        raise _error(response)
    payload = response.json()
    if not isinstance(payload, dict):
        raise ApiError(response.status_code, f"expected a JSON object, got {payload!r}", {})
    return payload


class KubeJSON:
    """The API server of a kubeconfig, spoken to in JSON."""

    def __init__(self, kubeconfig: Path | str, *, timeout: float = 30.0) -> None:
        cfg = k8s_client.Configuration()
        k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=str(kubeconfig), client_configuration=cfg
        )
        verify: ssl.SSLContext | bool = False
        if cfg.verify_ssl:
            context = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
            if cfg.cert_file:
                context.load_cert_chain(cfg.cert_file, cfg.key_file)
            verify = context
        headers = {"Accept": "application/json"}
        auth = cfg.api_key.get("BearerToken") or cfg.api_key.get("authorization")
        if auth:
            headers["Authorization"] = f"Bearer {auth.removeprefix('Bearer ').strip()}"
        self.server: str = cfg.host
        # trust_env=False: like the kubernetes package, ignore HTTP(S)_PROXY from
        # the environment (it would route a loopback API server through a proxy);
        # a kubeconfig's own proxy-url is still honoured.
        self._http = httpx.Client(
            base_url=cfg.host,
            verify=verify,
            headers=headers,
            timeout=timeout,
            proxy=cfg.proxy or None,
            trust_env=False,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> KubeJSON:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def get(self, path: str) -> JSON | None:
        """The object at `path`, or None when it does not exist (404)."""
        response = self._http.get(path)
        if response.status_code == 404:
            return None
        return _object(response)

    def read(self, path: str) -> JSON:
        """The object at `path`; ApiError (404) when it does not exist."""
        return _object(self._http.get(path))

    def create(self, path: str, body: JSON) -> JSON:
        """POST `body` to the collection (or subresource) at `path`."""
        return _object(self._http.post(path, json=body))

    def patch(self, path: str, body: JSON | list[JSON], content_type: str = MERGE_PATCH) -> JSON:
        """PATCH with a JSON merge patch, `STRATEGIC_MERGE_PATCH` for built-in kinds,
        or a JSON patch (a list of operations)."""
        return _object(self._http.patch(path, json=body, headers={"Content-Type": content_type}))

    def delete(self, path: str) -> None:
        """DELETE with the server's default propagation; ApiError on 404 too."""
        response = self._http.delete(path)
        if response.status_code >= 400:
            raise _error(response)

    def list(self, path: str, label_selector: str | None = None) -> list[JSON]:
        """The items of the collection at `path`, every page of it."""
        items: list[JSON] = []
        params: dict[str, str] = {}
        if label_selector is not None:
            params["labelSelector"] = label_selector
        while True:
            page = _object(self._http.get(path, params=params))
            items.extend(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items
            params["continue"] = token

    def watch(
        self,
        path: str,
        resource_version: str | None = None,
        timeout_seconds: int = 300,
    ) -> Iterator[JSON]:
        """The watch events (`{"type": ..., "object": ...}`) of the collection at
        `path`, as the server streams them, until it ends the watch after
        `timeout_seconds`. From `resource_version` when given, else from now
        (after the current state, which comes first as ADDED events)."""
        params: dict[str, str | int] = {"watch": 1, "timeoutSeconds": timeout_seconds}
        if resource_version is not None:
            params["resourceVersion"] = resource_version
        timeout = httpx.Timeout(self._http.timeout.connect, read=timeout_seconds + 30)
        with self._http.stream("GET", path, params=params, timeout=timeout) as response:
            if response.status_code >= 400:
                response.read()
                raise _error(response)
            for line in response.iter_lines():
                if line:
                    yield json.loads(line)
