"""What the devcluster tests share: waiting, the CLI, kubectl, processes, pods."""

from __future__ import annotations

import contextlib
import http.client
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devcluster import processes
from devcluster.cluster import LocalCluster
from devcluster.controlplane import ControlPlane
from tests.kube import KubeJSON, core_path

JSON = dict[str, Any]

REPO = Path(__file__).resolve().parents[2]
# Controllers and the kubelet react within seconds here; the bound only keeps
# something broken from hanging the suite.
WAIT = 120.0


def wait_for(condition: Callable[[], bool], what: str, timeout: float = WAIT) -> float:
    """Poll until `condition()` is true; return the seconds it took."""
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - began


def devcluster_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m devcluster ARGS` as a user runs it: its own process, from the repo."""
    return subprocess.run(
        [sys.executable, "-m", "devcluster", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def kubectl(
    cluster: ControlPlane, *args: str, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """The cluster's own kubectl as admin; `check` raises on a non-zero exit."""
    return subprocess.run(
        cluster.kubectl_command(*args), capture_output=True, text=True, timeout=60, check=check
    )


def processes_using(state_dir: Path) -> list[int]:
    """PIDs of live processes with the state dir on their command line."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or processes.is_zombie(int(entry.name)):
            continue
        with contextlib.suppress(OSError):
            if str(state_dir).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


@dataclass(frozen=True)
class Pods:
    """Pods in one namespace of a node cluster: run them, read their logs."""

    cluster: LocalCluster
    kube: KubeJSON
    namespace: str

    def run(self, body: JSON) -> JSON:
        """Create the pod and return it once it finished (Succeeded/Failed) or,
        with restartPolicy Always, once all its containers are ready."""
        name = body["metadata"]["name"]
        serves = body["spec"].get("restartPolicy") == "Always"
        self.kube.create(core_path("pods", self.namespace), body)
        path = core_path("pods", self.namespace, name)
        latest: JSON = {}

        def settled() -> bool:
            nonlocal latest
            latest = self.kube.read(path)
            status = latest.get("status", {})
            if status.get("phase") in ("Succeeded", "Failed"):
                return True
            ready = [c.get("ready") for c in status.get("containerStatuses", [])]
            return serves and bool(ready) and all(ready)

        wait_for(settled, f"pod {self.namespace}/{name} to run or finish")
        return latest

    def logs(self, name: str) -> str:
        """The container log: kubectl -> API server -> the kubelet's TLS port."""
        proc = kubectl(self.cluster, "logs", "-n", self.namespace, name)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout


def restricted(uid: int, *, read_only: bool = True) -> JSON:
    """Pod Security Standards `restricted`, as the operator's pods run."""
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": read_only,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod(name: str, image: str, command: list[str] | None, **spec: Any) -> JSON:
    """A pod of one container `main`; `command=None` runs the image's entrypoint."""
    container: JSON = {
        "name": "main",
        "image": image,
        "imagePullPolicy": "Never",
        **({"command": command} if command is not None else {}),
        **spec.pop("container", {}),
    }
    return {
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
            **spec,
        },
    }


def http_get(host: str, port: int, path: str) -> tuple[int, str]:
    connection = http.client.HTTPConnection(host, port, timeout=5.0)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()
