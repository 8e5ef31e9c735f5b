"""Create, read and wait on Snapshots: shared by the integration and e2e tiers."""

from __future__ import annotations

from sandbox_operator.api.common import GROUP, VERSION
from tests.integration.harness import wait_for
from tests.kube import JSON, KubeJSON, api_path

VOLUME_SNAPSHOTS = "snapshot.storage.k8s.io/v1"


class Snapshots:
    """Snapshots of one namespace."""

    def __init__(self, kube: KubeJSON, namespace: str) -> None:
        self.kube = kube
        self.namespace = namespace

    def path(self, name: str | None = None) -> str:
        return api_path(f"{GROUP}/{VERSION}", "snapshots", self.namespace, name)

    def create(self, name: str, sandbox: str, **spec: object) -> JSON:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "Snapshot",
            "metadata": {"name": name},
            "spec": {"sandboxRef": {"name": sandbox}, **spec},
        }
        return self.kube.create(self.path(), body)

    def get(self, name: str) -> JSON | None:
        return self.kube.get(self.path(name))

    def delete(self, name: str) -> None:
        self.kube.delete(self.path(name))

    def list(self, label_selector: str) -> list[JSON]:
        return self.kube.list(self.path(), label_selector)

    def condition(self, name: str, kind: str = "Ready") -> JSON | None:
        for cond in ((self.get(name) or {}).get("status") or {}).get("conditions", []):
            if cond["type"] == kind:
                found: JSON = cond
                return found
        return None

    def wait_phase(self, name: str, phase: str, timeout: float = 120) -> JSON:
        def reached() -> JSON | None:
            body = self.get(name) or {}
            status = body.get("status") or {}
            if status.get("phase") == phase:
                return body
            if status.get("phase") in ("Ready", "Failed"):
                raise AssertionError(
                    f"snapshot {name} ended {status['phase']}, not {phase}: {body}"
                )
            return None

        return wait_for(reached, timeout, f"snapshot {self.namespace}/{name} {phase}", interval=0.5)

    def volume_snapshot(self, name: str) -> JSON | None:
        return self.kube.get(api_path(VOLUME_SNAPSHOTS, "volumesnapshots", self.namespace, name))
