"""Edges of what the API admits: the longest names, the largest objects, and
children the API server refuses. Every case ends with a status that says what
happened, and every object can still be deleted."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devcluster.controlplane import ControlPlane
from sandbox_operator.api.common import MAX_INPUT_CHARACTERS
from sandbox_operator.api.sandbox import MAX_ENV_CHARACTERS
from sandbox_operator.resources import (
    LABEL_EXECUTION_UID,
    LABEL_MANAGED_BY,
    LABEL_SANDBOX,
    MANAGED_BY,
)
from tests.executions import Executions
from tests.integration.conftest import kubectl
from tests.integration.harness import AgentProcess, wait_for
from tests.kube import JSON, ApiError, KubeJSON, api_path, core_path
from tests.quotas import quota_exceeded, ready_reason, resource_quota
from tests.sandboxes import Sandboxes
from tests.snapshots import Snapshots

ADMISSION = "admissionregistration.k8s.io/v1"


def _labels_fit(obj: JSON) -> None:
    for key, value in (obj["metadata"].get("labels") or {}).items():
        assert len(value) <= 63, f"label {key} of {obj['metadata']['name']}: {value}"


def test_the_longest_names_of_every_kind_reach_a_status(
    sandboxes: Sandboxes,
    executions: Executions,
    kube: KubeJSON,
    live_sandbox: Callable[..., AgentProcess],
) -> None:
    ns = sandboxes.namespace
    box = "s" + "x" * 49  # the longest Sandbox name (its children's names derive from it)
    live_sandbox(
        box, {"runtime": "python", "network": {"exposedPorts": [{"name": "w", "port": 80}]}}
    )
    for child in (
        core_path("pods", ns, box),
        core_path("persistentvolumeclaims", ns, f"{box}-workspace"),
        core_path("secrets", ns, f"{box}-agent-token"),
        core_path("services", ns, box),
        api_path("networking.k8s.io/v1", "networkpolicies", ns, box),
    ):
        _labels_fit(kube.read(child))

    long_run = "r" * 253
    executions.run(long_run, box, "echo long")
    assert executions.wait_done(long_run)["phase"] == "Succeeded"

    # A one-shot Execution labels its sandbox with its UID, not its 253-character name.
    one_shot = "o" * 253
    executions.create(one_shot, {"sandboxTemplate": {"runtime": "python"}, "script": "true"})
    status = executions.wait_status(one_shot, "a sandbox", lambda s: bool(s.get("sandbox")))
    sandbox = sandboxes.read(status["sandbox"])
    uid = executions.read(one_shot)["metadata"]["uid"]
    assert sandbox["metadata"]["labels"][LABEL_EXECUTION_UID] == uid
    _labels_fit(sandbox)
    assert status["reason"] == "SandboxStarting"

    # Snapshots: here without snapshot support, the status still says why.
    snapshots = Snapshots(kube, ns)
    long_snap = "n" * 253
    snapshots.create(long_snap, box)
    failed = snapshots.wait_phase(long_snap, "Failed")
    assert failed["status"]["conditions"][-1]["reason"] == "SnapshotsUnsupported"


def _apply(cp: ControlPlane, manifest: JSON, tmp_path: Path) -> None:
    path = tmp_path / f"{manifest['metadata']['name']}.json"
    path.write_text(json.dumps(manifest))
    applied = kubectl(cp, "apply", "-f", str(path))
    assert applied.returncode == 0, applied.stderr


def _largest(ns: str) -> list[JSON]:
    """The largest object of each kind the schema admits (ASCII text)."""
    env = [{"name": f"V{i}", "value": "e" * (MAX_ENV_CHARACTERS // 4)} for i in range(4)]
    api = "sandbox.dev/v1alpha1"
    sandbox = {
        "apiVersion": api,
        "kind": "Sandbox",
        "metadata": {"name": "biggest", "namespace": ns},
        "spec": {"runtime": "python", "env": env},
    }
    part = MAX_INPUT_CHARACTERS // 4
    execution = {
        "apiVersion": api,
        "kind": "Execution",
        "metadata": {"name": "biggest-run", "namespace": ns},
        "spec": {
            # A one-shot sandbox as large as a Sandbox may be, and inputs as large
            # as an Execution may hold.
            "sandboxTemplate": {"runtime": "python", "env": env},
            "script": "s" * part,
            "stdin": "i" * part,
            "files": [{"path": "a.txt", "content": "f" * part}],
            "env": [{"name": "E", "value": "v" * part}],
        },
    }
    snapshot = {
        "apiVersion": api,
        "kind": "Snapshot",
        "metadata": {"name": "biggest-snap", "namespace": ns},
        "spec": {"sandboxRef": {"name": "biggest"}, "tag": "t" * 128, "description": "d" * 1024},
    }
    return [sandbox, execution, snapshot]


def test_the_largest_valid_objects_can_be_applied_reconciled_and_deleted(
    control_plane: ControlPlane, kube: KubeJSON, ns: str, tmp_path: Path
) -> None:
    """kubectl apply keeps a copy of the object in an annotation; Kopf's diff base
    must not add another, or the annotations pass the API server's 256 KiB limit
    and no patch (not even the finalizer's removal) is accepted any more."""
    manifests = _largest(ns)
    plurals = {"Sandbox": "sandboxes", "Execution": "executions", "Snapshot": "snapshots"}
    for manifest in manifests:
        _apply(control_plane, manifest, tmp_path)
    for manifest in manifests:
        path = api_path("sandbox.dev/v1alpha1", plurals[manifest["kind"]], ns)
        name = manifest["metadata"]["name"]

        def handled(path: str = path, name: str = name) -> JSON | None:
            body = kube.get(f"{path}/{name}")
            if body and body["metadata"].get("finalizers") and body.get("status"):
                return body
            return None

        body = wait_for(handled, 30, f"{manifest['kind']} {name} handled")
        size = sum(len(k) + len(v) for k, v in body["metadata"]["annotations"].items())
        assert size < 256 * 1024
    for manifest in reversed(manifests):
        name = f"{plurals[manifest['kind']]}/{manifest['metadata']['name']}"
        deleted = kubectl(control_plane, "delete", "-n", ns, name, "--wait", "--timeout=60s")
        assert deleted.returncode == 0, deleted.stderr


@pytest.fixture
def policy(kube: KubeJSON, ns: str) -> Iterator[Callable[[str, str, str], None]]:
    """Refuse objects in the test's namespace with a ValidatingAdmissionPolicy (the
    API server answers 422 with the policy's message), as a cluster admin might."""
    made: list[str] = []

    def refuse(resource: str, expression: str, message: str) -> None:
        name = f"refuse-{uuid.uuid4().hex[:8]}"
        group = "sandbox.dev" if resource == "sandboxes" else ""
        kube.create(
            api_path(ADMISSION, "validatingadmissionpolicies"),
            {
                "apiVersion": ADMISSION,
                "kind": "ValidatingAdmissionPolicy",
                "metadata": {"name": name},
                "spec": {
                    "failurePolicy": "Fail",
                    "matchConstraints": {
                        "resourceRules": [
                            {
                                "apiGroups": [group],
                                "apiVersions": ["*"],
                                "operations": ["CREATE"],
                                "resources": [resource],
                            }
                        ]
                    },
                    "validations": [{"expression": expression, "message": message}],
                },
            },
        )
        kube.create(
            api_path(ADMISSION, "validatingadmissionpolicybindings"),
            {
                "apiVersion": ADMISSION,
                "kind": "ValidatingAdmissionPolicyBinding",
                "metadata": {"name": name},
                "spec": {
                    "policyName": name,
                    "validationActions": ["Deny"],
                    "matchResources": {
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}
                    },
                },
            },
        )
        made.append(name)

    yield refuse
    for name in made:
        kube.delete(api_path(ADMISSION, "validatingadmissionpolicybindings", name=name))
        kube.delete(api_path(ADMISSION, "validatingadmissionpolicies", name=name))


def _create_failed(sandboxes: Sandboxes, name: str) -> JSON:
    """The Sandbox's Ready condition once it says CreateFailed."""
    body = sandboxes.wait_object(
        name,
        "CreateFailed",
        lambda s: any(c.get("reason") == "CreateFailed" for c in s.get("conditions", [])),
    )
    return next(c for c in body["status"]["conditions"] if c["type"] == "Ready")


def test_a_refused_child_is_reported_in_status(
    sandboxes: Sandboxes,
    executions: Executions,
    kube: KubeJSON,
    policy: Callable[[str, str, str], None],
) -> None:
    """A 4xx on creating a child ends in a status with the API server's message,
    never in silent retries: an invalid one (422) at once, a quota (403) until
    the quota allows it."""
    ns = sandboxes.namespace
    policy("pods", "false", "pods are not allowed here")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"}}
    pod["spec"] = {"containers": [{"name": "c", "image": "x"}]}
    wait_for(lambda: _refused(kube, core_path("pods", ns), pod), 20, "the pod policy")
    sandboxes.create("refused")
    assert "pods are not allowed here" in _create_failed(sandboxes, "refused")["message"]

    policy("sandboxes", "false", "no more sandboxes")
    probe = {"apiVersion": "sandbox.dev/v1alpha1", "kind": "Sandbox", "metadata": {"name": "p"}}
    probe["spec"] = {}
    wait_for(lambda: _refused(kube, sandboxes.path(), probe), 20, "the sandbox policy")
    executions.create("orphan", {"sandboxTemplate": {"runtime": "python"}, "script": "true"})
    status = executions.wait_done("orphan")
    assert (status["phase"], status["reason"]) == ("Failed", "CreateFailed")
    assert "no more sandboxes" in status["message"]


def test_a_quota_refusal_is_reported_then_honoured(sandboxes: Sandboxes, kube: KubeJSON) -> None:
    ns = sandboxes.namespace
    resource_quota(kube, ns, "no-claims", {"persistentvolumeclaims": "0"})
    sandboxes.create("quota")
    status = sandboxes.wait_object("quota", "QuotaExceeded", quota_exceeded)["status"]
    assert "exceeded quota: no-claims" in ready_reason(status)[1]
    kube.delete(core_path("resourcequotas", ns, "no-claims"))
    wait_for(
        lambda: kube.get(core_path("persistentvolumeclaims", ns, "quota-workspace")),
        40,
        "the claim once the quota is gone",
    )


def _refused(kube: KubeJSON, path: str, body: JSON) -> bool:
    """Whether admission refuses `body` yet (a dry run: nothing is created)."""
    try:
        kube.create(f"{path}?dryRun=All", body)
    except ApiError as exc:
        return exc.status == 422
    return False


def test_kubectl_explain_describes_every_field(control_plane: ControlPlane) -> None:
    for field in (
        "sandbox.spec.lifecycle",
        "sandbox.spec.network",
        "sandbox.spec.env",
        "execution.spec.files",
        "execution.spec.stdin",
    ):
        explained = subprocess.run(
            [
                str(control_plane.kubectl),
                f"--kubeconfig={control_plane.kubeconfig}",
                "explain",
                field,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert explained.returncode == 0, explained.stderr
        assert "<no description>" not in explained.stdout, f"{field}:\n{explained.stdout}"


@pytest.mark.parametrize("copied_labels", [False, True])
def test_a_pod_the_sandbox_does_not_control_is_left_alone(
    sandboxes: Sandboxes, kube: KubeJSON, copied_labels: bool
) -> None:
    """Someone's pod that has the sandbox's pod name, even with our labels, is
    never taken for the sandbox's (it would get its commands, files and token)
    nor deleted: the status says so, and the sandbox starts once it is gone."""
    ns = sandboxes.namespace
    name = "taken"
    meta: JSON = {"name": name}
    if copied_labels:
        meta["labels"] = {LABEL_SANDBOX: name, LABEL_MANAGED_BY: MANAGED_BY}
    foreign = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "c", "image": "someone/else"}]},
    }
    wait_for(
        lambda: kube.get(core_path("serviceaccounts", ns, "default")) is not None,
        30,
        "the namespace's default ServiceAccount (pods need it)",
    )
    made = kube.create(core_path("pods", ns), foreign)
    uid = sandboxes.create(name)["metadata"]["uid"]
    ready = _create_failed(sandboxes, name)
    assert "does not control" in ready["message"], ready
    pod = kube.get(core_path("pods", ns, name))
    assert pod is not None
    assert pod["metadata"]["uid"] == made["metadata"]["uid"]
    assert not pod["metadata"].get("annotations")  # not adopted
    kube.delete(core_path("pods", ns, name=name))
    ours = wait_for(
        lambda: (
            (p := kube.get(core_path("pods", ns, name))) is not None
            and p["metadata"]["uid"] != made["metadata"]["uid"]
            and p
        ),
        60,
        "the sandbox's own pod",
    )
    assert [o["uid"] for o in ours["metadata"]["ownerReferences"]] == [uid]
