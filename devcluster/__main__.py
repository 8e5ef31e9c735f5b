"""`python -m devcluster up|down|status|kubeconfig [--name NAME] [--node]`.

`up` leaves the cluster running after the command exits (each component is in
its own session); `down` stops it and deletes its state. Both are safe to
repeat: `up` on a healthy cluster does nothing, on a stale one restarts it.

`--node`: the single-node cluster (`devcluster.cluster.LocalCluster`: also
kube-scheduler, containerd, kubelet, pod network, local images), default
name `local`; without it the control plane only, default name `dev`.
`down`, `status` and `kubeconfig` find out from the cluster's state which
kind it is, so `--node` only changes their default name there.
"""

from __future__ import annotations

import argparse
import logging
import sys

from devcluster import build, hostdeps, images
from devcluster.cluster import DEFAULT_NODE_CLUSTER, LocalCluster
from devcluster.controlplane import DEFAULT_NAME, ControlPlane, ControlPlaneError
from devcluster.registry import open_cluster


def _up(cluster: ControlPlane) -> int:
    if cluster.is_healthy():
        print(f"cluster {cluster.name!r} is already running at {cluster.server}", file=sys.stderr)
    else:
        print(
            f"starting cluster {cluster.name!r} (building binaries first if needed)...",
            file=sys.stderr,
        )
        cluster.start()
        print(
            f"cluster {cluster.name!r} is up at {cluster.server} "
            f"(started in {cluster.start_duration:.1f}s)",
            file=sys.stderr,
        )
    if isinstance(cluster, LocalCluster):
        # Images added since the cluster started (or rebuilt) go in without a restart.
        cluster.load_images(cluster.image_names)
        net = cluster.pod_network
        print(
            f"\nNode {cluster.node_name!r}: pods on {net.subnet} (bridge {net.bridge}, "
            f"reachable from this machine), images: {', '.join(cluster.image_names)}.\n"
            f"Pods use imagePullPolicy IfNotPresent or Never (no registry is reachable).\n"
            f"Services on {net.service_subnet} (kube-proxy; reachable from pods and from "
            f"this machine), cluster DNS {net.dns_ip} (CoreDNS, cluster.local only), "
            f"NetworkPolicy enforced (kube-network-policies).",
            file=sys.stderr,
        )
    kubectl = cluster.kubectl
    print(
        f"\nUse it with:\n"
        f"  export KUBECONFIG={cluster.kubeconfig}\n"
        f"  {kubectl} get namespaces\n"
        f"(call this kubectl by its path: it matches the server version, the one on PATH may not)\n"
        f"Logs: {cluster.logs_dir}\n"
        f"Stop: python -m devcluster down --name {cluster.name}",
        file=sys.stderr,
    )
    # stdout carries only the kubeconfig path, for scripts: KUBECONFIG=$(... up)
    print(cluster.kubeconfig)
    return 0


def _down(cluster: ControlPlane) -> int:
    existed = cluster.state_dir.exists()
    cluster.stop(remove_state=True)
    print(
        f"cluster {cluster.name!r} {'stopped and removed' if existed else 'was not present'}",
        file=sys.stderr,
    )
    return 0


def _status(cluster: ControlPlane) -> int:
    status = cluster.status()
    if not status.components:
        print(f"cluster {cluster.name!r}: not running")
        return 1
    print(f"cluster {cluster.name!r}: {'healthy' if status.healthy else 'NOT healthy'}")
    print(f"  server:     {status.server}")
    print(f"  kubeconfig: {cluster.kubeconfig}")
    for component in status.components:
        state = "running" if component.running else "dead"
        ready = "ready" if component.ready else "not ready"
        print(f"  {component.name:<24} pid {component.pid:<8} {state}, {ready}")
    return 0 if status.healthy else 1


def _kubeconfig(cluster: ControlPlane) -> int:
    if not cluster.kubeconfig.exists():
        print(f"cluster {cluster.name!r} has no kubeconfig (run `up` first)", file=sys.stderr)
        return 1
    print(cluster.kubeconfig)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devcluster",
        description="A local Kubernetes control plane (etcd, kube-apiserver, "
        "kube-controller-manager) on 127.0.0.1, or with --node a single-node cluster "
        "(plus kube-scheduler, containerd, kubelet), for development and tests.",
    )
    parser.add_argument(
        "command",
        choices=["up", "down", "status", "kubeconfig"],
        help="up: start (no-op if healthy); down: stop and delete state; "
        "status: exit 0 if healthy; kubeconfig: print the admin kubeconfig path",
    )
    parser.add_argument(
        "--name",
        default=None,
        help=f"cluster name (default: {DEFAULT_NAME}, with --node {DEFAULT_NODE_CLUSTER})",
    )
    parser.add_argument(
        "--node",
        action="store_true",
        help="up: a single-node cluster that runs pods (needs root; installs Debian "
        "packages and builds images on first use)",
    )
    parser.add_argument(
        "--images",
        default=None,
        metavar="NAMES",
        help="up --node: comma-separated images to build and import "
        f"(default: all of {', '.join(images.IMAGES)})",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(message)s",
    )
    # A cold build takes minutes: always say what is going on.
    logging.getLogger("devcluster.build").setLevel(logging.INFO)
    logging.getLogger("devcluster.images").setLevel(logging.INFO)
    name = args.name or (DEFAULT_NODE_CLUSTER if args.node else DEFAULT_NAME)
    cluster: ControlPlane
    if args.command == "up" and args.node:
        wanted = args.images.split(",") if args.images else None
        try:
            cluster = LocalCluster(name, images=wanted)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    else:
        # The kind the state says (a node cluster stays one), else a control plane.
        cluster = open_cluster(name)
    commands = {"up": _up, "down": _down, "status": _status, "kubeconfig": _kubeconfig}
    try:
        return commands[args.command](cluster)
    except (ControlPlaneError, images.ImageError, hostdeps.HostDepsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except RuntimeError as error:  # a failed build says what failed in its message
        print(f"error: {error}\n(cache: {build.cache_root()})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
