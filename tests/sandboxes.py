"""Create, read and wait on Sandboxes: shared by the integration and e2e tiers."""

from __future__ import annotations

from sandbox_operator.api.common import GROUP, VERSION
from tests.integration.harness import wait_for
from tests.kube import JSON, KubeJSON, api_path


class Sandboxes:
    """Create, read and wait on Sandboxes of one namespace."""

    def __init__(self, kube: KubeJSON, namespace: str) -> None:
        self.kube = kube
        self.namespace = namespace

    def path(self, name: str | None = None) -> str:
        return api_path(f"{GROUP}/{VERSION}", "sandboxes", self.namespace, name)

    def create(self, name: str, spec: JSON | None = None) -> JSON:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "Sandbox",
            "metadata": {"name": name},
            "spec": spec or {},
        }
        return self.kube.create(self.path(), body)

    def get(self, name: str) -> JSON | None:
        return self.kube.get(self.path(name))

    def read(self, name: str) -> JSON:
        """The Sandbox; ApiError (404) when it does not exist."""
        return self.kube.read(self.path(name))

    def patch(self, name: str, body: JSON) -> None:
        self.kube.patch(self.path(name), body)

    def delete(self, name: str) -> None:
        self.kube.delete(self.path(name))

    def condition(self, name: str, kind: str) -> JSON | None:
        body = self.get(name) or {}
        for cond in (body.get("status") or {}).get("conditions", []):
            if cond["type"] == kind:
                result: JSON = cond
                return result
        return None

    def wait_phase(self, name: str, phase: str, timeout: float = 30) -> JSON:
        def reached() -> JSON | None:
            body = self.get(name)
            if body and (body.get("status") or {}).get("phase") == phase:
                return body
            return None

        return wait_for(reached, timeout, f"sandbox {name} phase {phase}")

    def wait_ready(self, name: str, timeout: float = 180) -> JSON:
        def ready() -> JSON | None:
            body = self.get(name) or {}
            conds = (body.get("status") or {}).get("conditions", [])
            ok = any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
            return body if ok else None

        return wait_for(ready, timeout, f"sandbox {self.namespace}/{name} Ready", interval=0.5)
