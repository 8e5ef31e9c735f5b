"""Pod Security `restricted`, enforced by this control plane's admission: every
shape of sandbox pod the operator makes is admitted, and without a warning.
(Restored sandboxes need a VolumeSnapshot API: the e2e tier covers them.)"""

from __future__ import annotations

import json

from devcluster.controlplane import ControlPlane
from devcluster.deploy import POD_SECURITY_RESTRICTED
from tests.executions import Executions
from tests.integration.conftest import kubectl
from tests.integration.harness import wait_for
from tests.kube import JSON, KubeJSON, core_path
from tests.sandboxes import Sandboxes

SHAPES: dict[str, JSON] = {
    "persistent": {"runtime": "python"},
    "ephemeral": {"runtime": "python", "workspace": {"ephemeral": True}},
    "ports": {"runtime": "python", "network": {"exposedPorts": [{"name": "web", "port": 8000}]}},
}


def _admission(control_plane: ControlPlane, ns: str, pod: JSON) -> tuple[int, str]:
    """A server-side dry run of `pod` under a fresh name: exit code and warnings."""
    meta = pod["metadata"]
    copy = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{meta['name'][:40]}-psa", "namespace": ns},
        "spec": {k: v for k, v in pod["spec"].items() if k != "nodeName"},
    }
    done = kubectl(
        control_plane,
        "create",
        "--dry-run=server",
        "--warnings-as-errors",
        "-f",
        "-",
        input=json.dumps(copy),
    )
    return done.returncode, done.stderr


def test_every_sandbox_pod_shape_is_admitted_as_restricted_without_warnings(
    control_plane: ControlPlane,
    kube: KubeJSON,
    ns: str,
    sandboxes: Sandboxes,
    executions: Executions,
) -> None:
    kube.patch(core_path("namespaces", name=ns), {"metadata": {"labels": POD_SECURITY_RESTRICTED}})
    # Admission looks up a pod's account, which the controller manager makes.
    account = core_path("serviceaccounts", ns, "default")
    wait_for(lambda: kube.get(account), 30, "the namespace's default ServiceAccount")
    # The control plane does enforce it here, or the checks below would prove nothing.
    privileged: JSON = {
        "metadata": {"name": "privileged"},
        "spec": {
            "containers": [
                {"name": "c", "image": "x", "securityContext": {"privileged": True}},
            ]
        },
    }
    code, said = _admission(control_plane, ns, privileged)
    assert code != 0, said
    assert "restricted" in said, said

    for name, spec in SHAPES.items():
        sandboxes.create(name, spec)
    executions.create(
        "one-shot",
        {
            "sandboxTemplate": {"runtime": "python", "workspace": {"ephemeral": True}},
            "script": "true",
        },
    )

    # Under enforcement a pod that is not restricted is refused: it never appears.
    def every_shape() -> list[JSON] | None:
        found = kube.list(core_path("pods", ns))
        return found if len(found) == len(SHAPES) + 1 else None

    pods = wait_for(every_shape, 60, "a pod of every shape")
    for pod in pods:
        code, said = _admission(control_plane, ns, pod)
        assert code == 0, f"{pod['metadata']['name']}: {said}"
        assert "Warning" not in said, f"{pod['metadata']['name']}: {said}"
