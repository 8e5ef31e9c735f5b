"""A small client of the sandbox agent for the end-to-end tests (the real HTTP API)."""

from __future__ import annotations

from typing import Any

import httpx

from tests.integration.harness import wait_for
from tests.kube import JSON, KubeJSON, core_path


class Agent:
    """The agent of one sandbox, reached at its pod IP with the token from its Secret."""

    def __init__(self, endpoint: str, token: str) -> None:
        self.endpoint = endpoint
        self._http = httpx.Client(
            base_url=endpoint, headers={"Authorization": f"Bearer {token}"}, timeout=120
        )

    @classmethod
    def of(cls, kube: KubeJSON, namespace: str, sandbox: str) -> Agent:
        import base64

        body = kube.read(f"/apis/sandbox.dev/v1alpha1/namespaces/{namespace}/sandboxes/{sandbox}")
        endpoint = body["status"]["agentEndpoint"]
        # A Sandbox that claimed a pool member is served by the member's pod and token.
        served_by = (body["status"].get("pool") or {}).get("member") or sandbox
        secret = kube.read(core_path("secrets", namespace, f"{served_by}-agent-token"))
        return cls(endpoint, base64.b64decode(secret["data"]["token"]).decode())

    def run(self, argv: list[str] | None = None, *, shell: str | None = None, **extra: Any) -> JSON:
        """Run to completion; the Execution record with captured output."""
        body: JSON = {**extra}
        if shell is not None:
            body["command"] = shell
        else:
            body["argv"] = argv
        response = self._http.post("/v1/executions", json=body)
        assert response.status_code in (200, 201), response.text
        result: JSON = response.json()
        return result

    def post(self, path: str, body: JSON, timeout: float = 120) -> httpx.Response:
        """One authenticated POST, whatever it answers."""
        return self._http.post(path, json=body, timeout=timeout)

    def start(self, shell: str) -> JSON:
        """Start a command in the background; its Execution record (status running)."""
        response = self._http.post("/v1/executions", json={"command": shell, "background": True})
        assert response.status_code == 202, response.text
        result: JSON = response.json()
        return result

    def execution(self, execution_id: str) -> JSON:
        """The agent's record of one execution."""
        response = self._http.get(f"/v1/executions/{execution_id}")
        assert response.status_code == 200, response.text
        result: JSON = response.json()
        return result

    def write(self, path: str, content: str) -> None:
        response = self._http.post(
            "/v1/files/write", json={"path": path, "content": content, "parents": True}
        )
        assert response.status_code in (200, 201), response.text

    def read(self, path: str) -> str:
        response = self._http.get("/v1/files/content", params={"path": path})
        assert response.status_code == 200, response.text
        return response.text

    def ready(self) -> bool:
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = 60) -> None:
        wait_for(self.ready, timeout, f"agent at {self.endpoint}")

    def close(self) -> None:
        self._http.close()
