"""The Helm chart: lints, renders, agrees with the operator, and the API server accepts it."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from devcluster.controlplane import ControlPlane
from devcluster.deploy import restricted_namespace
from devcluster.helm import helm_binary
from sandbox_operator import config
from sandbox_operator.gateway import config as gateway_config
from sandbox_sdk import Forbidden, NotFound, SandboxClient, ServerError
from tests.integration.conftest import kubectl
from tests.integration.harness import chart_rules, service_account_token, wait_for
from tests.kube import KubeJSON, api_path, core_path


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


def _refused(repo: Path, *sets: str) -> str:
    """What `helm template` says when the values' schema refuses `sets`."""
    args = ["template", "sbx", str(repo / "charts/sandbox-operator")]
    for value in sets:
        args += ["--set", value]
    proc = subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, check=False, timeout=120
    )
    assert proc.returncode != 0, proc.stdout[:500]
    return proc.stderr


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
    assert set(settings.runtimes) == {"python", "node", "e2b"}


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


def test_no_probe_keeps_the_kubelets_one_second_timeout(repo: Path) -> None:
    """A busy node or a busy event loop fails a 1 s probe of a healthy process."""
    docs = render(repo, "mcp.enabled=true")
    probes = [
        (doc["metadata"]["name"], kind, container[kind])
        for doc in docs
        if doc["kind"] == "Deployment"
        for container in doc["spec"]["template"]["spec"]["containers"]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe")
        if kind in container
    ]
    assert len(probes) >= 5
    for name, kind, probe in probes:
        assert probe.get("timeoutSeconds", 1) >= 3, (name, kind, probe)


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


def test_checkpointd_is_optional_root_without_capabilities_and_reachable_by_the_operator(
    repo: Path,
) -> None:
    assert not [d for d in render(repo) if "checkpointd" in d["metadata"]["name"]]
    docs = render(
        repo,
        "checkpointd.enabled=true",
        "checkpointd.runsc=/opt/gvisor/runsc",
        "checkpointd.runscFlags={platform=systrap,debug=false}",
    )
    namespace = _kind(docs, "Namespace", "sandbox-node")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    daemon = _kind(docs, "DaemonSet", "sbx-checkpointd")
    assert daemon["metadata"]["namespace"] == "sandbox-node"
    pod = daemon["spec"]["template"]["spec"]
    for shared in ("hostPID", "hostNetwork", "hostIPC"):
        assert shared not in pod, shared
    (container,) = pod["containers"]
    assert container["securityContext"] == {
        "runAsUser": 0,
        "runAsNonRoot": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert container["args"] == [
        "--listen=:8450",
        "--runsc=/opt/gvisor/runsc",
        "--root=/run/containerd/runsc/k8s.io",
        "--store=/var/lib/sandbox-node/checkpoints",
        "--allow=system:serviceaccount:sandbox-system:sbx",
        "--runsc-flag=platform=systrap",
        "--runsc-flag=debug=false",
    ]
    # The runsc binary read-only; the host paths are the three it needs, no more.
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["runsc"] == {"name": "runsc", "mountPath": "/opt/gvisor/runsc", "readOnly": True}
    assert sorted(v["hostPath"]["path"] for v in pod["volumes"]) == [
        "/opt/gvisor/runsc",
        "/run/containerd/runsc/k8s.io",
        "/var/lib/sandbox-node/checkpoints",
    ]
    # Its only API right: reviewing tokens.
    role = _kind(docs, "ClusterRole", "sbx-checkpointd")
    assert role["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]}
    ]
    binding = _kind(docs, "ClusterRoleBinding", "sbx-checkpointd")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "sbx-checkpointd", "namespace": "sandbox-node"}
    ]
    # Only the operator's pods, from the operator's namespace.
    policy = _kind(docs, "NetworkPolicy", "sbx-checkpointd")
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "sandbox-system"}},
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "sandbox-operator",
                    "app.kubernetes.io/instance": "sbx",
                }
            },
        }
    ]
    # The operator finds it, and holds a token only checkpointd takes.
    settings = _settings(docs, "sbx-settings")
    assert (settings["checkpointd_namespace"], settings["checkpointd_port"]) == (
        "sandbox-node",
        8450,
    )
    operator = _kind(docs, "Deployment", "sbx")["spec"]["template"]["spec"]
    (volume,) = [v for v in operator["volumes"] if v["name"] == "checkpointd-token"]
    assert volume["projected"]["sources"] == [
        {
            "serviceAccountToken": {
                "audience": "sandbox-checkpointd",
                "expirationSeconds": 3600,
                "path": "token",
            }
        }
    ]
    (mount,) = [
        m for m in operator["containers"][0]["volumeMounts"] if m["name"] == "checkpointd-token"
    ]
    token_file = config.Settings().checkpointd_token_file
    assert f"{mount['mountPath']}/token" == token_file
    off = _kind(render(repo), "Deployment", "sbx")["spec"]["template"]["spec"]
    assert [v["name"] for v in off["volumes"]] == ["settings"]
    refused = _refused(repo, "checkpointd.enabled=true", "checkpointd.runsc=runsc")
    assert "/checkpointd/runsc" in refused, refused


def test_api_server_accepts_checkpointd(
    control_plane: ControlPlane, repo: Path, tmp_path: Path
) -> None:
    docs = [
        d
        for d in render(repo, "checkpointd.enabled=true", "checkpointd.namespace=checkpointd-check")
        if "checkpointd" in d["metadata"]["name"]
    ]
    (namespace,) = [d for d in docs if d["kind"] == "Namespace"]
    created = kubectl(control_plane, "apply", "-f", "-", input=json.dumps(namespace))
    assert created.returncode == 0, created.stderr
    manifest = tmp_path / "checkpointd.yaml"
    manifest.write_text(yaml.safe_dump_all([d for d in docs if d["kind"] != "Namespace"]))
    applied = kubectl(
        control_plane, "apply", "--dry-run=server", "--warnings-as-errors", "-f", str(manifest)
    )
    assert applied.returncode == 0, applied.stderr
    assert "daemonset.apps/sbx-checkpointd created (server dry run)" in applied.stdout


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


def test_admission_refuses_what_the_settings_cannot_serve(
    control_plane: ControlPlane, crds: None, repo: Path, tmp_path: Path
) -> None:
    """The chart's ValidatingAdmissionPolicies: the agent's port (as configured)
    and runtimes outside the catalog are refused when applied, with the reason;
    what the settings serve is admitted, and so are metadata-only updates."""
    docs = [
        doc
        for doc in render(repo, "settings.agent_port=9090", release="adm", namespace="adm-ns")
        if doc["kind"].startswith("ValidatingAdmissionPolicy")
    ]
    assert len(docs) == 4, [d["metadata"]["name"] for d in docs]
    manifest = tmp_path / "admission.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    ns = f"adm-{os.urandom(3).hex()}"
    assert kubectl(control_plane, "create", "namespace", ns).returncode == 0

    def apply(
        kind: str, name: str, spec: dict[str, Any], *flags: str
    ) -> subprocess.CompletedProcess[str]:
        doc = {
            "apiVersion": "sandbox.dev/v1alpha1",
            "kind": kind,
            "metadata": {"name": name, "namespace": ns},
            "spec": spec,
        }
        return kubectl(control_plane, "apply", *flags, "-f", "-", input=json.dumps(doc))

    agent_port = {"network": {"exposedPorts": [{"name": "a", "port": 9090}]}}
    try:
        applied = kubectl(control_plane, "apply", "-f", str(manifest))
        assert applied.returncode == 0, applied.stderr

        # A policy is enforced once the API server has compiled it, each policy
        # on its own: retry briefly until both the Sandbox's and the template's are.
        def refused_once() -> subprocess.CompletedProcess[str] | None:
            # Dry runs: one admitted before the policy is in force would stay.
            template = apply("SandboxTemplate", "port", {"sandbox": agent_port}, "--dry-run=server")
            answer = apply("Sandbox", "agentport", agent_port, "--dry-run=server")
            return answer if answer.returncode != 0 and template.returncode != 0 else None

        refused = wait_for(refused_once, 30, "the policies in force")
        assert "spec.network.exposedPorts: port 9090 is reserved for the sandbox agent" in (
            refused.stderr
        )
        refused = apply("Sandbox", "cobol", {"runtime": "cobol"})
        assert refused.returncode != 0
        assert "spec.runtime: unknown runtime cobol; this cluster offers: e2b, node, python" in (
            refused.stderr
        )
        refused = apply("SandboxTemplate", "cobol", {"sandbox": {"runtime": "cobol"}})
        assert "spec.sandbox.runtime: unknown runtime cobol" in refused.stderr
        refused = apply("SandboxTemplate", "port", {"sandbox": agent_port})
        assert "spec.sandbox.network.exposedPorts: port 9090" in refused.stderr
        # What the settings serve: 8080 is an ordinary port when the agent is on 9090.
        served = {"runtime": "node", "network": {"exposedPorts": [{"name": "w", "port": 8080}]}}
        ok = apply("Sandbox", "fine", served)
        assert ok.returncode == 0, ok.stderr
        assert apply("SandboxTemplate", "fine", {"sandbox": served}).returncode == 0
        assert apply("SandboxTemplate", "bare", {}).returncode == 0
        labelled = kubectl(control_plane, "label", "-n", ns, "sandbox", "fine", "x=y")
        assert labelled.returncode == 0, labelled.stderr
    finally:
        kubectl(control_plane, "delete", "-f", str(manifest), "--wait=false")
        kubectl(control_plane, "delete", "namespace", ns, "--wait=false")


def _settings(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    settings: dict[str, Any] = yaml.safe_load(
        _kind(docs, "ConfigMap", name)["data"]["settings.yaml"]
    )
    return settings


def test_the_gateways_external_url_is_what_urls_are_handed_out_on(
    repo: Path, tmp_path: Path
) -> None:
    """gateway.externalURL reaches the operator (status.ports[].url, hence
    Sandbox.url() and `kubectl sandbox port`) and the gateway (signed URLs), and a
    change rolls the operator, which reads its settings once."""
    external = "https://sandboxes.example.com"
    docs = render(repo, f"gateway.externalURL={external}")
    operator_file = tmp_path / "operator.yaml"
    operator_file.write_text(_kind(docs, "ConfigMap", "sbx-settings")["data"]["settings.yaml"])
    assert config.load({"SANDBOX_OPERATOR_CONFIG": str(operator_file)}).gateway_url == external
    gateway_file = tmp_path / "gateway.yaml"
    gateway_file.write_text(
        _kind(docs, "ConfigMap", "sbx-gateway-settings")["data"]["settings.yaml"]
    )
    assert gateway_config.load({"SANDBOX_GATEWAY_CONFIG": str(gateway_file)}).external_url == (
        external
    )
    # Unset: the Service's in-cluster URL for the operator, nothing for the gateway.
    default = render(repo)
    assert (
        _settings(default, "sbx-settings")["gateway_url"] == "http://sbx-gateway.sandbox-system.svc"
    )
    assert "external_url" not in _settings(default, "sbx-gateway-settings")

    def checksum(docs: list[dict[str, Any]]) -> str:
        pod = _kind(docs, "Deployment", "sbx")["spec"]["template"]
        return str(pod["metadata"]["annotations"]["checksum/settings"])

    assert checksum(docs) != checksum(default)
    assert checksum(render(repo, "watchNamespaces={team-a}")) != checksum(default)
    # Not a URL: refused by the values' schema, before anything is installed.
    assert "externalURL" in _refused(repo, "gateway.externalURL=sandboxes.example.com")


def _service_account(kube: KubeJSON, ns: str, name: str, cluster_role: str) -> str:
    """A ServiceAccount holding only the built-in `cluster_role` in its own
    namespace (as a namespace's users are given it), and a token of it."""
    kube.create(
        core_path("serviceaccounts", ns),
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
    )
    rbac = "rbac.authorization.k8s.io/v1"
    kube.create(
        api_path(rbac, "rolebindings", ns),
        {
            "apiVersion": rbac,
            "kind": "RoleBinding",
            "metadata": {"name": f"{name}-{cluster_role}"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": cluster_role,
            },
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
        },
    )
    return service_account_token(kube, ns, name, seconds=3600)


def test_holders_of_edit_or_view_reach_the_gateway_through_the_service_proxy(
    control_plane: ControlPlane,
    kube: KubeJSON,
    access_roles: None,
    repo: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SDK's route from a kubeconfig, the API server's proxy to the gateway
    Service, is open to users who hold nothing but `edit` (or `view`) in their own
    namespace once the chart is applied: `services/proxy` on the gateway's name as
    the SDK's URL spells it, in the release namespace, and nothing more. Before,
    the SDK's refusal says what opens it."""
    suffix = os.urandom(3).hex()
    release_ns, user_ns = f"rel-{suffix}", f"users-{suffix}"
    for name in (release_ns, user_ns):
        assert kubectl(control_plane, "create", "namespace", name).returncode == 0
    try:
        tokens = {
            role: _service_account(kube, user_ns, f"{role}-user", role) for role in ("edit", "view")
        }

        def can_i(
            role: str, verb: str, resource: str, name: str = "", ns: str = release_ns
        ) -> bool:
            """A SubjectAccessReview for the ServiceAccount, with the groups the API
            server gives its tokens."""
            group, _, subresource = resource.partition("/")
            review = kube.create(
                "/apis/authorization.k8s.io/v1/subjectaccessreviews",
                {
                    "apiVersion": "authorization.k8s.io/v1",
                    "kind": "SubjectAccessReview",
                    "spec": {
                        "user": f"system:serviceaccount:{user_ns}:{role}-user",
                        "groups": [
                            "system:serviceaccounts",
                            f"system:serviceaccounts:{user_ns}",
                            "system:authenticated",
                        ],
                        "resourceAttributes": {
                            "namespace": ns,
                            "verb": verb,
                            "group": "sandbox.dev" if group == "sandboxes" else "",
                            "resource": group,
                            "subresource": subresource,
                            "name": name,
                        },
                    },
                },
            )
            return bool(review["status"].get("allowed"))

        # The controller manager aggregates the chart's roles into `edit` and `view`.
        for role in ("edit", "view"):
            wait_for(lambda: can_i(role, "get", "sandboxes", ns=user_ns), 60, f"{role} aggregated")  # noqa: B023
        # Their sandbox (the chart's user and viewer roles are aggregated into
        # `edit` and `view`): nothing needs to run it, the proxy refuses first.
        kube.create(
            api_path("sandbox.dev/v1alpha1", "sandboxes", user_ns),
            {
                "apiVersion": "sandbox.dev/v1alpha1",
                "kind": "Sandbox",
                "metadata": {"name": "box"},
                "spec": {"runtime": "python"},
            },
        )
        # Services with nothing behind them: a proxied request that passes RBAC is
        # answered by the API server itself (404 or 503: nowhere to send it); one
        # that does not, 403.
        for service in ("sbx-gateway", "other"):
            kube.create(
                core_path("services", release_ns),
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": {"name": service},
                    "spec": {"ports": [{"port": 80}]},
                },
            )
        monkeypatch.delenv("SANDBOX_GATEWAY_URL", raising=False)
        monkeypatch.setenv("SANDBOX_GATEWAY_SERVICE", f"{release_ns}/sbx-gateway:80")

        def sdk_call(token: str) -> None:
            with SandboxClient(
                user_ns,
                api_server=control_plane.server,
                token=token,
                ca_file=str(control_plane.ca_cert),
                gateway="proxy",
            ) as sdk:
                sdk.connect("box").files.read("x")

        # Without the chart's grant: the authorizer's 403, and the fix named.
        with pytest.raises(Forbidden) as refused:
            sdk_call(tokens["edit"])
        message = str(refused.value)
        assert 'cannot get resource "services/proxy"' in message, message
        assert f"'http:sbx-gateway:80' in namespace {release_ns}" in message
        assert "gateway.serviceProxyGroups" in message
        assert "gateway_url=" in message
        assert "$SANDBOX_GATEWAY_URL" in message

        docs = [
            d
            for d in render(repo, namespace=release_ns)
            if d["kind"] in ("Role", "RoleBinding") and d["metadata"]["name"] == "sbx-gateway-proxy"
        ]
        assert [d["kind"] for d in docs] == ["Role", "RoleBinding"]
        manifest = tmp_path / "proxy.yaml"
        manifest.write_text(yaml.safe_dump_all(docs))
        applied = kubectl(control_plane, "apply", "-f", str(manifest))
        assert applied.returncode == 0, applied.stderr

        gateway = "http:sbx-gateway:80"
        # The authorizer reads Roles and bindings from the API server's caches,
        # which follow a new binding within moments (longer on a busy machine).
        for role in ("edit", "view"):
            wait_for(
                lambda: can_i(role, "get", "services/proxy", gateway),  # noqa: B023
                30,
                f"the chart's proxy grant in force for {role}",
            )
        for role in ("edit", "view"):
            for verb in ("get", "create", "update", "patch", "delete"):
                assert can_i(role, verb, "services/proxy", gateway), (role, verb)
            # Nothing else of the release namespace: not another Service's proxy,
            # nor the gateway under other spellings, nor the Service itself.
            for name in (
                "http:other:80",
                "other",
                "sbx-gateway",
                "sbx-gateway:80",
                "https:sbx-gateway:80",
            ):
                assert not can_i(role, "get", "services/proxy", name), (role, name)
            assert not can_i(role, "list", "services/proxy")
            assert not can_i(role, "get", "services", "sbx-gateway")
            assert not can_i(role, "get", "pods/proxy", "x")
        # And in a namespace of their own, the chart's Role is not what they hold.
        assert not can_i("view", "get", "services/proxy", gateway, ns=user_ns)

        # The API server's own path parsing agrees: a real request with the user's
        # token passes the authorizer for the gateway's name (and then finds
        # nothing to send it to), and is refused for the other Service.
        def proxied(token: str, service: str, method: str) -> httpx.Response:
            url = f"/api/v1/namespaces/{release_ns}/services/{service}/proxy/v1/namespaces/x"
            with httpx.Client(
                base_url=control_plane.server,
                verify=ssl.create_default_context(cafile=str(control_plane.ca_cert)),
                timeout=30,
            ) as http:
                return http.request(method, url, headers={"Authorization": f"Bearer {token}"})

        def allowed() -> bool:  # as above: the caches may lag the binding
            return proxied(tokens["view"], gateway, "GET").status_code != 403

        wait_for(allowed, 30, "the binding in force")
        for role, token in tokens.items():
            for method in ("GET", "POST", "PUT", "PATCH", "DELETE"):
                answer = proxied(token, gateway, method)
                assert answer.status_code in (404, 503), (role, method, answer.text)
                assert answer.json()["details"]["name"] == "sbx-gateway"
            refused_other = proxied(token, "http:other:80", "GET")
            assert refused_other.status_code == 403, refused_other.text
        # The SDK's call now gets past the proxy's RBAC, as far as the Service.
        with pytest.raises((NotFound, ServerError)) as passed:
            sdk_call(tokens["edit"])
        assert "sbx-gateway" in str(passed.value)

        # Turned off, or given to other groups.
        off = render(repo, "gateway.serviceProxyGroups=null")
        assert not [d for d in off if d["metadata"]["name"] == "sbx-gateway-proxy"]
        teams = _kind(
            render(repo, "gateway.serviceProxyGroups={team-a,team-b}"),
            "RoleBinding",
            "sbx-gateway-proxy",
        )
        assert [s["name"] for s in teams["subjects"]] == ["team-a", "team-b"]
        assert {s["kind"] for s in teams["subjects"]} == {"Group"}
    finally:
        for name in (release_ns, user_ns):
            kubectl(control_plane, "delete", "namespace", name, "--wait=false")
