"""The main job on a real single-node cluster: `make up` / `make down`.

    python hack/up.py up     # node cluster + storage, the chart, examples/, a command in a sandbox
    python hack/up.py down   # remove everything `up` started

`up` is safe to repeat: a healthy cluster is reused, the chart is upgraded in
place, the examples are re-applied.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from devcluster import deploy  # noqa: E402
from devcluster.cluster import LocalCluster  # noqa: E402
from sandbox_operator.resources import LABEL_EXECUTION_UID  # noqa: E402

NAME = "local"
DEMO_ACCOUNT = "sandbox-demo"


def _json(cluster: LocalCluster, *args: str) -> dict[str, object]:
    result = deploy.kubectl(cluster, *args, "-o", "json")
    if result.returncode != 0:
        raise SystemExit(result.stderr)
    data: dict[str, object] = json.loads(result.stdout)
    return data


def _gateway_access(cluster: LocalCluster) -> tuple[str, str]:
    """The gateway's Service URL and a token of a ServiceAccount bound to the chart's
    user role in `default`: the way a service in the cluster reaches a sandbox."""
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": DEMO_ACCOUNT, "namespace": "default"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": f"{deploy.RELEASE}-user",
        },
        "subjects": [{"kind": "ServiceAccount", "name": DEMO_ACCOUNT, "namespace": "default"}],
    }
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": DEMO_ACCOUNT, "namespace": "default"},
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json") as manifest:
        json.dump({"apiVersion": "v1", "kind": "List", "items": [account, binding]}, manifest)
        manifest.flush()
        applied = deploy.kubectl(cluster, "apply", "-f", manifest.name)
    if applied.returncode != 0:
        raise SystemExit(applied.stderr)
    token = deploy.kubectl(cluster, "create", "token", DEMO_ACCOUNT, "-n", "default")
    if token.returncode != 0:
        raise SystemExit(token.stderr)
    service = _json(cluster, "get", "service", "-n", deploy.NAMESPACE, f"{deploy.RELEASE}-gateway")
    spec = service["spec"]
    assert isinstance(spec, dict)
    return f"http://{spec['clusterIP']}", token.stdout.strip()


def up() -> None:
    began = time.monotonic()
    cluster = deploy.node_cluster(NAME)
    refreshed: list[str] = []
    if cluster.is_healthy():
        print(f"cluster: already running at {cluster.server}")
        # Images of changed sources are rebuilt and imported (a cache hit otherwise).
        refreshed = cluster.load_images(cluster.image_names)
        if refreshed:
            print(f"images: rebuilt {', '.join(refreshed)}")
    else:
        print(
            "cluster: starting (installs Debian packages, builds binaries and images when cold)..."
        )
        cluster.start()
        print(f"cluster: up at {cluster.server} in {cluster.start_duration:.1f}s")
    print(deploy.install_operator(cluster).strip().splitlines()[0])
    if any("sandbox-operator" in reference for reference in refreshed):
        # Same tag, new image: the Deployment's template did not change, so roll it.
        deploy.restart_operator(cluster)
    deploy.wait_for_crds(cluster)
    applied = deploy.kubectl(cluster, "apply", "-f", str(REPO / "examples"))
    print(applied.stdout.strip() or applied.stderr.strip())
    if applied.returncode != 0:
        raise SystemExit(1)
    items = _json(cluster, "get", "sandboxes")["items"]
    assert isinstance(items, list)
    # One-shot sandboxes belong to their Execution and go away with its end.
    names = [
        item["metadata"]["name"]
        for item in items
        if LABEL_EXECUTION_UID not in (item["metadata"].get("labels") or {})
    ]
    for name in names:
        waited = deploy.kubectl(
            cluster, "wait", "--for=condition=Ready", f"sandbox/{name}", "--timeout=300s"
        )
        if waited.returncode != 0:
            print(deploy.kubectl(cluster, "get", "sandbox", name, "-o", "yaml").stdout)
            raise SystemExit(f"sandbox {name} did not become Ready")
    executions = _json(cluster, "get", "executions")["items"]
    assert isinstance(executions, list)
    for item in executions:
        name = item["metadata"]["name"]
        waited = deploy.kubectl(
            cluster, "wait", "--for=condition=Complete", f"execution/{name}", "--timeout=300s"
        )
        if waited.returncode != 0:
            print(deploy.kubectl(cluster, "get", "execution", name, "-o", "yaml").stdout)
            raise SystemExit(f"execution {name} did not complete")
    print()
    print(deploy.kubectl(cluster, "get", "sandboxes", "-o", "wide").stdout)
    print(deploy.kubectl(cluster, "get", "executions").stdout)
    print(deploy.kubectl(cluster, "get", "pods,pvc", "-o", "wide").stdout)

    name = names[0]
    gateway, token = _gateway_access(cluster)
    command = (
        "python3 -c 'import platform, os;"
        " print(platform.python_version(), os.getcwd(), os.getuid())'"
    )
    response = httpx.post(
        f"{gateway}/v1/namespaces/default/sandboxes/{name}/executions",
        json={"command": command},
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )
    response.raise_for_status()
    result = response.json()
    print(
        f"$ {command}    # in sandbox {name}, through the gateway at {gateway} "
        f"as ServiceAccount default/{DEMO_ACCOUNT}"
    )
    print(result["stdout"], end="")
    print(f"(exit {result['exitCode']}, {result['durationSeconds'] * 1000:.0f} ms)")
    print(
        f"\nup in {time.monotonic() - began:.0f}s.\n"
        f"Explore: export KUBECONFIG={cluster.kubeconfig}; {cluster.kubectl} get sandboxes\n"
        f'Gateway: curl -H "Authorization: Bearer $(kubectl create token {DEMO_ACCOUNT})" '
        f"'{gateway}/v1/namespaces/default/sandboxes/{name}/files/list?path=.'\n"
        "Stop:    make down"
    )


def down() -> None:
    cluster = deploy.node_cluster(NAME)
    cluster.stop(remove_state=True)
    print(
        "cluster: stopped; processes, mounts, interfaces, iptables rules, nftables tables "
        "and state removed"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("action", choices=["up", "down"])
    args = parser.parse_args()
    up() if args.action == "up" else down()


if __name__ == "__main__":
    main()
