"""Deploy the project onto a local node cluster the way a user would: the chart.

The images are already in the node's containerd (LocalCluster imports them on
start); CRDs come with the chart; the operator runs in-cluster as a Deployment.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from devcluster import helm
from devcluster.cluster import LocalCluster
from devcluster.storage import StorageAddon

REPO = Path(__file__).resolve().parent.parent
RELEASE = "sandbox-operator"
NAMESPACE = "sandbox-system"
# The operator's pods, all replicas (the chart's selector labels).
OPERATOR_SELECTOR = f"app.kubernetes.io/name=sandbox-operator,app.kubernetes.io/instance={RELEASE}"
# Pod Security Admission at its strictest, refusing (and warning about) any pod
# that is not `restricted`: the operator's, the gateway's and every sandbox's.
POD_SECURITY_RESTRICTED = {
    f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "warn", "audit")
}


def restricted_namespace(name: str) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": POD_SECURITY_RESTRICTED},
    }


def restrict_namespace(cluster: LocalCluster, name: str) -> None:
    """Create `name` (or label it, if it exists) to enforce Pod Security `restricted`."""
    done = subprocess.run(
        [str(cluster.kubectl), f"--kubeconfig={cluster.kubeconfig}", "apply", "-f", "-"],
        input=json.dumps(restricted_namespace(name)),
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if done.returncode != 0:
        raise RuntimeError(f"namespace {name}: {done.stderr.strip()}")


def node_cluster(name: str, *, die_with_parent: bool = False) -> LocalCluster:
    """A single-node cluster with the CSI storage stack (snapshots included)."""
    return LocalCluster(name, addons=[StorageAddon()], die_with_parent=die_with_parent)


def install_operator(
    cluster: LocalCluster, *, extra_values: list[str] | None = None, chart: Path | None = None
) -> str:
    """`helm upgrade --install` of charts/sandbox-operator (or of `chart`, e.g. an
    earlier version of it), waiting for the Deployment."""
    restrict_namespace(cluster, NAMESPACE)
    values = ["image.repository=sandbox-operator", "image.tag=dev", "image.pullPolicy=Never"]
    if chart is None:
        # The node saves gVisor pods whole for pauses that keep memory
        # (checkpointd; an earlier chart may not know its values).
        values += [*cluster.checkpointd_values(), "checkpointd.image.pullPolicy=Never"]
    # No extraEnv: kube-proxy on the node makes the `kubernetes` ClusterIP the
    # kubelet injects work, as on any cluster.
    return helm.install_chart(
        cluster.kubeconfig,
        chart or REPO / "charts" / "sandbox-operator",
        release=RELEASE,
        namespace=NAMESPACE,
        values=[*values, *(extra_values or [])],
    )


def restart_operator(cluster: LocalCluster, timeout: float = 180) -> None:
    """Roll the operator's and the gateway's Deployments (both run the operator's
    image: a newly imported image of the same tag)."""
    deployments = (f"deployment/{RELEASE}", f"deployment/{RELEASE}-gateway")
    for args in (
        ("rollout", "restart", "-n", NAMESPACE, *deployments),
        *(
            ("rollout", "status", "-n", NAMESPACE, d, f"--timeout={int(timeout)}s")
            for d in deployments
        ),
    ):
        done = kubectl(cluster, *args, timeout=timeout + 30)
        if done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")


def kubectl(
    cluster: LocalCluster, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(cluster.kubectl), f"--kubeconfig={cluster.kubeconfig}", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def wait_for_crds(cluster: LocalCluster, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        done = kubectl(
            cluster,
            "wait",
            "--for=condition=Established",
            "crd",
            "-l",
            "app.kubernetes.io/part-of=sandbox-operator",
            "--timeout=10s",
        )
        if done.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"CRDs not established: {done.stderr}")
        time.sleep(1)
