"""Create, read and wait on Snapshots: shared by the integration and e2e tiers."""

from __future__ import annotations

from tests.kube import JSON, api_path
from tests.resources import Resources

VOLUME_SNAPSHOTS = "snapshot.storage.k8s.io/v1"
FINAL = ("Ready", "Failed")


class Snapshots(Resources):
    """Snapshots of one namespace."""

    kind = "Snapshot"
    plural = "snapshots"

    def create(self, name: str, sandbox: str, **spec: object) -> JSON:
        return self.create_with(name, {"sandboxRef": {"name": sandbox}, **spec})

    def list(self, label_selector: str) -> list[JSON]:
        return self.kube.list(self.path(), label_selector)

    def condition(self, name: str, kind: str = "Ready") -> JSON | None:
        return super().condition(name, kind)

    def wait_phase(self, name: str, phase: str, timeout: float = 120) -> JSON:
        """The Snapshot once in `phase`; fails at once if it ends in the other final phase."""

        def reached(status: JSON) -> bool:
            if status.get("phase") in FINAL and status["phase"] != phase:
                raise AssertionError(
                    f"snapshot {name} ended {status['phase']}, not {phase}: {status}"
                )
            return status.get("phase") == phase

        return self.wait_object(name, f"phase {phase}", reached, timeout, interval=0.5)

    def volume_snapshot(self, name: str) -> JSON | None:
        return self.kube.get(api_path(VOLUME_SNAPSHOTS, "volumesnapshots", self.namespace, name))
