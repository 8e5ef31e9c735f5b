"""Starting and stopping clusters: nothing may survive stop(), stale clusters
are cleaned up, and the CLI's `up` is repeatable.

These start clusters of their own (beside the session's), named `pytest-<pid>-*`
so that a later session sweeps them up should this one be killed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from devcluster import pki, processes
from devcluster.controlplane import Component, ControlPlane, ControlPlaneError
from devcluster.state import Ports
from tests.devcluster.support import devcluster_cli, processes_using

pytestmark = pytest.mark.integration


def assert_nothing_left(
    pids: dict[str, int], ticks: dict[str, int | None], ports: list[int]
) -> None:
    for name, pid in pids.items():
        # Same PID with the same start time is our process, unless only its
        # zombie is left (the test process is its parent and has not reaped it).
        alive = processes.process_start_ticks(pid) == ticks[name] and not processes.is_zombie(pid)
        assert not alive, f"{name} ({pid}) still runs"
        assert processes.group_members(pid) == [], f"{name}'s process group survived"
    assert not set(ports) & processes.listening_ports(), "something still listens on our ports"
    for port in ports:
        # A server could listen there again right away.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen()


def snapshot(cluster: ControlPlane) -> tuple[dict[str, int], dict[str, int | None], list[int]]:
    pids = cluster.pids()
    ticks = {name: processes.process_start_ticks(pid) for name, pid in pids.items()}
    return pids, ticks, cluster.ports.all()


@pytest.fixture
def own_cluster() -> Iterator[ControlPlane]:
    cluster = ControlPlane(f"pytest-{os.getpid()}-own", die_with_parent=True)
    yield cluster
    cluster.stop(remove_state=True)


def test_stop_kills_everything_and_frees_ports(
    control_plane: ControlPlane, own_cluster: ControlPlane
) -> None:
    # control_plane is requested only so the build has happened; this test
    # must not stop the shared cluster.
    own_cluster.start()
    assert own_cluster.is_healthy()
    pids, ticks, ports = snapshot(own_cluster)
    assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager"}
    assert own_cluster.server != control_plane.server, "clusters must not share ports"

    own_cluster.stop()

    assert_nothing_left(pids, ticks, ports)
    assert processes_using(own_cluster.state_dir) == []
    assert own_cluster.pids() == {}
    assert not own_cluster.is_healthy()
    # Logs stay for a look after stop(); they go only with remove_state.
    assert (own_cluster.logs_dir / "kube-apiserver.log").stat().st_size > 0
    assert control_plane.is_healthy(), "stopping one cluster must not touch another"


def test_start_cleans_up_a_stale_cluster(
    control_plane: ControlPlane, own_cluster: ControlPlane
) -> None:
    own_cluster.start()
    pids, ticks, _ = snapshot(own_cluster)
    # A crashed run: the API server dies, etcd and the controller manager linger.
    os.killpg(pids["kube-apiserver"], signal.SIGKILL)
    fresh = ControlPlane(own_cluster.name, die_with_parent=True)  # e.g. a new process
    assert not fresh.is_healthy()

    fresh.start()

    assert fresh.is_healthy()
    assert_nothing_left(pids, ticks, [])
    assert set(fresh.pids().values()).isdisjoint(pids.values())


def test_restart_brings_one_component_back_with_the_data(
    control_plane: ControlPlane, own_cluster: ControlPlane
) -> None:
    """restart() replaces one process (a new PID, same port); etcd keeps the data."""
    own_cluster.start()
    kubectl = [str(own_cluster.kubectl), "--kubeconfig", str(own_cluster.kubeconfig)]
    subprocess.run([*kubectl, "create", "configmap", "kept"], check=True, capture_output=True)
    before = own_cluster.pids()

    own_cluster.restart("kube-apiserver")

    after = own_cluster.pids()
    assert after["kube-apiserver"] != before["kube-apiserver"]
    # etcd kept running; everything runs (a controller manager that exited
    # for want of the API server was started again).
    assert after["etcd"] == before["etcd"]
    assert set(after) == set(before)
    assert own_cluster.is_healthy()
    got = subprocess.run([*kubectl, "get", "configmap", "kept"], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    with pytest.raises(ControlPlaneError, match="not a running component"):
        own_cluster.restart("no-such-component")


def test_cli_up_is_idempotent_and_down_removes_everything(control_plane: ControlPlane) -> None:
    name = f"pytest-{os.getpid()}-cli"
    cluster = ControlPlane(name)
    try:
        up = devcluster_cli("up", "--name", name)
        assert up.returncode == 0, up.stderr
        assert Path(up.stdout.strip()) == cluster.kubeconfig
        # The CLI has exited; its cluster keeps running.
        assert devcluster_cli("status", "--name", name).returncode == 0
        pids, ticks, ports = snapshot(cluster)

        again = devcluster_cli("up", "--name", name)
        assert again.returncode == 0, again.stderr
        assert "already running" in again.stderr
        assert cluster.pids() == pids, "a second `up` of a healthy cluster restarted it"

        os.killpg(pids["kube-controller-manager"], signal.SIGKILL)
        time.sleep(0.5)
        assert devcluster_cli("status", "--name", name).returncode == 1
        restarted = devcluster_cli("up", "--name", name)
        assert restarted.returncode == 0, restarted.stderr
        assert cluster.is_healthy()
        assert_nothing_left(pids, ticks, [])

        pids, ticks, ports = snapshot(cluster)
        down = devcluster_cli("down", "--name", name)
        assert down.returncode == 0, down.stderr
        assert_nothing_left(pids, ticks, ports)
        assert processes_using(cluster.state_dir) == []
        assert not cluster.state_dir.exists()
        assert devcluster_cli("down", "--name", name).returncode == 0, "down twice must work"
    finally:
        cluster.stop(remove_state=True)


class BrokenApiServer(ControlPlane):
    """The API server refuses to start (an unknown flag), after etcd is up."""

    def components(
        self, ports: Ports, certs: pki.PKI, binaries: Mapping[str, Path]
    ) -> list[Component]:
        components = super().components(ports, certs, binaries)
        for component in components:
            if component.name == "kube-apiserver":
                component.argv.append("--no-such-flag-for-this-test")
        return components


def test_failed_start_reports_the_log_and_leaves_nothing(control_plane: ControlPlane) -> None:
    cluster = BrokenApiServer(f"pytest-{os.getpid()}-broken", die_with_parent=True)
    try:
        with pytest.raises(ControlPlaneError) as failure:
            cluster.start()
        message = str(failure.value)
        assert "kube-apiserver exited" in message
        assert "no-such-flag-for-this-test" in message, "the log tail belongs in the error"
        # etcd had started; the failed start must have stopped it again.
        assert cluster.pids() == {}
        assert processes_using(cluster.state_dir) == []
    finally:
        cluster.stop(remove_state=True)
