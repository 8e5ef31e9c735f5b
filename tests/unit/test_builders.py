"""Pure builders: the desired children of a Sandbox, and the security baseline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest

from sandbox_operator import identity, indexes
from sandbox_operator.api.sandbox import SandboxSpec
from sandbox_operator.builders import sandbox as build
from sandbox_operator.config import Settings
from sandbox_operator.resources import POD_HASH_ANNOTATION

REF = identity.SandboxRef(name="demo", namespace="team-a", uid="1234")
SETTINGS = Settings()


def _pod(**spec: Any) -> dict[str, Any]:
    return build.build_pod(REF, SandboxSpec.model_validate(spec), SETTINGS)


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]


def test_pod_meets_pod_security_restricted() -> None:
    """The checks of the PSS `restricted` profile, item by item."""
    pod = _pod()
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not spec.get("hostNetwork")
    assert not spec.get("hostPID")
    assert not spec.get("hostIPC")
    for volume in spec["volumes"]:
        assert set(volume) - {"name"} <= {"emptyDir", "persistentVolumeClaim", "secret"}
    for container in _containers(pod):
        ctx = container["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False
        assert ctx["capabilities"] == {"drop": ["ALL"]}
        assert ctx["runAsNonRoot"] is True
        assert ctx["runAsUser"] > 0
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
        assert "privileged" not in ctx
        assert not any("hostPort" in port for port in container.get("ports", []))


def test_pod_isolation_choices() -> None:
    pod = _pod()
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    # Two plain containers, the user's runtime first (kubectl's default one);
    # no init containers: a native sidecar held the other back by a second.
    sandbox, agent = spec["containers"]
    assert (sandbox["name"], agent["name"]) == ("sandbox", "agent")
    assert pod["metadata"]["annotations"]["kubectl.kubernetes.io/default-container"] == "sandbox"
    assert "initContainers" not in spec
    assert "restartPolicy" not in agent
    # The agent: a read-only root and its own UID.
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True
    assert agent["securityContext"]["runAsUser"] != sandbox["securityContext"]["runAsUser"]
    # Only the agent sees the token.
    assert any(m["name"] == "agent-token" for m in agent["volumeMounts"])
    assert not any(m["name"] == "agent-token" for m in sandbox["volumeMounts"])
    # The runner is what the sandbox container runs (test_runner_bootstrap below),
    # started beside the agent: no startup probe holds it back.
    assert sandbox["command"] == ["python3", "-s", "-c", build.RUNNER_BOOTSTRAP]
    assert "startupProbe" not in agent
    # Memory and ephemeral storage: requests equal limits; CPU: a small request.
    for container in (agent, sandbox):
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        assert "ephemeral-storage" in limits
        assert {k: v for k, v in requests.items() if k != "cpu"} == {
            k: v for k, v in limits.items() if k != "cpu"
        }
    assert sandbox["resources"]["requests"]["cpu"] == "100m"
    assert sandbox["resources"]["limits"]["cpu"] == "1"
    tiny = _pod(resources={"cpu": "50m"})["spec"]["containers"][0]["resources"]
    assert tiny["requests"]["cpu"] == "50m"  # never a request above the limit


def test_runtime_catalog_and_image_override() -> None:
    assert _pod()["spec"]["containers"][0]["image"] == "sandbox-runtime-python:dev"
    assert _pod(runtime="node")["spec"]["containers"][0]["image"] == "sandbox-runtime-node:dev"
    assert _pod(image="python:3.12-slim")["spec"]["containers"][0]["image"] == "python:3.12-slim"
    with pytest.raises(
        ValueError, match="unknown runtime 'ruby'; this cluster offers: node, python"
    ):
        _pod(runtime="ruby")


def test_resource_profiles_set_requests_under_the_limits() -> None:
    def requests(pod: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
        spec = pod["spec"]
        return (
            spec["containers"][0]["resources"]["requests"],
            spec["containers"][1]["resources"]["requests"],
        )

    # The default profile is `standard`, and naming it changes nothing.
    assert requests(_pod()) == requests(_pod(resources={"profile": "standard"}))
    sandbox, agent = requests(_pod(resources={"profile": "dense"}))
    assert sandbox == {"cpu": "5m", "memory": "32Mi", "ephemeral-storage": "64Mi"}
    assert agent == {"cpu": "5m", "memory": "32Mi", "ephemeral-storage": "64Mi"}
    dense = _pod(resources={"profile": "dense"})["spec"]["containers"][0]["resources"]
    assert dense["limits"] == {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "2Gi"}
    # A request never passes its limit.
    small = _pod(resources={"profile": "standard", "memory": "32Mi", "cpu": "50m"})
    assert requests(small)[0] == {"cpu": "50m", "memory": "32Mi", "ephemeral-storage": "2Gi"}
    greedy = Settings.model_validate(
        {
            "resource_profiles": {"big": {"sandbox": {"memory": "2Gi"}, "agent": {}}},
            "default_resource_profile": "big",
        }
    )
    capped = build.build_pod(REF, SandboxSpec.model_validate({}), greedy)
    assert requests(capped)[0]["memory"] == "1Gi"
    # An operator's own profile; the default can be any of them.
    # (As the chart's settings file gives them.)
    custom = Settings.model_validate(
        {
            "resource_profiles": {
                "tiny": {"sandbox": {"cpu": "1m"}, "agent": {"cpu": "1m", "memory": "16Mi"}}
            },
            "default_resource_profile": "tiny",
        }
    )
    pod = build.build_pod(REF, SandboxSpec.model_validate({}), custom)
    assert requests(pod)[0] == {"cpu": "1m", "memory": "1Gi", "ephemeral-storage": "2Gi"}
    assert requests(pod)[1]["memory"] == "16Mi"
    with pytest.raises(
        ValueError, match="unknown resource profile 'huge'; this cluster offers: dense, standard"
    ):
        _pod(resources={"profile": "huge"})
    with pytest.raises(ValueError, match="default_resource_profile 'dense' is not one of"):
        Settings(
            resource_profiles={"tiny": custom.resource_profiles["tiny"]},
            default_resource_profile="dense",
        )


def test_passthroughs_and_user_env() -> None:
    pod = _pod(
        runtimeClassName="gvisor",
        nodeSelector={"pool": "sandboxes"},
        env=[
            {"name": "A", "value": "1"},
            {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        ],
        resources={"cpu": "2", "memory": "4Gi"},
    )
    assert pod["spec"]["runtimeClassName"] == "gvisor"
    assert pod["spec"]["nodeSelector"] == {"pool": "sandboxes"}
    sandbox = pod["spec"]["containers"][0]
    assert {"name": "A", "value": "1"} in sandbox["env"]
    assert {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}} in sandbox["env"]
    assert sandbox["resources"]["limits"] == {
        "cpu": "2",
        "memory": "4Gi",
        "ephemeral-storage": "2Gi",
    }


def test_workspace_claim_or_empty_dir() -> None:
    spec = SandboxSpec.model_validate({"workspace": {"size": "5Gi", "storageClassName": "fast"}})
    claim = build.build_claim(REF, spec, SETTINGS)
    assert claim is not None
    assert claim["metadata"]["name"] == "demo-workspace"
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert claim["spec"]["storageClassName"] == "fast"
    ephemeral = SandboxSpec.model_validate({"workspace": {"ephemeral": True, "size": "1Gi"}})
    assert build.build_claim(REF, ephemeral, SETTINGS) is None
    volumes = build.build_pod(REF, ephemeral, SETTINGS)["spec"]["volumes"]
    assert volumes[0] == {"name": "workspace", "emptyDir": {"sizeLimit": "1Gi"}}


def test_children_are_owned_and_labelled() -> None:
    spec = SandboxSpec.model_validate(
        {"network": {"exposedPorts": [{"name": "web", "port": 3000}]}}
    )
    children = [
        build.build_pod(REF, spec, SETTINGS),
        build.build_claim(REF, spec, SETTINGS),
        build.build_secret(REF, "t"),
        build.build_service(REF, spec),
        build.build_network_policy(REF, spec, SETTINGS),
    ]
    for child in children:
        assert child is not None
        meta = child["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["labels"] == {
            "sandbox.dev/sandbox": "demo",
            "app.kubernetes.io/managed-by": "sandbox-operator",
        }
        owner = meta["ownerReferences"][0]
        assert owner["uid"] == "1234"
        assert owner["controller"] is True
        assert owner["kind"] == "Sandbox"


def test_a_child_is_ours_or_an_earlier_namesakes_or_nobodys() -> None:
    """Only the controller reference's UID makes a child ours; one a Sandbox of the
    same name with another UID controls is an earlier namesake's leftover."""
    claim = build.build_claim(REF, SandboxSpec(), SETTINGS)
    assert claim is not None
    assert identity.controlled_by(claim, REF)
    assert not identity.left_by_namesake(claim, REF)
    later = identity.SandboxRef(name="demo", namespace="team-a", uid="5678")
    assert not identity.controlled_by(claim, later)
    assert identity.left_by_namesake(claim, later)
    other = identity.SandboxRef(name="other", namespace="team-a", uid="5678")
    assert not identity.left_by_namesake(claim, other)
    not_controller = json.loads(json.dumps(claim))
    not_controller["metadata"]["ownerReferences"][0]["controller"] = False
    assert not identity.left_by_namesake(not_controller, later)
    foreign = {"metadata": {"name": "demo-workspace"}}
    assert not identity.controlled_by(foreign, REF)
    assert not identity.left_by_namesake(foreign, REF)


def test_service_only_for_exposed_ports() -> None:
    assert build.build_service(REF, SandboxSpec()) is None
    spec = SandboxSpec.model_validate(
        {"network": {"exposedPorts": [{"name": "web", "port": 3000}]}}
    )
    service = build.build_service(REF, spec)
    assert service is not None
    assert service["spec"]["ports"] == [
        {"name": "web", "port": 3000, "targetPort": 3000, "protocol": "TCP"}
    ]


@pytest.mark.parametrize(
    ("egress", "expected"),
    [("None", 0), ("Cluster", 1), ("Internet", 2)],
)
def test_network_policy_egress(egress: str, expected: int) -> None:
    spec = SandboxSpec.model_validate({"network": {"egress": egress}})
    policy = build.build_network_policy(REF, spec, SETTINGS)["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert len(policy["egress"]) == expected
    if egress == "Internet":
        block = policy["egress"][1]["to"][0]["ipBlock"]
        assert block["cidr"] == "0.0.0.0/0"
        assert "169.254.0.0/16" in block["except"]  # cloud metadata
        assert "10.0.0.0/8" in block["except"]
    # The agent port admits only the operator.
    ingress = policy["ingress"][0]
    assert ingress["ports"] == [{"port": 8080, "protocol": "TCP"}]
    assert ingress["from"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "sandbox-operator"
    }


def test_builders_are_deterministic() -> None:
    spec = SandboxSpec.model_validate({"runtime": "node"})
    assert build.build_pod(REF, spec, SETTINGS) == build.build_pod(REF, spec, SETTINGS)


def test_pod_stamp_follows_the_sandbox_spec_not_the_operator_settings() -> None:
    def changed(pod_spec: SandboxSpec, spec: SandboxSpec, settings: Settings) -> list[str] | None:
        return build.changed_fields(build.desired_pod(REF, pod_spec, settings), spec)

    spec = SandboxSpec.model_validate({"runtime": "python"})
    assert changed(spec, spec, Settings(agent_image="sandbox-agent:2")) == []
    assert changed(spec, spec.model_copy(update={"paused": True}), SETTINGS) == []
    node = SandboxSpec.model_validate({"runtime": "node"})
    assert changed(spec, node, SETTINGS) == ["runtime"]


def test_env_ports_and_lifecycle_never_need_a_new_pod() -> None:
    """They reach the running pod otherwise (the agent, the Service, the operator)."""
    spec = SandboxSpec.model_validate({"runtime": "python"})
    pod = build.desired_pod(REF, spec, SETTINGS)
    changed = SandboxSpec.model_validate(
        {
            "runtime": "python",
            "env": [{"name": "A", "value": "1"}],
            "network": {"exposedPorts": [{"name": "web", "port": 8000}], "egress": "None"},
            "lifecycle": {"idleTimeout": "5m", "onIdle": "Pause"},
            "files": [{"path": "a.txt", "content": "x"}],
        }
    )
    assert build.changed_fields(pod, changed) == []
    bigger = SandboxSpec.model_validate({"runtime": "python", "resources": {"memory": "2Gi"}})
    assert build.changed_fields(pod, bigger) == ["resources"]
    # No containerPort: exposing a port is the Service's business.
    sandbox = next(c for c in pod["spec"]["containers"] if c["name"] == "sandbox")
    assert "ports" not in sandbox


def test_files_digest_follows_the_files_and_an_ephemeral_workspace_s_pod() -> None:
    one = [{"path": "a.txt", "content": "x"}]
    kept = SandboxSpec.model_validate({"files": one})
    assert build.files_digest(SandboxSpec(), "pod-1") is None
    assert build.files_digest(kept, "pod-1") == build.files_digest(kept, "pod-2")
    edited = SandboxSpec.model_validate({"files": [{**one[0], "mode": 0o600}]})
    assert build.files_digest(edited, "pod-1") != build.files_digest(kept, "pod-1")
    # An emptyDir starts empty in every pod: a new pod gets the files again.
    scratch = SandboxSpec.model_validate({"files": one, "workspace": {"ephemeral": True}})
    assert build.files_digest(scratch, "pod-1") != build.files_digest(scratch, "pod-2")


def test_the_workspace_is_home_and_working_directory_where_the_spec_mounts_it() -> None:
    spec = SandboxSpec.model_validate({"workspace": {"mountPath": "/home/user"}})
    pod = build.build_pod(REF, spec, SETTINGS)
    sandbox = next(c for c in pod["spec"]["containers"] if c["name"] == "sandbox")
    agent = next(c for c in pod["spec"]["containers"] if c["name"] == "agent")
    assert {"name": "workspace", "mountPath": "/home/user"} in sandbox["volumeMounts"]
    assert sandbox["workingDir"] == "/home/user"
    assert {"name": "HOME", "value": "/home/user"} in sandbox["env"]
    # The agent serves the same volume at its own, fixed place.
    assert {"name": "workspace", "mountPath": "/workspace"} in agent["volumeMounts"]


def test_a_pod_of_an_older_operator_is_kept_while_its_digest_matches() -> None:
    spec = SandboxSpec.model_validate({"runtime": "python", "env": [{"name": "A", "value": "1"}]})
    pod = build.build_pod(REF, spec, SETTINGS)
    pod["metadata"]["annotations"][POD_HASH_ANNOTATION] = build.legacy_pod_hash(spec)
    assert build.changed_fields(pod, spec) == []
    # The digest that release computed for a spec with an exposed port (no `public` then).
    ported = SandboxSpec.model_validate(
        {"runtime": "python", "network": {"exposedPorts": [{"name": "web", "port": 80}]}}
    )
    assert build.legacy_pod_hash(ported) == "a00debd0fa04020c"
    other = SandboxSpec.model_validate({"runtime": "node"})
    assert build.changed_fields(pod, other) is None


def _quantity_bytes(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    for suffix, factor in units.items():
        if q.endswith(suffix):
            return int(q[: -len(suffix)]) * factor
    return int(q)


def test_agent_budgets_come_from_its_limits() -> None:
    """The agent learns its real memory limit and a log budget inside its log volume."""
    pod = _pod()
    agent = next(c for c in pod["spec"]["containers"] if c["name"] == identity.AGENT_CONTAINER)
    env = {e["name"]: e for e in agent["env"]}
    assert env["SANDBOX_AGENT_MEMORY_LIMIT_BYTES"]["valueFrom"] == {
        "resourceFieldRef": {"containerName": identity.AGENT_CONTAINER, "resource": "limits.memory"}
    }
    assert "memory" in agent["resources"]["limits"]
    logs = next(v for v in pod["spec"]["volumes"] if v["name"] == "agent-logs")
    budget = int(env["SANDBOX_AGENT_MAX_LOG_DIR_BYTES"]["value"])
    assert 0 < budget <= _quantity_bytes(logs["emptyDir"]["sizeLimit"]) * 3 // 4


def test_managed_fields_leave_the_event_kopf_keeps_and_nothing_else_does() -> None:
    """Kopf keeps the event it hands the index functions (a Sandbox's latest
    body, for as long as its daemon lives): the fields go from that very
    object, seen through Kopf's own read-only view of it."""
    import kopf

    raw: dict[str, Any] = {
        "metadata": {
            "name": "box",
            "labels": {"a": "b"},
            "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}],
        },
        "spec": {"image": "python"},
        "status": {"phase": "Running"},
    }
    # As Kopf wraps the parsed event (its RawBody type does not know managedFields).
    event = cast(kopf.RawBody, raw)
    indexes.drop_managed_fields(kopf.Body(event))
    assert raw == {
        "metadata": {"name": "box", "labels": {"a": "b"}},
        "spec": {"image": "python"},
        "status": {"phase": "Running"},
    }
    indexes.drop_managed_fields(kopf.Body(event))  # an event without them: nothing to do


def test_pod_essentials_keep_what_reconciliation_reads_and_little_else() -> None:
    spec = {"env": [{"name": "GREETING", "value": "hi"}]}
    pod = build.desired_pod(REF, SandboxSpec.model_validate(spec), SETTINGS)
    pod["metadata"]["managedFields"] = [{"manager": "kubectl", "fieldsV1": {}}]
    pod["metadata"]["uid"] = "pod-uid"
    pod["status"] = {"phase": "Running", "podIP": "10.0.0.7", "containerStatuses": []}
    kept = indexes.pod_essentials(pod)
    # Decisions and status read these.
    assert kept["status"] == pod["status"]
    assert kept["metadata"]["uid"] == "pod-uid"
    assert kept["metadata"]["annotations"] == pod["metadata"]["annotations"]
    assert kept["metadata"]["labels"] == pod["metadata"]["labels"]
    assert build.changed_fields(kept, SandboxSpec.model_validate(spec)) == []
    # The env sync compares the sandbox container's env.
    (container,) = kept["spec"]["containers"]
    assert container["name"] == identity.SANDBOX_CONTAINER
    assert {"name": "GREETING", "value": "hi"} in container["env"]
    # The rest is left behind.
    assert "managedFields" not in kept["metadata"]
    assert set(kept["spec"]) == {"containers"}
    assert len(json.dumps(kept)) < len(json.dumps(pod)) / 2
    # Once scheduled, its node (a pause that keeps memory asks that node).
    pod["spec"]["nodeName"] = "node-a"
    assert indexes.pod_essentials(pod)["spec"]["nodeName"] == "node-a"


def test_preview_urls_are_on_the_gateways_external_url() -> None:
    """status.ports[].url is where users are told to go: on the gateway's external
    URL when the chart sets one (gateway.externalURL), a path under it, whatever
    trailing slash it was given; without it, the in-cluster URL; by host when a
    preview domain is set; none without a gateway."""
    spec = SandboxSpec.model_validate(
        {"network": {"exposedPorts": [{"name": "web", "port": 3000, "public": True}]}}
    )
    tail = "/v1/namespaces/team-a/sandboxes/demo/ports/3000/"
    for base in ("http://10.96.0.12", "https://sandboxes.example.com/gw/"):
        external = Settings(gateway_url=base)
        assert build.preview_url(REF, 3000, external) == base.rstrip("/") + tail
        assert build.port_statuses(REF, spec, external) == [
            {"name": "web", "port": 3000, "url": base.rstrip("/") + tail, "public": True}
        ]
    in_cluster = Settings(gateway_url="http://sbx-gateway.sandbox-system.svc")
    assert build.preview_url(REF, 3000, in_cluster) == (
        "http://sbx-gateway.sandbox-system.svc" + tail
    )
    by_host = Settings(gateway_url="http://10.96.0.12", preview_domain="preview.example.com")
    assert build.preview_url(REF, 3000, by_host) == "https://3000-demo-team-a.preview.example.com/"
    assert build.preview_url(REF, 3000, SETTINGS) is None
    assert build.port_statuses(REF, spec, SETTINGS)[0]["url"] is None


def test_runner_bootstrap_waits_for_the_runner_then_becomes_it(tmp_path: Path) -> None:
    """The sandbox container's entrypoint, run for real: it waits for runner.py,
    then execs it as `python3 runner.py` would run, never importing from the
    working directory or the user's site-packages (both in the user's
    workspace, where anything may be planted)."""
    run_dir, workspace = tmp_path / "run", tmp_path / "workspace"
    run_dir.mkdir()
    workspace.mkdir()
    (workspace / "json.py").write_text("raise SystemExit('imported from the workspace')\n")
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    user_site = workspace / ".local" / "lib" / version / "site-packages"
    user_site.mkdir(parents=True)
    (user_site / "planted.pth").write_text("import sys; sys.exit('ran the planted .pth')\n")
    (user_site / "usercustomize.py").write_text("raise SystemExit('ran usercustomize')\n")
    code = build.RUNNER_BOOTSTRAP.replace(build.RUNTIME_DIR, str(run_dir))
    # As the pod runs it: its own command and flags, HOME the workspace.
    command = next(c for c in _containers(_pod()) if c["name"] == "sandbox")["command"]
    env = {**os.environ, "HOME": str(workspace)}
    proc = subprocess.Popen(
        [*command[:-1], code], cwd=workspace, stdout=subprocess.PIPE, text=True, env=env
    )
    time.sleep(0.2)
    assert proc.poll() is None  # waiting for the runner
    runner = "import json, sys; print(json.dumps([sys.argv[0], sys.path[0]]))\n"
    (run_dir / ".runner.py.tmp").write_text(runner)
    (run_dir / ".runner.py.tmp").rename(run_dir / "runner.py")  # atomically, as the agent does
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert json.loads(out) == [str(run_dir / "runner.py"), str(run_dir)]


def test_every_probe_outwaits_a_busy_node() -> None:
    """No probe keeps the kubelet's 1 s timeout: on a busy node that fails
    probes of a healthy agent and posts a Warning Event for each."""
    probes = [
        (container["name"], kind, container[kind])
        for container in _containers(_pod())
        for kind in ("startupProbe", "readinessProbe", "livenessProbe")
        if kind in container
    ]
    assert len(probes) >= 3
    for name, kind, probe in probes:
        assert probe.get("timeoutSeconds", 1) >= 3, (name, kind, probe)
