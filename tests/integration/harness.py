"""Real processes for the integration tier: the operator (through Kopf) and
sandbox agents with their runners, plus the kubelet's part played by the test.

This tier has no kubelet: the tests patch pod status as a kubelet would, and
run a real agent + runner bound to a loopback address used as the pod IP.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from devcluster.controlplane import ControlPlane, free_ports
from tests.kube import STRATEGIC_MERGE_PATCH, ApiError, KubeJSON, api_path, core_path

VENV_BIN = Path(sys.executable).parent
T = TypeVar("T")

# Each test process starts in its own 127.0.X.0/24 (X from the PID), so that two
# sessions on one machine do not hand their agents the same address.
_loopback_hosts = itertools.count((os.getpid() % 200) * 250)


def free_port() -> int:
    """A port for a child process to listen on: below the ephemeral range and
    never handed out twice (a port the kernel picks as free may be another
    connection's, or this function's last answer, by the time the child binds)."""
    return free_ports(1)[0]


def next_pod_ip() -> str:
    """A fresh 127.0.x.y address (all of 127/8 reaches loopback on Linux)."""
    n = next(_loopback_hosts)
    return f"127.0.{n // 250}.{n % 250 + 2}"


def wait_for(probe: Callable[[], T | None], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll until `probe` returns something truthy; fail with `what` otherwise."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_for_start(probe: Callable[[], bool], what: str, log: Path) -> None:
    """Wait for a child process to come up; if it does not, fail with its log's
    tail (the log is under pytest's temporary directory, gone after CI)."""
    try:
        wait_for(probe, 60, f"{what} (log: {log})")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{log_tail(log)}") from None


class TcpRelay:
    """A TCP relay on 127.0.0.1 to `port`, whose connections the test can cut
    (both ways at once, no closing handshake: a network that dropped them).
    It goes on accepting new connections after a cut."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return  # closed
            up = socket.create_connection(("127.0.0.1", self.upstream))
            with self.lock:
                self.sockets += [down, up]
            for source, sink in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        """Drop every connection open now."""
        with self.lock:
            cut, self.sockets = self.sockets, []
        for sock in cut:
            with contextlib.suppress(OSError):
                # Linger 0: the close resets, as a dropped network path ends. The
                # shutdown first wakes the pump blocked in recv (a close alone
                # would wait for it).
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self.listener.close()
        self.cut()


class OperatorProcess:
    """`kopf run -m sandbox_operator.main` as a child process, killable at will."""

    def __init__(
        self,
        kubeconfig: Path,
        log_dir: Path,
        env: dict[str, str],
        peering: str | None = None,
        name: str = "operator",
        kopf: Sequence[str] = (),
    ) -> None:
        self.kubeconfig = kubeconfig
        # How Kopf's command line is run (a tool may wrap it); default: the venv's `kopf`.
        self.kopf = list(kopf) or [str(VENV_BIN / "kopf")]
        self.log_dir = log_dir
        self.env = env
        # A replica among peers in this ClusterKopfPeering; None: --standalone.
        self.peering = peering
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.health_port = 0
        self.metrics_port = 0

    @property
    def log(self) -> Path:
        return self.log_dir / f"{self.name}-{self.starts}.log"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        self.health_port, self.metrics_port = free_port(), free_port()
        env = {
            **os.environ,
            **self.env,
            "KUBECONFIG": str(self.kubeconfig),
            "SANDBOX_OPERATOR_METRICS_PORT": str(self.metrics_port),
            # The replica's name in the peering object, as the chart sets it.
            "POD_ID": self.name,
        }
        argv = [
            *self.kopf,
            "run",
            "-m",
            "sandbox_operator.main",
            "--all-namespaces",
            f"--peering={self.peering}" if self.peering else "--standalone",
            f"--liveness=http://127.0.0.1:{self.health_port}/healthz",
        ]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_for_start(self._healthy, "operator liveness", self.log)

    def _healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"operator exited:\n{log_tail(self.log)}")
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.health_port}/healthz", timeout=1
            ) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: no cleanup, no finalizer handling, like a node failure."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text: str = response.read().decode()
            return text

    def log_lines(self) -> list[str]:
        """The current log (since the last start), line by line."""
        return log_tail(self.log, 100000).splitlines()

    def errors(self) -> list[str]:
        """Tracebacks in the current log: a handler crashed somewhere."""
        return [line for line in self.log_lines() if "Traceback" in line]


class GatewayProcess:
    """`sandbox-gateway` as a child process on 127.0.0.1, with its own HMAC key."""

    def __init__(self, kubeconfig: Path, work: Path, env: dict[str, str] | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.work = work
        self.env = env or {}
        self.keys = work / "keys"
        self.keys.mkdir(parents=True, exist_ok=True)
        (self.keys / "20260101000000").write_bytes(base64.b64encode(os.urandom(48)))
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.metrics_port = 0
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.work / f"gateway-{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        self.port, self.metrics_port = free_port(), free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "SANDBOX_GATEWAY_HOST": "127.0.0.1",
            "SANDBOX_GATEWAY_PORT": str(self.port),
            "SANDBOX_GATEWAY_METRICS_PORT": str(self.metrics_port),
            "SANDBOX_GATEWAY_KEYS_DIR": str(self.keys),
            # Stops are immediate unless a test is about the drain.
            "SANDBOX_GATEWAY_DRAIN_SECONDS": "0",
            **self.env,
        }
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [str(VENV_BIN / "sandbox-gateway")], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        wait_for_start(self._ready, "gateway readiness", self.log)

    def _ready(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"gateway exited:\n{log_tail(self.log)}")
        try:
            with urllib.request.urlopen(f"{self.url}/readyz", timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
            text: str = r.read().decode()
            return text

    def terminate(self) -> None:
        """SIGTERM, as the kubelet stops a pod; the drain starts."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def errors(self) -> list[str]:
        return [line for line in log_tail(self.log, 100000).splitlines() if "Traceback" in line]


class AgentProcess:
    """A real agent and a real runner, wired as in a pod, on one loopback IP."""

    def __init__(self, root: Path, ip: str, port: int, token: str) -> None:
        self.root = root
        self.ip = ip
        self.port = port
        self.workspace = root / "workspace"
        self.runtime_dir = root / "run"
        self.token_file = root / "token"
        for directory in (self.workspace, self.runtime_dir, root / "logs"):
            directory.mkdir(parents=True, exist_ok=True)
        self.token_file.write_text(token)
        self.agent: subprocess.Popen[bytes] | None = None
        self.runner: subprocess.Popen[bytes] | None = None

    def _start_agent(self) -> None:
        env = {
            **os.environ,
            "SANDBOX_AGENT_HOST": self.ip,
            "SANDBOX_AGENT_PORT": str(self.port),
            "SANDBOX_AGENT_TOKEN_FILE": str(self.token_file),
            "SANDBOX_AGENT_WORKSPACE": str(self.workspace),
            "SANDBOX_AGENT_RUNTIME_DIR": str(self.runtime_dir),
            "SANDBOX_AGENT_LOG_DIR": str(self.root / "logs"),
        }
        with (self.root / "agent.log").open("ab") as log:
            self.agent = subprocess.Popen(
                [str(VENV_BIN / "sandbox-agent")], env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def crash_agent(self) -> None:
        """SIGKILL the agent and start it again, the runner kept (a sidecar restart)."""
        assert self.agent is not None
        self.agent.kill()
        self.agent.wait(10)
        self._start_agent()
        wait_for(self.ready, 30, f"agent readiness at {self.ip}:{self.port} after a crash")

    def start(self) -> None:
        self._start_agent()
        runner = self.runtime_dir / "runner.py"
        wait_for(runner.exists, 30, "the agent to place runner.py")
        runner_env = {
            "PATH": os.environ["PATH"],
            "SANDBOX_RUNNER_SOCKET": str(self.runtime_dir / "runner.sock"),
            "HOME": str(self.workspace),
        }
        with (self.root / "runner.log").open("wb") as log:
            # The venv's python3 plays the image's: it has the Jupyter kernel
            # that the catalog's python runtime carries (code contexts).
            self.runner = subprocess.Popen(
                [str(VENV_BIN / "python3"), str(runner)],
                env=runner_env,
                cwd=self.workspace,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_for(self.ready, 30, f"agent readiness at {self.ip}:{self.port}")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.ip}:{self.port}/readyz", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def call(self, method: str, path: str, body: bytes | None = None) -> Any:
        import json

        request = urllib.request.Request(
            f"http://{self.ip}:{self.port}{path}",
            data=body,
            method=method,
            headers={
                "Authorization": f"Bearer {self.token_file.read_text()}",
                "Content-Type": "application/json",
            },
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"null")

    def stop(self) -> None:
        for proc in (self.runner, self.agent):
            if proc and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


class Node:
    """The kubelet's part: write pod status as a kubelet would."""

    def __init__(self, kube: KubeJSON) -> None:
        self.kube = kube

    def _patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        # Strategic merge, as a kubelet sends it: conditions and container
        # statuses merge by their key (type, name) rather than being replaced.
        self.kube.patch(
            core_path("pods", namespace, name, "status"),
            {"status": status},
            content_type=STRATEGIC_MERGE_PATCH,
        )

    def run_pod(self, namespace: str, name: str, ip: str, *, agent_ready: bool = True) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        ready = "True" if agent_ready else "False"
        status = {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "hostIP": "127.0.0.1",
            "startTime": now,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                {"type": "ContainersReady", "status": ready, "lastTransitionTime": now},
                {"type": "Ready", "status": ready, "lastTransitionTime": now},
            ],
            "containerStatuses": [
                _container(
                    "sandbox", "sandbox-runtime-python:dev", True, {"running": {"startedAt": now}}
                ),
                _container(
                    "agent", "sandbox-agent:dev", agent_ready, {"running": {"startedAt": now}}
                ),
            ],
        }
        self._patch_status(namespace, name, status)

    def unschedulable(self, namespace: str, name: str, message: str) -> None:
        """What the scheduler writes when it cannot place the pod (a minute ago)."""
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 60))
        condition = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": message,
            "lastTransitionTime": since,
        }
        self._patch_status(namespace, name, {"phase": "Pending", "conditions": [condition]})

    def bind_claim(self, namespace: str, claim: str, capacity: str = "10Gi") -> None:
        """Storage's part: a volume reserved for `claim`, which the control plane's
        volume binder then binds (this tier has no provisioner)."""
        self.kube.create(
            core_path("persistentvolumes"),
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": f"pv-{namespace}-{claim}"},
                "spec": {
                    "capacity": {"storage": capacity},
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": "",
                    "hostPath": {"path": f"/nonexistent/{namespace}/{claim}"},
                    "claimRef": {"namespace": namespace, "name": claim},
                },
            },
        )

    def fail_pod(self, namespace: str, name: str, reason: str = "Evicted") -> None:
        self._patch_status(
            namespace,
            name,
            {"phase": "Failed", "reason": reason, "message": f"the node says: {reason}"},
        )

    def crash_runtime(self, namespace: str, name: str, message: str) -> None:
        state = {"waiting": {"reason": "RunContainerError", "message": message}}
        self._patch_status(
            namespace,
            name,
            {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "conditions": [{"type": "PodScheduled", "status": "True"}],
                "containerStatuses": [
                    _container("sandbox", "img:1", False, state, restarts=2),
                    # Running, waiting for a runner that never comes.
                    _container("agent", "sandbox-agent:dev", False, {"running": {}}),
                ],
            },
        )


def _container(
    name: str, image: str, ready: bool, state: dict[str, Any], restarts: int = 0
) -> dict[str, Any]:
    return {
        "name": name,
        "image": image,
        "imageID": f"sha256:{name}",
        "ready": ready,
        "started": True,
        "restartCount": restarts,
        "state": state,
    }


OPERATOR_NAMESPACE = "sandbox-system"


RULES = Path("charts/sandbox-operator/files")
OPERATOR_RULES = ("rbac-rules.yaml", "rbac-secret-rules.yaml")
GATEWAY_RULES = ("gateway-rbac-rules.yaml", "gateway-secret-rules.yaml")


def chart_rules(repo: Path, files: Sequence[str]) -> list[dict[str, Any]]:
    """The RBAC rules of the chart's `files`, as one list."""
    return [rule for name in files for rule in yaml.safe_load((repo / RULES / name).read_text())]


def operator_credentials(cp: ControlPlane, kube: KubeJSON, repo: Path, path: Path) -> Path:
    """A kubeconfig for a ServiceAccount bound to the chart's operator rules, all of
    them cluster-wide (the chart's binding when it watches every namespace).

    `kube` speaks for an admin of `cp`; from a script that has only the
    ControlPlane: `with KubeJSON(cp.kubeconfig) as kube: operator_credentials(...)`.
    """
    rules = chart_rules(repo, OPERATOR_RULES)
    return service_account_kubeconfig(cp, kube, "sandbox-operator", rules, path)


def gateway_credentials(cp: ControlPlane, kube: KubeJSON, repo: Path, path: Path) -> Path:
    """The same for the gateway, under the chart's gateway rules."""
    rules = chart_rules(repo, GATEWAY_RULES)
    return service_account_kubeconfig(cp, kube, "sandbox-gateway", rules, path)


def service_account_kubeconfig(
    cp: ControlPlane, kube: KubeJSON, name: str, rules: list[dict[str, Any]], path: Path
) -> Path:
    """A ServiceAccount `name` in OPERATOR_NAMESPACE bound to `rules` (a
    ClusterRole of the same name), and a kubeconfig with its token."""
    rbac = "rbac.authorization.k8s.io/v1"
    with contextlib.suppress(ApiError):  # the namespace is shared by both
        kube.create(
            core_path("namespaces"),
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}},
        )
    kube.create(
        core_path("serviceaccounts", OPERATOR_NAMESPACE),
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
    )
    kube.create(
        api_path(rbac, "clusterroles"),
        {"apiVersion": rbac, "kind": "ClusterRole", "metadata": {"name": name}, "rules": rules},
    )
    kube.create(
        api_path(rbac, "clusterrolebindings"),
        {
            "apiVersion": rbac,
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": name,
            },
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": OPERATOR_NAMESPACE}],
        },
    )
    token = service_account_token(kube, OPERATOR_NAMESPACE, name)
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "local",
                "cluster": {"server": cp.server, "certificate-authority": str(cp.ca_cert)},
            }
        ],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [{"name": name, "context": {"cluster": "local", "user": name}}],
        "current-context": name,
    }
    path.write_text(yaml.safe_dump(kubeconfig))
    return path


def service_account_token(
    kube: KubeJSON,
    namespace: str,
    name: str,
    seconds: int = 86400,
    audiences: list[str] | None = None,
) -> str:
    """A token of a ServiceAccount (TokenRequest), as a pod would get it; for
    the API server unless `audiences` names others."""
    issued = kube.create(
        core_path("serviceaccounts", namespace, name, "token"),
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": seconds,
                **({"audiences": audiences} if audiences else {}),
            },
        },
    )
    token = issued["status"]["token"]
    assert isinstance(token, str), f"no token in the TokenRequest: {issued}"
    return token


def secret_token(kube: KubeJSON, namespace: str, sandbox: str) -> str:
    """The agent token of a sandbox; ApiError (404) while its Secret does not exist."""
    secret = kube.read(core_path("secrets", namespace, f"{sandbox}-agent-token"))
    return base64.b64decode(secret["data"]["token"]).decode()
