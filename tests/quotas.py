"""SandboxQuotas and the objects they refuse: shared by the integration and e2e tiers."""

from __future__ import annotations

from tests.kube import JSON
from tests.resources import Resources


class SandboxQuotas(Resources):
    """SandboxQuotas of one namespace."""

    kind = "SandboxQuota"
    plural = "sandboxquotas"

    def create(self, name: str, spec: JSON) -> JSON:
        return self.create_with(name, spec)

    def wait_used(self, name: str, what: str, key: str, value: object, timeout: float = 30) -> JSON:
        """The status once `status.used[key]` is `value`."""
        body = self.wait_object(
            name,
            f"{what}: used.{key} = {value}",
            lambda s: (s.get("used") or {}).get(key) == value,
            timeout,
        )
        status: JSON = body["status"]
        return status


def ready_reason(status: JSON) -> tuple[str, str]:
    """The (reason, message) of a Sandbox's Ready condition."""
    for cond in status.get("conditions", []):
        if cond["type"] == "Ready":
            return cond.get("reason", ""), cond.get("message", "")
    return "", ""


def quota_exceeded(status: JSON) -> bool:
    return ready_reason(status)[0] == "QuotaExceeded"
