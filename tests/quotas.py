"""SandboxQuotas and the objects they refuse: shared by the integration and e2e tiers."""

from __future__ import annotations

from tests.integration.harness import wait_for
from tests.kube import JSON, KubeJSON, core_path
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


def resource_quota(kube: KubeJSON, namespace: str, name: str, hard: dict[str, str]) -> str:
    """Create a Kubernetes ResourceQuota and wait until the API server counts with it
    (until then it admits everything); its path."""
    kube.create(
        core_path("resourcequotas", namespace),
        {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": name},
            "spec": {"hard": hard},
        },
    )
    path = core_path("resourcequotas", namespace, name)
    wait_for(
        lambda: (kube.get(path) or {}).get("status", {}).get("hard"), 30, f"quota {name} counted"
    )
    return path
