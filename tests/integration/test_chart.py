"""The Helm chart: lints, renders, agrees with the operator, and the API server accepts it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

from devcluster.controlplane import ControlPlane
from devcluster.deploy import restricted_namespace
from devcluster.helm import helm_binary
from sandbox_operator import config
from sandbox_operator.gateway import config as gateway_config
from tests.integration.conftest import kubectl
from tests.integration.harness import chart_rules


def _helm(*args: str) -> str:
    proc = subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, check=False, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def render(
    repo: Path, *sets: str, namespace: str = "sandbox-system", release: str = "sbx"
) -> list[dict[str, Any]]:
    """The chart's documents as `helm template` renders them with `--set` of each of `sets`."""
    args = ["template", release, str(repo / "charts/sandbox-operator"), "-n", namespace]
    for value in sets:
        args += ["--set", value]
    return [doc for doc in yaml.safe_load_all(_helm(*args)) if doc]


def _kind(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    return next(
        doc
        for doc in docs
        if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name)
    )


def test_chart_lints(repo: Path) -> None:
    _helm("lint", "--strict", str(repo / "charts/sandbox-operator"))


def test_rendered_rbac_is_the_tested_rules_files(repo: Path) -> None:
    """The ClusterRoles are the rules files the integration tier runs under; the
    Secrets ones are bound cluster-wide, or in each watched namespace only."""
    roles = {
        "sbx": "rbac-rules.yaml",
        "sbx-secrets": "rbac-secret-rules.yaml",
        "sbx-gateway": "gateway-rbac-rules.yaml",
        "sbx-gateway-secrets": "gateway-secret-rules.yaml",
    }
    for sets in ((), ("watchNamespaces={team-a,team-b}",)):
        docs = render(repo, *sets)
        for name, rules_file in roles.items():
            assert _kind(docs, "ClusterRole", name)["rules"] == chart_rules(repo, [rules_file])
        for name in ("sbx-secrets", "sbx-gateway-secrets"):
            bindings = [
                (d["kind"], d["metadata"].get("namespace"))
                for d in docs
                if d["kind"] in ("ClusterRoleBinding", "RoleBinding")
                and d["roleRef"]["name"] == name
            ]
            expected = (
                [("RoleBinding", "team-a"), ("RoleBinding", "team-b")]
                if sets
                else [("ClusterRoleBinding", None)]
            )
            assert bindings == expected, name
        # Kopf follows the namespaces it serves (list, watch) only when it serves some.
        namespaces = [d for d in docs if d["metadata"]["name"] == "sbx-namespaces"]
        assert [d["kind"] for d in namespaces] == (
            ["ClusterRole", "ClusterRoleBinding"] if sets else []
        )
        if sets:
            assert namespaces[0]["rules"] == chart_rules(repo, ["rbac-namespaces-rules.yaml"])


def test_the_gateway_rolls_when_what_its_settings_are_made_of_changes(repo: Path) -> None:
    def checksum(*sets: str) -> str:
        pod = _kind(render(repo, *sets), "Deployment", "sbx-gateway")["spec"]["template"]
        return str(pod["metadata"]["annotations"]["checksum/settings"])

    base = checksum()
    for sets in (
        ("watchNamespaces={team-a}",),
        ("settings.agent_port=9000",),
        ("gateway.replicas=3",),
    ):
        assert checksum(*sets) != base, sets


def test_rendered_settings_are_valid_operator_settings(repo: Path, tmp_path: Path) -> None:
    docs = render(repo, "settings.default_idle_timeout=15m")
    settings_file = tmp_path / "settings.yaml"
    settings_file.write_text(_kind(docs, "ConfigMap", "sbx-settings")["data"]["settings.yaml"])
    settings = config.load({"SANDBOX_OPERATOR_CONFIG": str(settings_file)})
    assert settings.operator_namespace == "sandbox-system"
    assert settings.default_idle_timeout == "15m"
    assert set(settings.runtimes) == {"python", "node"}


def test_the_gateway_is_configured_from_the_same_values(repo: Path, tmp_path: Path) -> None:
    docs = render(repo, "gateway.previewDomain=preview.example.com", "watchNamespaces={team-a}")
    settings_file = tmp_path / "gateway.yaml"
    settings_file.write_text(
        _kind(docs, "ConfigMap", "sbx-gateway-settings")["data"]["settings.yaml"]
    )
    gateway = gateway_config.load({"SANDBOX_GATEWAY_CONFIG": str(settings_file)})
    assert (gateway.preview_domain, gateway.namespaces) == ("preview.example.com", ["team-a"])
    operator_file = tmp_path / "operator.yaml"
    operator_file.write_text(_kind(docs, "ConfigMap", "sbx-settings")["data"]["settings.yaml"])
    operator = config.load({"SANDBOX_OPERATOR_CONFIG": str(operator_file)})
    # Agents admit the gateway's pods; their status names the preview hosts.
    gateway_pod = _kind(docs, "Deployment", "sbx-gateway")["spec"]["template"]["metadata"]
    assert operator.gateway_pod_labels == gateway_pod["labels"]
    assert operator.preview_domain == "preview.example.com"
    assert _kind(docs, "Deployment", "sbx-gateway")["spec"]["replicas"] == 2
    assert _kind(docs, "PodDisruptionBudget", "sbx-gateway")["spec"]["minAvailable"] == 1
    off = render(repo, "gateway.enabled=false")
    assert not [d for d in off if d["metadata"]["name"].startswith("sbx-gateway")]


def test_watched_namespaces_and_extra_env(repo: Path) -> None:
    default = _kind(render(repo), "Deployment", "sbx")["spec"]["template"]["spec"]["containers"][0]
    assert "--all-namespaces" in default["args"]
    scoped = _kind(
        render(
            repo, "watchNamespaces={team-a,team-b}", "extraEnv[0].name=X", "extraEnv[0].value=hello"
        ),
        "Deployment",
        "sbx",
    )["spec"]["template"]["spec"]["containers"][0]
    assert "--all-namespaces" not in scoped["args"]
    assert "--namespace=team-a" in scoped["args"]
    assert "--namespace=team-b" in scoped["args"]
    assert {"name": "X", "value": "hello"} in scoped["env"]


def test_the_operator_runs_two_peering_replicas(repo: Path) -> None:
    docs = render(repo)
    deployment = _kind(docs, "Deployment", "sbx")["spec"]
    assert deployment["replicas"] == 2
    # An upgrade from a --standalone pod must not overlap with a peering one.
    assert deployment["strategy"]["type"] == "Recreate"
    pod = deployment["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert "--standalone" not in args
    assert "--peering=sbx-sandbox-system" in args
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["POD_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # The operator makes its peering object: helm could not map one of a kind whose
    # CRD an upgrade brings only in its hook.
    assert not [d for d in docs if d["kind"] in ("ClusterKopfPeering", "KopfPeering")]
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert (
        anti[0]["podAffinityTerm"]["labelSelector"]["matchLabels"]
        == deployment["selector"]["matchLabels"]
    )
    assert _kind(docs, "PodDisruptionBudget", "sbx")["spec"]["maxUnavailable"] == 1
    # The peering objects are within the operator's rules (which the integration tier runs under).
    rules = _kind(docs, "ClusterRole", "sbx")["rules"]
    peering = next(r for r in rules if r["apiGroups"] == ["kopf.dev"])
    assert set(peering["resources"]) == {"clusterkopfpeerings", "kopfpeerings"}
    assert {"list", "watch", "patch"} <= set(peering["verbs"])
    crds = {p.name for p in (repo / "charts/sandbox-operator/crds").glob("*.yaml")}
    assert {"clusterkopfpeerings.kopf.dev.yaml", "kopfpeerings.kopf.dev.yaml"} <= crds


def test_one_replica_and_namespaced_peering(repo: Path) -> None:
    docs = render(repo, "replicas=1", "peering.name=ops", "watchNamespaces={team-a,team-b}")
    deployment = _kind(docs, "Deployment", "sbx")["spec"]
    assert deployment["replicas"] == 1
    assert "--peering=ops" in deployment["template"]["spec"]["containers"][0]["args"]
    # With watched namespaces Kopf peers in a KopfPeering in each, which the
    # operator makes (in the namespaces its settings name).
    settings = yaml.safe_load(_kind(docs, "ConfigMap", "sbx-settings")["data"]["settings.yaml"])
    assert settings["watch_namespaces"] == ["team-a", "team-b"]
    # One replica can still be drained.
    assert _kind(docs, "PodDisruptionBudget", "sbx")["spec"]["maxUnavailable"] == 1


def test_operator_and_gateway_pods_are_restricted(repo: Path) -> None:
    for name in ("sbx", "sbx-gateway"):
        pod = _kind(render(repo), "Deployment", name)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        container = pod["containers"][0]["securityContext"]
        assert container["allowPrivilegeEscalation"] is False
        assert container["readOnlyRootFilesystem"] is True
        assert container["capabilities"] == {"drop": ["ALL"]}


def test_the_mcp_server_is_optional_and_holds_no_credentials(repo: Path) -> None:
    assert not [d for d in render(repo) if "mcp" in d["metadata"]["name"]]
    docs = render(repo, "mcp.enabled=true", "mcp.runtime=node", "mcp.onEnd=destroy")
    pod = _kind(docs, "Deployment", "sbx-mcp")["spec"]["template"]["spec"]
    # Every call carries the caller's token: the pod gets none of its own.
    assert pod["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod
    assert not [
        d
        for d in docs
        if d["kind"] in ("RoleBinding", "ClusterRoleBinding") and "mcp" in d["metadata"]["name"]
    ]
    container = pod["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["SANDBOX_GATEWAY_URL"] == "http://sbx-gateway.sandbox-system.svc:80"
    assert (env["SANDBOX_MCP_RUNTIME"], env["SANDBOX_MCP_ON_END"]) == ("node", "destroy")
    service = _kind(docs, "Service", "sbx-mcp")
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_api_server_accepts_the_rendered_chart(
    control_plane: ControlPlane, crds: None, repo: Path, tmp_path: Path
) -> None:
    manifest = tmp_path / "chart.yaml"
    # Not the `helm test` Pod: its ServiceAccount, another hook, does not exist in
    # a dry run, and admission looks it up (the e2e tier runs `helm test`).
    docs = [
        doc
        for doc in render(repo, "mcp.enabled=true", namespace="chart-check")
        if not (doc["kind"] == "Pod" and doc["metadata"]["annotations"]["helm.sh/hook"] == "test")
    ]
    manifest.write_text(yaml.safe_dump_all(docs))
    # Pod Security `restricted` warns about a workload's pod template that it would refuse.
    namespace = kubectl(
        control_plane, "apply", "-f", "-", input=json.dumps(restricted_namespace("chart-check"))
    )
    assert namespace.returncode == 0, namespace.stderr
    applied = kubectl(
        control_plane,
        "apply",
        "--dry-run=server",
        "--warnings-as-errors",
        "-n",
        "chart-check",
        "-f",
        str(manifest),
    )
    assert applied.returncode == 0, applied.stderr
    assert "deployment.apps/sbx created (server dry run)" in applied.stdout
    assert "deployment.apps/sbx-mcp created (server dry run)" in applied.stdout
