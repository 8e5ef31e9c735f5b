"""httpx client for checkpointd, the node component that saves a gVisor pod
whole (docs/pause-memory.md).

One checkpointd runs on every gVisor node (the chart's DaemonSet); the
operator asks the one on a pod's node, found by its labels and node name. It
authenticates with a service account token for the audience
`sandbox-checkpointd` (a projected volume; re-read at every call, as the
kubelet rotates it). Images are named by the UID of the pod they were taken
from: a retried save, or one whose answer was lost, finds its image again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sandbox_operator.api.sandbox import SandboxReason
from sandbox_operator.config import Settings
from sandbox_operator.kube import Api
from sandbox_operator.resources import PODS

# The labels of checkpointd's pods (charts/sandbox-operator/templates/checkpointd.yaml).
NAME_LABEL = "app.kubernetes.io/name=sandbox-checkpointd"
# A save of a large sandbox writes its memory to disk: a minute per few GiB.
TAKE_SECONDS = 600.0
# Condition reasons (MemoryKept) of what went wrong.
UNAVAILABLE = SandboxReason.CHECKPOINTER_UNAVAILABLE.value
FAILED = SandboxReason.CHECKPOINT_FAILED.value


class CheckpointError(Exception):
    """A save, a description or a removal did not happen; `reason` is a condition
    reason (CheckpointerUnavailable: no checkpointd answered; CheckpointFailed:
    it answered no)."""

    def __init__(self, reason: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.code = code


@dataclass(frozen=True)
class Image:
    namespace: str
    key: str
    bytes: int
    restorable: bool = True


class Checkpoints:
    def __init__(self, settings: Settings, kube: Api) -> None:
        self.settings = settings
        self.kube = kube
        self._http = httpx.AsyncClient(timeout=settings.agent_timeout_seconds)

    async def close(self) -> None:
        await self._http.aclose()

    async def endpoint(self, node: str) -> str:
        """checkpointd's address on `node`: its ready pod there."""
        namespace = self.settings.checkpointd_namespace
        listed = await self.kube.get(
            PODS.path(namespace),
            params={"labelSelector": NAME_LABEL, "fieldSelector": f"spec.nodeName={node}"},
        )
        for pod in (listed or {}).get("items", []):
            status = pod.get("status") or {}
            ready = any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or []
            )
            if ready and status.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
                return f"http://{status['podIP']}:{self.settings.checkpointd_port}"
        raise CheckpointError(
            UNAVAILABLE,
            f"no ready checkpointd on node {node} (namespace {namespace}): is the chart's"
            " checkpointd.enabled set, and does its DaemonSet run there?",
        )

    def _token(self) -> str:
        path = Path(self.settings.checkpointd_token_file)
        try:
            token = path.read_text().strip()
        except OSError as exc:
            raise CheckpointError(
                UNAVAILABLE, f"cannot read the token for checkpointd: {exc}"
            ) from exc
        if not token:
            raise CheckpointError(UNAVAILABLE, f"{path} is empty")
        return token

    async def _call(
        self, method: str, node: str, path: str, body: Any = None, seconds: float | None = None
    ) -> httpx.Response:
        url = await self.endpoint(node) + path
        try:
            response = await self._http.request(
                method,
                url,
                json=body,
                headers={"Authorization": f"Bearer {self._token()}"},
                timeout=seconds if seconds is not None else self._http.timeout,
            )
        except httpx.HTTPError as exc:
            raise CheckpointError(
                UNAVAILABLE, f"checkpointd on node {node} unreachable: {exc!r}"
            ) from exc
        if response.status_code >= 300 and response.status_code != 404:
            code, message = None, response.text[:300]
            try:
                error = response.json()["error"]
                code, message = str(error["code"]), str(error["message"])
            except (ValueError, KeyError, TypeError):
                pass
            # Refused credentials are a deployment's fault, like a missing checkpointd.
            reason = UNAVAILABLE if response.status_code in (401, 403) else FAILED
            raise CheckpointError(
                reason, f"checkpointd on node {node}: {message} ({response.status_code})", code
            )
        return response

    async def take(self, node: str, namespace: str, pod_uid: str) -> Image:
        """Save the pod (it stops for good: the caller deletes it next)."""
        body = {"namespace": namespace, "podUID": pod_uid, "key": pod_uid}
        response = await self._call("POST", node, "/v1/checkpoints", body, TAKE_SECONDS)
        if response.status_code == 404:
            raise CheckpointError(
                FAILED, f"checkpointd on node {node} knows no sandbox of pod {pod_uid}"
            )
        return Image(namespace, pod_uid, int(response.json().get("bytes", 0)))

    async def describe(self, node: str, namespace: str, key: str) -> Image | None:
        """The image, None when there is none."""
        response = await self._call("GET", node, f"/v1/checkpoints/{namespace}/{key}")
        if response.status_code == 404:
            return None
        data = response.json()
        return Image(namespace, key, int(data.get("bytes", 0)), bool(data.get("restorable")))

    async def drop(self, node: str, namespace: str, key: str) -> None:
        """Delete the image (gone already is fine)."""
        await self._call("DELETE", node, f"/v1/checkpoints/{namespace}/{key}")
