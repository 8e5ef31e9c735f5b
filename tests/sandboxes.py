"""Create, read and wait on Sandboxes: shared by the integration and e2e tiers."""

from __future__ import annotations

from tests.kube import JSON
from tests.resources import Resources


class Sandboxes(Resources):
    """Sandboxes of one namespace."""

    kind = "Sandbox"
    plural = "sandboxes"

    def create(self, name: str, spec: JSON | None = None) -> JSON:
        return self.create_with(name, spec or {})

    def wait_phase(self, name: str, phase: str, timeout: float = 30) -> JSON:
        return self.wait_object(
            name, f"phase {phase}", lambda s: s.get("phase") == phase, timeout, interval=0.2
        )

    def wait_ready(self, name: str, timeout: float = 180) -> JSON:
        def ready(status: JSON) -> bool:
            conds = status.get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

        return self.wait_object(name, "Ready", ready, timeout, interval=0.5)
