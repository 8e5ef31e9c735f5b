"""The main job on a real single-node cluster: `make up` / `make down`.

    python hack/up.py up     # node cluster + storage, the chart, examples/, a command in a sandbox
    python hack/up.py down   # remove everything `up` started
    python hack/up.py up --name NAME   # another cluster than `local` (the e2e suite's)

Every step prints a line when it starts and when it ends, with the time since
the run began (a cold machine spends minutes in Go and image builds), and the
run ends with commands to try against the cluster.

`up` is safe to repeat: a healthy cluster is reused, the chart is upgraded in
place, the examples are re-applied.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from devcluster import build, deploy, helm, hostdeps, versions  # noqa: E402
from devcluster import images as imagelib  # noqa: E402
from devcluster.cluster import LocalCluster  # noqa: E402
from devcluster.progress import Progress, clock_text  # noqa: E402
from sandbox_operator.resources import RESUME_ANNOTATION  # noqa: E402

NAME = "local"
DEMO_ACCOUNT = "sandbox-demo"
# The E2B adapter is off in the chart's defaults and on here (docs/e2b.md).
E2B_ON = "gateway.e2b.enabled=true"


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
    url = _gateway_url(cluster)
    assert url is not None, "the chart made no gateway Service"
    return url, token.stdout.strip()


def _gateway_url(cluster: LocalCluster) -> str | None:
    """The gateway Service's ClusterIP URL (kube-proxy on the node makes it reachable
    from this host as is); None before the chart made the Service."""
    found = deploy.kubectl(
        cluster, "get", "service", "-n", deploy.NAMESPACE, f"{deploy.RELEASE}-gateway", "-o", "json"
    )
    if found.returncode != 0:
        return None
    spec = json.loads(found.stdout)["spec"]
    port = spec["ports"][0]["port"]
    return f"http://{spec['clusterIP']}" + ("" if port == 80 else f":{port}")


STEPS = 7
# What to try once the cluster is up: (what it shows, the command). Run from the
# repository root after the `export` line `up` prints; the e2e suite runs them.
Hint = tuple[str, str]


def _step(n: int, title: str) -> str:
    return f"[{n}/{STEPS}] {title}"


def _build(progress: Progress, cluster: LocalCluster) -> None:
    """Host packages, Go binaries and images, each with its own progress lines (the
    cluster's start would build them too, silently)."""
    with progress.step(
        _step(1, "host packages (containerd, runc, CNI plugins, mmdebstrap)")
    ) as said:
        installed = hostdeps.ensure()
        said.append(f"installed {' '.join(installed)}" if installed else "all present")
    title = "Go binaries: Kubernetes, etcd, crictl, kube-proxy, CoreDNS, CSI, helm"
    with progress.step(_step(2, f"{title} (about 10 min on a cold cache)")) as said:
        cached = build.binaries_current(versions.KUBERNETES_COMMANDS)
        cluster.binaries(build_missing=True)
        helm.helm_binary()
        said.append("cached" if cached else "built")
    names = cluster.image_names
    for i, name in enumerate(names, 1):
        spec = imagelib.IMAGES[name]
        with progress.step(_step(3, f"image {i}/{len(names)} {name}")) as said:
            hit = imagelib.cached(spec) is not None
            image = imagelib.ensure_built(spec)
            said.append("cached" if hit else f"built, {image.layer_bytes / 2**20:.0f} MiB")


def _start(progress: Progress, cluster: LocalCluster) -> None:
    with progress.step(_step(4, f"cluster {cluster.name}")) as said:
        if cluster.is_healthy():
            # Images of changed sources are rebuilt and imported (a cache hit otherwise).
            refreshed = cluster.load_images(cluster.image_names)
            said.append(f"already running at {cluster.server}")
            if refreshed:
                said.append(f"images re-imported: {', '.join(refreshed)}")
        else:
            cluster.start()
            said.append(f"up at {cluster.server}")
            refreshed = []
    with progress.step(_step(5, f"chart {deploy.RELEASE} in {deploy.NAMESPACE}")) as said:
        # The URLs handed out (preview ports, downloads) on the address this host
        # reaches the gateway at: its ClusterIP, known once the Service exists.
        known = _gateway_url(cluster)
        external = [f"gateway.externalURL={known}"] if known else []
        installed = deploy.install_operator(cluster, extra_values=[*external, E2B_ON])
        said.append(installed.strip().splitlines()[0])
        if known is None:
            deploy.install_operator(
                cluster, extra_values=[f"gateway.externalURL={_gateway_url(cluster)}", E2B_ON]
            )
        if any("sandbox-operator" in reference for reference in refreshed):
            # Same tag, new image: the Deployment's template did not change, so roll it.
            deploy.restart_operator(cluster)
            said.append("restarted on the new image")
        deploy.wait_for_crds(cluster)


def _examples(progress: Progress, cluster: LocalCluster) -> list[str]:
    """Apply examples/ and wait for each Sandbox and Execution; the Sandboxes' names."""
    with progress.step(_step(6, "examples/")) as said:
        # Where the examples go, as users are told to label theirs (docs/security.md).
        deploy.restrict_namespace(cluster, "default")
        applied = deploy.kubectl(cluster, "apply", "-o", "name", "-f", str(REPO / "examples"))
        if applied.returncode != 0:
            raise SystemExit(applied.stderr.strip())
        # The examples' own Sandboxes: not what else the namespace holds (pool
        # members, a user's), which this run has no business waiting for.
        names = sorted(
            line.split("/", 1)[1]
            for line in applied.stdout.split()
            if line.startswith("sandbox.sandbox.dev/")
        )
        items = _json(cluster, "get", "sandboxes")["items"]
        assert isinstance(items, list)
        for item in items:
            if item["metadata"]["name"] in names and (item.get("status") or {}).get("idlePausedAt"):
                # Paused by its idle policy since an earlier run: resumed as the
                # docs/sandboxes.md tells users to.
                deploy.kubectl(
                    cluster,
                    "annotate",
                    "--overwrite",
                    f"sandbox/{item['metadata']['name']}",
                    f"{RESUME_ANNOTATION}={datetime.now(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}",
                )
        for name in names:
            waited = deploy.kubectl(
                cluster, "wait", "--for=condition=Ready", f"sandbox/{name}", "--timeout=300s"
            )
            if waited.returncode != 0:
                progress.text(deploy.kubectl(cluster, "get", "sandbox", name, "-o", "yaml").stdout)
                raise SystemExit(f"sandbox {name} did not become Ready")
            progress.line(f"  sandbox/{name} Ready")
        executions = _json(cluster, "get", "executions")["items"]
        assert isinstance(executions, list)
        for item in executions:
            name = item["metadata"]["name"]
            waited = deploy.kubectl(
                cluster, "wait", "--for=condition=Complete", f"execution/{name}", "--timeout=300s"
            )
            if waited.returncode != 0:
                progress.text(
                    deploy.kubectl(cluster, "get", "execution", name, "-o", "yaml").stdout
                )
                raise SystemExit(f"execution {name} did not complete")
            progress.line(f"  execution/{name} Complete")
        said.append(f"{len(names)} sandboxes Ready, {len(executions)} executions complete")
    return names


def _demo(progress: Progress, cluster: LocalCluster, name: str) -> str:
    """A command in sandbox `name` through the gateway; the gateway's URL."""
    with progress.step(_step(7, f"a command in sandbox {name} through the gateway")):
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
    progress.text(
        f"$ {command}    # in sandbox {name}, through the gateway at {gateway} "
        f"as ServiceAccount default/{DEMO_ACCOUNT}\n"
        f"{result['stdout']}"
        f"(exit {result['exitCode']}, {result['durationSeconds'] * 1000:.0f} ms)"
    )
    return gateway


def environment(cluster: LocalCluster) -> str:
    """The line that points a shell at the cluster: its kubeconfig, and kubectl
    and `kubectl-sandbox` (the SDK's plugin, in the repository's .venv) on PATH."""
    path = f"{cluster.kubectl.parent}:{REPO / '.venv' / 'bin'}:$PATH"
    return f"export KUBECONFIG={cluster.kubeconfig} PATH={path}"


def next_steps(sandbox: str, gateway: str) -> list[Hint]:
    """Commands that work against the cluster `up` left running (after `environment`)."""
    return [
        ("the custom resources", "kubectl get sandboxes,executions,pods -o wide"),
        ("a sandbox's status, as scripts read it", f"kubectl get sandbox {sandbox} -o yaml"),
        ("the kubectl plugin: list sandboxes", "kubectl sandbox list"),
        (
            "the kubectl plugin: a command in a sandbox",
            f"kubectl sandbox exec {sandbox} -- python3 -c 'print(6 * 7)'",
        ),
        (
            "a terminal in a sandbox (with no command: its login shell, interactive)",
            f"kubectl sandbox shell {sandbox} -- python3 -c 'print(6 * 7)'",
        ),
        (
            "a sandbox under gVisor sees its kernel",
            "kubectl sandbox exec untrusted-demo -- sh -c 'uname -r; dmesg | head -1'",
        ),
        ("the Python SDK: a one-shot sandbox", "python examples/sdk/one_shot.py"),
        (
            "the gateway's HTTP API",
            f'curl -sf -H "Authorization: Bearer $(kubectl create token {DEMO_ACCOUNT})"'
            f" '{gateway}/v1/namespaces/default/sandboxes/{sandbox}/files/list?path=.'",
        ),
        (
            "E2B's SDK, unchanged, through the E2B adapter (docs/e2b.md)",
            f"export E2B_API_URL={gateway}:3000 E2B_SANDBOX_URL={gateway}:3000"
            f" E2B_API_KEY=$(kubectl create token {DEMO_ACCOUNT} --duration=24h);"
            " python examples/e2b/hello_e2b.py",
        ),
    ]


def up(name: str = NAME, progress: Progress | None = None) -> None:
    progress = progress or Progress()
    cluster = deploy.node_cluster(name)
    with progress.attach():
        _build(progress, cluster)
        _start(progress, cluster)
        names = _examples(progress, cluster)
        gateway = _demo(progress, cluster, names[0])
    progress.text("")
    progress.text(deploy.kubectl(cluster, "get", "sandboxes", "-o", "wide").stdout)
    progress.line(f"up in {clock_text(progress.elapsed()).strip()}. Try next (from {REPO}):")
    progress.text(f"  {environment(cluster)}")
    for what, command in next_steps(names[0], gateway):
        progress.text(f"  $ {command}    # {what}")
    down = "make down" if name == NAME else f"python hack/up.py down --name {name}"
    progress.text(f"Stop: {down}")


def down(name: str = NAME) -> None:
    cluster = deploy.node_cluster(name)
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
    parser.add_argument(
        "--name", default=NAME, help=f"the cluster's name (default: {NAME}, the one `make up` runs)"
    )
    args = parser.parse_args()
    up(args.name) if args.action == "up" else down(args.name)


if __name__ == "__main__":
    main()
