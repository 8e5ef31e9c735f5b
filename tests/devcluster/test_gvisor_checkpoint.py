"""gVisor pods saved whole and brought back on a new pod (sandbox-node/):
`sandbox-checkpoint` takes a running pod's image into the node's checkpoint
store, and a new pod naming it in `sandbox.dev/restore-from` starts from it,
through the node's real containerd, shim and sandbox-runsc.

The pod has the operator's shape: two containers talking over a Unix socket
in a pod-shared tmpfs (the runtime volume's gVisor annotations), a workspace
on the host that outlives the pod, a server listening. What must come back:
the processes themselves (a counter goes on from where it was, its memory
unchanged), the socket connection between the containers, a file in the
container's own root filesystem, the listening server, on the new pod's IP.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from devcluster import gvisor
from devcluster.cluster import LocalCluster
from tests.devcluster.support import Pods, http_get, restricted, wait_for
from tests.kube import KubeJSON, core_path

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# Counts, with a digest of 64 MiB of random bytes it keeps, one line per
# 0.2 s in the workspace: each line also carries the agent's answer over the
# socket and a file of the container's own root filesystem.
SANDBOX = r"""
import hashlib, os, socket, time
log = open('/workspace/log', 'a')
memory = bytearray(os.urandom(64 << 20))
digest = hashlib.sha256(memory).hexdigest()[:12]
open('/tmp/rootfs-file', 'w').write('kept')
while not os.path.exists('/run/shared/agent.sock'):
    time.sleep(0.05)
agent = socket.socket(socket.AF_UNIX)
agent.connect('/run/shared/agent.sock')
i = 0
while True:
    agent.sendall(b'%d' % i)
    answer = agent.recv(100).decode()
    log.write(f'{i} {digest} {answer} {open("/tmp/rootfs-file").read()}\n')
    log.flush()
    i += 1
    time.sleep(0.2)
"""
AGENT = r"""
import http.server, os, socket, threading, time
def answer():
    server = socket.socket(socket.AF_UNIX)
    if os.path.exists('/run/shared/agent.sock'):
        os.unlink('/run/shared/agent.sock')  # a restarted agent's
    server.bind('/run/shared/agent.sock')
    server.listen()
    while True:
        client, _ = server.accept()
        threading.Thread(
            target=lambda c=client: [c.sendall(b'ack' + d) for d in iter(lambda: c.recv(100), b'')],
            daemon=True,
        ).start()
threading.Thread(target=answer, daemon=True).start()
def stop_when_asked():
    while True:
        try:
            os.unlink('/workspace/stop-agent')
        except FileNotFoundError:
            time.sleep(0.1)
        else:
            os._exit(3)
threading.Thread(target=stop_when_asked, daemon=True).start()
os.chdir('/workspace')
http.server.test(HandlerClass=http.server.SimpleHTTPRequestHandler, port=8000, bind='0.0.0.0')
"""


def _pod(name: str, workspace: Path, restore_from: str | None = None) -> dict[str, Any]:
    mounts = [
        {"name": "workspace", "mountPath": "/workspace"},
        {"name": "shared", "mountPath": "/run/shared"},
    ]
    annotations = {
        f"dev.gvisor.spec.mount.shared.{field}": value
        for field, value in (("share", "pod"), ("type", "tmpfs"), ("options", "rw"))
    }
    if restore_from is not None:
        annotations["sandbox.dev/restore-from"] = restore_from

    def container(name: str, program: str, **extra: Any) -> dict[str, Any]:
        return {
            "name": name,
            "image": "sandbox-runtime-python:dev",
            "imagePullPolicy": "Never",
            "command": ["python3", "-c", program],
            "volumeMounts": mounts,
            "securityContext": restricted(1000, read_only=False),
            **extra,
        }

    return {
        "metadata": {"name": name, "annotations": annotations},
        "spec": {
            "runtimeClassName": gvisor.RUNTIME_CLASS,
            "restartPolicy": "Always",
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                container("sandbox", SANDBOX),
                container(
                    "agent",
                    AGENT,
                    readinessProbe={"tcpSocket": {"port": 8000}, "periodSeconds": 1},
                ),
            ],
            "volumes": [
                {"name": "workspace", "hostPath": {"path": str(workspace), "type": "Directory"}},
                {"name": "shared", "emptyDir": {}},
            ],
        },
    }


def _lines(workspace: Path) -> list[list[str]]:
    path = workspace / "log"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def _counted(workspace: Path, at_least: int) -> list[list[str]]:
    wait_for(lambda: len(_lines(workspace)) >= at_least, f"{at_least} lines in the log")
    return _lines(workspace)


def _checkpoint(cluster: LocalCluster, namespace: str, uid: str, key: str) -> dict[str, Any]:
    found = gvisor.binaries(build_missing=False)
    done = subprocess.run(
        [
            str(found[gvisor.CHECKPOINT]),
            f"--runsc={found['runsc']}",
            f"--root={cluster.runsc_state_dir}",
            f"--store={cluster.checkpoint_dir}",
            f"--namespace={namespace}",
            f"--pod-uid={uid}",
            f"--key={key}",
            "--runsc-flag=platform=systrap",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    path = tmp_path / "workspace"
    path.mkdir()
    path.chmod(0o777)
    return path


def test_a_checkpointed_pod_comes_back_with_its_processes_on_a_new_pod(
    local_cluster: LocalCluster, pods: Pods, kube: KubeJSON, namespace: str, workspace: Path
) -> None:
    before = pods.run(_pod("before", workspace))
    first = _counted(workspace, 3)
    digest = first[0][1]
    key = f"k-{uuid.uuid4().hex[:8]}"
    image = _checkpoint(local_cluster, namespace, before["metadata"]["uid"], key)
    assert Path(image["image"]) == local_cluster.checkpoint_dir / namespace / key
    assert image["bytes"] > 64 << 20, image  # the memory it holds, at least
    saved = len(_lines(workspace))
    # Its processes stopped with the image and stay stopped: the kubelet's
    # attempts to start the pod again are refused (the log does not grow).
    time.sleep(3)
    assert len(_lines(workspace)) == saved
    kube.delete(core_path("pods", namespace, "before"))
    wait_for(lambda: kube.get(core_path("pods", namespace, "before")) is None, "pod before gone")

    after = pods.run(_pod("after", workspace, restore_from=key))
    lines = _counted(workspace, saved + 3)
    # The same process went on: the next number, the same memory, the same
    # socket connection to the agent, the file in its root filesystem.
    assert [int(line[0]) for line in lines] == list(range(len(lines))), lines[saved - 2 :]
    assert {line[1] for line in lines} == {digest}
    assert lines[-1][2:] == [f"ack{lines[-1][0]}", "kept"], lines[-1]
    # The agent's server, restored listening, answers on the new pod's address.
    status, _ = http_get(after["status"]["podIP"], 8000, "/log")
    assert status == 200

    # A container of the restored pod that exits is started again, fresh, in
    # the running sandbox (not "restored" a second time).
    (workspace / "stop-agent").touch()
    path = core_path("pods", namespace, "after")

    def agent_back() -> bool:
        statuses = kube.read(path)["status"].get("containerStatuses") or []
        agent = next(c for c in statuses if c["name"] == "agent")
        return bool(agent["restartCount"] >= 1 and agent["ready"])

    wait_for(agent_back, "the agent container to be restarted and ready")
    status, _ = http_get(after["status"]["podIP"], 8000, "/log")
    assert status == 200


@pytest.mark.parametrize("case", ["missing", "another runsc build", "not a name"])
def test_a_pod_whose_image_cannot_be_restored_starts_fresh(
    local_cluster: LocalCluster, pods: Pods, namespace: str, workspace: Path, case: str
) -> None:
    key = {"missing": "nothing-here", "another runsc build": "stale", "not a name": "../stale"}[
        case
    ]
    if case == "another runsc build":
        image = local_cluster.checkpoint_dir / namespace / "stale"
        image.mkdir(parents=True)
        (image / "checkpoint.img").write_bytes(b"not an image")
        (image / "complete").write_text("sha256:" + "0" * 64 + "\n")
    pods.run(_pod("fresh", workspace, restore_from=key))
    lines = _counted(workspace, 2)
    assert lines[0][0] == "0", lines
