"""Create and read SandboxTemplates and ClusterSandboxTemplates: shared by the test tiers."""

from __future__ import annotations

from sandbox_operator.api.common import GROUP, VERSION
from tests.kube import JSON, KubeJSON, api_path
from tests.resources import Resources


class Templates(Resources):
    """SandboxTemplates of one namespace."""

    kind = "SandboxTemplate"
    plural = "sandboxtemplates"

    def create(self, name: str, spec: JSON) -> JSON:
        return self.create_with(name, spec)

    def wait_ready(self, name: str, timeout: float = 120) -> JSON:
        def ready(status: JSON) -> bool:
            conds = status.get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

        return self.wait_object(name, "Ready", ready, timeout, interval=0.5)

    def wait_reason(self, name: str, reason: str, timeout: float = 120) -> JSON:
        def has(status: JSON) -> bool:
            conds = status.get("conditions", [])
            return any(c["type"] == "Ready" and c["reason"] == reason for c in conds)

        return self.wait_object(name, f"Ready reason {reason}", has, timeout, interval=0.5)


def cluster_template_path(name: str | None = None) -> str:
    return api_path(f"{GROUP}/{VERSION}", "clustersandboxtemplates", None, name)


def create_cluster_template(kube: KubeJSON, name: str, spec: JSON) -> JSON:
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ClusterSandboxTemplate",
        "metadata": {"name": name},
        "spec": spec,
    }
    return kube.create(cluster_template_path(), body)
