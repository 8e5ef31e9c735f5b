"""The chart for production: values.schema.json refuses wrong values with the
path and the reason, placement and sizing reach both Deployments, the
ServiceMonitor and the dashboard render only when enabled (the board is the
file tests/unit/test_dashboard.py checks), and the hooks (CRD upgrade, helm
test) are well formed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from devcluster.helm import helm_binary

CHART = "charts/sandbox-operator"
PRODUCTION = "examples/chart/production-values.yaml"


def _template(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm_binary()), "template", "sbx", str(repo / CHART), "-n", "sandbox-system", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def _render(repo: Path, *args: str) -> list[dict[str, Any]]:
    done = _template(repo, *args)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def _named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["--set", "gateway.replicas=two"], "at '/gateway/replicas': got string, want integer"),
        (["--set", "gateway.replicas=0"], "at '/gateway/replicas': minimum: got 0, want 1"),
        (["--set", "image.pullPolicy=Sometimes"], "at '/image/pullPolicy'"),
        (["--set", "resources.limits.memory=lots"], "at '/resources/limits/memory'"),
        (["--set", "gatway.enabled=false"], "additional properties 'gatway' not allowed"),
        (["--set", "settings.default_idle_timout=1h"], "'default_idle_timout' not allowed"),
        (["--set", "settings.default_idle_timeout=soon"], "at '/settings/default_idle_timeout'"),
        (["--set", "gateway.settings.cache_entries=1"], "at '/gateway/settings/cache_entries'"),
        (["--set", "tolerations[0].operator=Maybe"], "at '/tolerations/0/operator'"),
        (["--set", "priorityClassName=Not_Valid"], "at '/priorityClassName'"),
        (["--set", "watchNamespaces={Team-A}"], "at '/watchNamespaces/0'"),
        (["--set", "metrics.serviceMonitor.enabled=yes"], "at '/metrics/serviceMonitor/enabled'"),
        (
            ["--set", "metrics.serviceMonitor.interval=often"],
            "at '/metrics/serviceMonitor/interval'",
        ),
    ],
)
def test_wrong_values_are_refused_with_path_and_reason(
    repo: Path, values: list[str], message: str
) -> None:
    done = _template(repo, *values)
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr
    assert message in done.stderr, done.stderr


def test_production_values_reach_both_deployments(repo: Path) -> None:
    docs = _render(repo, "-f", str(repo / PRODUCTION))
    values = yaml.safe_load((repo / PRODUCTION).read_text())
    for name, own in (("sbx", values), ("sbx-gateway", values["gateway"])):
        pod = _named(docs, "Deployment", name)["spec"]["template"]["spec"]
        assert pod["priorityClassName"] == own["priorityClassName"]
        assert pod["nodeSelector"] == own["nodeSelector"]
        assert pod["tolerations"] == own["tolerations"]
        if own.get("affinity") or name != "sbx":
            assert pod.get("affinity") == own.get("affinity")
        else:
            # None given: the operator's replicas prefer different nodes.
            assert set(pod["affinity"]) == {"podAntiAffinity"}
        assert pod["containers"][0]["resources"] == own["resources"]
    default = _named(_render(repo), "Deployment", "sbx")["spec"]["template"]["spec"]
    assert not {"priorityClassName", "nodeSelector", "tolerations"} & set(default)
    assert set(default["affinity"]) == {"podAntiAffinity"}


def test_service_monitor_and_dashboard_render_only_when_enabled(repo: Path) -> None:
    default = _render(repo)
    assert not [d for d in default if d["kind"] == "ServiceMonitor"]
    assert not [d for d in default if d["metadata"]["name"] == "sbx-dashboard"]
    docs = _render(repo, "-f", str(repo / PRODUCTION))
    monitor = _named(docs, "ServiceMonitor", "sbx")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "30s"}
    ]
    # The monitor finds both metrics Services, and each Service the pods and
    # the port that serve metrics.
    wanted = monitor["spec"]["selector"]["matchLabels"]
    services = [
        d
        for d in docs
        if d["kind"] == "Service" and wanted.items() <= d["metadata"]["labels"].items()
    ]
    assert {s["metadata"]["name"] for s in services} == {"sbx-metrics", "sbx-gateway-metrics"}
    for service, deployment in zip(
        sorted(services, key=lambda s: s["metadata"]["name"]),
        ("sbx-gateway", "sbx"),
        strict=True,
    ):
        pod = _named(docs, "Deployment", deployment)["spec"]["template"]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        [port] = service["spec"]["ports"]
        assert port["name"] == "metrics"
        assert port["targetPort"] in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}

    dashboard = _named(docs, "ConfigMap", "sbx-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    # What the board shows is checked in tests/unit/test_dashboard.py; here,
    # that the chart ships that file as it is.
    assert json.loads(dashboard["data"]["sandbox-operator.json"]) == json.loads(
        (repo / CHART / "files/dashboards/sandbox-operator.json").read_text()
    )


def test_crd_upgrade_hook_applies_every_chart_crd(repo: Path) -> None:
    docs = _render(repo)
    config_map = _named(docs, "ConfigMap", "sbx-crds")
    assert config_map["metadata"]["annotations"]["helm.sh/hook"] == "pre-upgrade"
    shipped = {p.stem for p in (repo / CHART / "crds").glob("*.yaml")}
    carried = {k.removesuffix(".json") for k in config_map["data"] if k.endswith(".json")}
    assert carried == shipped
    for name in shipped:
        on_disk = yaml.safe_load((repo / CHART / "crds" / f"{name}.yaml").read_text())
        assert json.loads(config_map["data"][f"{name}.json"]) == on_disk
    role = _named(docs, "ClusterRole", "sbx-crds")
    assert set(role["rules"][1]["resourceNames"]) == shipped
    job = _named(docs, "Job", "sbx-crds")
    assert job["metadata"]["annotations"]["helm.sh/hook-weight"] == "-5"
    assert not [
        d
        for d in _render(repo, "--set", "crds.upgrade=false")
        if d["metadata"]["name"] == "sbx-crds"
    ]


def test_the_catalog_is_applied_after_the_crds(repo: Path) -> None:
    """One ClusterSandboxTemplate per runtime, as post-install/post-upgrade hooks: a
    release resource of a kind the previous chart lacked fails the upgrade before
    the pre-upgrade hook has applied the CRDs."""
    docs = _render(repo)
    catalog = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterSandboxTemplate"}
    assert set(catalog) == {"python", "node", "e2b", "base", "code-interpreter-v1"}
    assert catalog["python"]["spec"] == {
        "description": "Python 3",
        "sandbox": {"runtime": "python"},
    }
    for template in catalog.values():
        hooks = template["metadata"]["annotations"]
        assert hooks["helm.sh/hook"] == "post-install,post-upgrade"
        assert hooks["helm.sh/hook-delete-policy"] == "before-hook-creation"
    assert not [
        d
        for d in _render(repo, "--set", "catalog.enabled=false")
        if d["kind"] == "ClusterSandboxTemplate"
    ]


def test_helm_test_hook_is_a_restricted_pod(repo: Path) -> None:
    pod = _named(_render(repo), "Pod", "sbx-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    container = pod["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["args"] == ["/scripts/chart-jobs.py", "test", "sandbox-system", "sbx-smoke"]
    scoped = _named(_render(repo, "--set", "watchNamespaces={team-a}"), "Pod", "sbx-test")
    assert scoped["spec"]["containers"][0]["args"][2] == "team-a"
