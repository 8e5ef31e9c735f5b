"""Create, read and wait on Executions: shared by the integration and e2e tiers."""

from __future__ import annotations

from collections.abc import Callable

from sandbox_operator.api.common import GROUP, VERSION
from sandbox_operator.api.execution import TERMINAL_PHASES
from tests.integration.harness import wait_for
from tests.kube import JSON, KubeJSON, api_path


class Executions:
    """Create, read and wait on Executions of one namespace."""

    def __init__(self, kube: KubeJSON, namespace: str) -> None:
        self.kube = kube
        self.namespace = namespace

    def path(self, name: str | None = None) -> str:
        return api_path(f"{GROUP}/{VERSION}", "executions", self.namespace, name)

    def create(self, name: str, spec: JSON) -> JSON:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "Execution",
            "metadata": {"name": name},
            "spec": spec,
        }
        return self.kube.create(self.path(), body)

    def run(self, name: str, sandbox: str, script: str, **spec: object) -> JSON:
        """An Execution of a shell script in a sandbox."""
        return self.create(name, {"sandboxRef": {"name": sandbox}, "script": script, **spec})

    def get(self, name: str) -> JSON | None:
        return self.kube.get(self.path(name))

    def status(self, name: str) -> JSON:
        status: JSON = (self.kube.read(self.path(name)).get("status")) or {}
        return status

    def patch(self, name: str, body: JSON) -> None:
        self.kube.patch(self.path(name), body)

    def delete(self, name: str) -> None:
        self.kube.delete(self.path(name))

    def condition(self, name: str, kind: str) -> JSON | None:
        for cond in self.status(name).get("conditions", []):
            if cond["type"] == kind:
                result: JSON = cond
                return result
        return None

    def wait_status(
        self, name: str, what: str, test: Callable[[JSON], bool], timeout: float = 30
    ) -> JSON:
        """The status once `test(status)` holds."""

        def reached() -> JSON | None:
            body = self.get(name)
            status = (body or {}).get("status") or {}
            return status if body and test(status) else None

        return wait_for(reached, timeout, f"execution {self.namespace}/{name}: {what}", 0.1)

    def wait_phase(self, name: str, phase: str, timeout: float = 30) -> JSON:
        return self.wait_status(name, f"phase {phase}", lambda s: s.get("phase") == phase, timeout)

    def wait_done(self, name: str, timeout: float = 60) -> JSON:
        return self.wait_status(
            name, "a terminal phase", lambda s: s.get("phase") in TERMINAL_PHASES, timeout
        )
