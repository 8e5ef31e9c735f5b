"""What the E2B adapter's e2e tests share: the gateway's E2B listener they talk
to, namespaces with a user and a key, and sandboxes made through E2B's SDKs.

Which gateway (`target()`):
- SANDBOX_E2E_E2B_URL set: that E2B listener (and SANDBOX_E2E_GATEWAY_URL, the
  same gateway's main listener, where `e2b_` keys are minted), on the cluster
  of KUBECONFIG: e.g. `make up`'s (its gateway Service's ClusterIP, port 3000
  and 80); SANDBOX_E2E_E2B_TEMPLATE names the base template (default `base`).
- Otherwise the e2e tier's own cluster, whose chart is installed with
  gateway.e2b.enabled: the gateway Service's `e2b` and `http` ports.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx

from devcluster import deploy
from tests.integration.harness import wait_for
from tests.kube import ApiError, KubeJSON, api_path, core_path

URL_VARIABLE = "SANDBOX_E2E_E2B_URL"
GATEWAY_VARIABLE = "SANDBOX_E2E_GATEWAY_URL"
TEMPLATE_VARIABLE = "SANDBOX_E2E_E2B_TEMPLATE"
# What the e2e tier installs the chart with (tests/e2e/conftest.py).
CHART_VALUE = "gateway.e2b.enabled=true"
RBAC = "rbac.authorization.k8s.io/v1"
SANDBOXES = "/apis/sandbox.dev/v1alpha1/namespaces/{ns}/sandboxes"


@dataclass
class E2BTarget:
    """A gateway's E2B listener, its main listener, and the cluster behind them."""

    kube: KubeJSON
    url: str
    gateway: str
    template: str
    namespaces: list[str] = field(default_factory=list)

    def namespace(self) -> str:
        name = f"e2b-{uuid.uuid4().hex[:8]}"
        self.kube.create(core_path("namespaces"), deploy.restricted_namespace(name))
        wait_for(
            lambda: self.kube.get(core_path("serviceaccounts", name, "default")) is not None,
            30,
            f"default ServiceAccount in {name}",
        )
        self.namespaces.append(name)
        return name

    def account(self, ns: str, name: str, role: str | None = "user") -> None:
        """A ServiceAccount, bound in its namespace to the chart's `role` (or nothing)."""
        self.kube.create(
            core_path("serviceaccounts", ns), {"apiVersion": "v1", "metadata": {"name": name}}
        )
        if role:
            self.kube.create(
                api_path(RBAC, "rolebindings", ns),
                {
                    "apiVersion": RBAC,
                    "kind": "RoleBinding",
                    "metadata": {"name": f"{name}-{role}"},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": role if role in ("edit", "admin") else f"{deploy.RELEASE}-{role}",
                    },
                    "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
                },
            )

    def token(self, ns: str, name: str) -> str:
        issued = self.kube.create(
            core_path("serviceaccounts", ns, name, "token"),
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}},
        )
        token: str = issued["status"]["token"]
        return token

    def mint(self, ns: str, account: str, minter: str) -> dict[str, str]:
        """An `e2b_` key for `account`, minted on the main listener by `minter`'s token."""
        answer = httpx.post(
            f"{self.gateway}/v1/namespaces/{ns}/e2bkeys",
            headers={"Authorization": f"Bearer {minter}"},
            json={"serviceAccount": account},
            timeout=30,
        )
        assert answer.status_code == 201, answer.text
        minted: dict[str, str] = answer.json()
        return minted

    def opts(self, key: str) -> dict[str, Any]:
        """The SDK's connection options: what E2B_API_KEY, E2B_API_URL and
        E2B_SANDBOX_URL would say."""
        return {"api_key": key, "api_url": self.url, "sandbox_url": self.url}

    def env(self, key: str) -> dict[str, str]:
        """The same as the environment variables a user sets."""
        return {"E2B_API_KEY": key, "E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url}

    def user(self) -> tuple[str, str]:
        """A fresh namespace with a ServiceAccount bound to the user role, and its
        token (an E2B key as a Kubernetes token)."""
        ns = self.namespace()
        self.account(ns, "worker")
        return ns, self.token(ns, "worker")

    def sandboxes(self, ns: str) -> list[str]:
        return [s["metadata"]["name"] for s in self.kube.list(SANDBOXES.format(ns=ns))]

    def sandbox(self, ns: str, name: str) -> dict[str, Any] | None:
        return self.kube.get(f"{SANDBOXES.format(ns=ns)}/{name}")

    def cleanup(self, names: list[str] | None = None) -> None:
        """Delete `names` (default: every namespace made here), and wait for them."""
        doomed = list(self.namespaces if names is None else names)
        for name in doomed:
            with contextlib.suppress(ApiError):
                self.kube.delete(core_path("namespaces", name=name))
        for name in doomed:
            wait_for(partial(self._gone, name), 120, f"namespace {name} deleted")
        self.namespaces[:] = [n for n in self.namespaces if n not in doomed]

    def _gone(self, namespace: str) -> bool:
        return self.kube.get(core_path("namespaces", name=namespace)) is None


def chart_urls(kube: KubeJSON) -> tuple[str, str]:
    """(main, e2b) URLs of the chart's gateway Service by its ClusterIP (the tests
    run on the node)."""
    service = kube.read(core_path("services", deploy.NAMESPACE, f"{deploy.RELEASE}-gateway"))
    ports = {p.get("name"): p["port"] for p in service["spec"]["ports"]}
    assert "e2b" in ports, f"the gateway Service has no e2b port: install with {CHART_VALUE}"
    address = service["spec"]["clusterIP"]
    return f"http://{address}:{ports['http']}", f"http://{address}:{ports['e2b']}"


def from_environment() -> E2BTarget | None:
    """The target SANDBOX_E2E_E2B_URL names, or None when it is not set."""
    url = os.environ.get(URL_VARIABLE)
    if not url:
        return None
    gateway = os.environ.get(GATEWAY_VARIABLE)
    assert gateway, f"{GATEWAY_VARIABLE}: the main listener of the gateway at {URL_VARIABLE}"
    return E2BTarget(
        KubeJSON(os.environ["KUBECONFIG"]),
        url.rstrip("/"),
        gateway.rstrip("/"),
        os.environ.get(TEMPLATE_VARIABLE, "base"),
    )
