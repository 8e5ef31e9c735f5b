"""Create, read and wait on Executions: shared by the integration and e2e tiers."""

from __future__ import annotations

from collections.abc import Callable

from sandbox_operator.api.execution import TERMINAL_PHASES
from tests.kube import JSON
from tests.resources import Resources


class Executions(Resources):
    """Executions of one namespace."""

    kind = "Execution"
    plural = "executions"

    def create(self, name: str, spec: JSON) -> JSON:
        return self.create_with(name, spec)

    def run(self, name: str, sandbox: str, script: str, **spec: object) -> JSON:
        """An Execution of a shell script in a sandbox."""
        return self.create(name, {"sandboxRef": {"name": sandbox}, "script": script, **spec})

    def status(self, name: str) -> JSON:
        status: JSON = self.read(name).get("status") or {}
        return status

    def statuses(self, names: list[str]) -> list[JSON]:
        """The statuses of `names`, all from one list call: one moment of the cluster
        (reading them one by one would mix moments and count a run twice)."""
        by_name = {
            i["metadata"]["name"]: i.get("status") or {} for i in self.kube.list(self.path())
        }
        return [by_name.get(name, {}) for name in names]

    def wait_status(
        self, name: str, what: str, test: Callable[[JSON], bool], timeout: float = 30
    ) -> JSON:
        """The status once `test(status)` holds."""
        status: JSON = self.wait_object(name, what, test, timeout)["status"]
        return status

    def wait_phase(self, name: str, phase: str, timeout: float = 30) -> JSON:
        return self.wait_status(name, f"phase {phase}", lambda s: s.get("phase") == phase, timeout)

    def wait_done(self, name: str, timeout: float = 60) -> JSON:
        return self.wait_status(
            name, "a terminal phase", lambda s: s.get("phase") in TERMINAL_PHASES, timeout
        )
