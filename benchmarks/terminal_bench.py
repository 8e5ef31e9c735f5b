"""A keystroke's echo: a terminal through the gateway against `kubectl exec -it`, side by side.

    python benchmarks/terminal_bench.py [--keys 200]

One sandbox on the real local node, `cat` on a pseudo-terminal in it (the
terminal's line discipline echoes each key at once), one terminal per
route. Each measured key is one byte sent, then the time until its echo is
back:

- WebSocket, API proxy: the SDK's `terminal.attach()` session, the route
  `kubectl sandbox shell` takes from a kubeconfig: the key one WebSocket
  message through the API server's service proxy and the gateway to the
  agent, its echo one message back;
- WebSocket, gateway pod: the same session to the gateway's pod directly
  (what a client in the cluster has: the gateway Service's DNS name);
- WebSocket, agent pod: the SDK's WebSocket straight to the agent with its
  own token (nobody but the operator and the gateway has one: not a route
  users have, it says what the gateway and the API server add);
- HTTP, API proxy: the SDK's plain HTTP operations (the session's fallback
  where no WebSocket passes, and the only way before `attach()`): a POST of
  the key, the echo from a long-poll read that was waiting;
- kubectl exec -it: `kubectl exec -i -t box -c sandbox -- cat` on a local
  pty (the API server's stream to the kubelet and the container runtime);
- WebSocket echo, API proxy (floor): a WebSocket through the API server's
  service proxy (the gateway's route) to a pod whose only work is to send
  each message back (a few lines of Python's standard library, no pty): what
  any route from a kubeconfig through the API server to a WebSocket in the
  cluster costs at least.

Keys go round the routes, one at a time. Target (issue): the terminal's p50
within 0.5x of kubectl exec's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pty
import select
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    agent_client,
    create_namespace,
    echo_pod,
    gateway_pod_url,
    operator_cluster,
    percentile,
    ready_sandbox,
    token_kubeconfig,
    write_results,
)
from sandbox_sdk import SandboxClient, Terminal, TerminalSession  # noqa: E402
from sandbox_sdk._sync.websocket import WebSocket, handshake  # noqa: E402
from tests.kube import KubeJSON, core_path  # noqa: E402

NS = "bench-terminal"
BOX = "box"
KEYS = b"abcdefghijklmnopqrstuvwxyz"
ECHO_PORT = 9000
# The floor's server: RFC 6455's handshake and unfragmented frames, each message
# sent back as it came; one thread per connection.
ECHO_SERVER = (
    f"PORT = {ECHO_PORT}\n"
    + """
import base64, hashlib, socket, threading
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
def serve(conn):
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stream = conn.makefile("rb")
    key = b""
    while (line := stream.readline()) not in (b"", b"\\r\\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"sec-websocket-key":
            key = value.strip()
    accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
    conn.sendall(b"HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\n"
                 b"Connection: Upgrade\\r\\nSec-WebSocket-Accept: " + accept + b"\\r\\n\\r\\n")
    while len(head := stream.read(2)) == 2:
        op, size = head[0] & 15, head[1] & 127
        if size >= 126:
            size = int.from_bytes(stream.read(2 if size == 126 else 8), "big")
        mask = stream.read(4) if head[1] & 128 else bytes(4)
        data = bytes(b ^ mask[i % 4] for i, b in enumerate(stream.read(size)))
        if op == 8:
            conn.sendall(b"\\x88\\x00")
            return
        if op in (1, 2) and size < 126:
            conn.sendall(bytes([128 | op, size]) + data)
listener = socket.create_server(("", PORT), reuse_port=True)
while True:
    threading.Thread(target=serve, args=(listener.accept()[0],), daemon=True).start()
"""
)


class Echoes(threading.Thread):
    """Reads a terminal's output (the SDK's long-poll) and notes when each key came back."""

    def __init__(self, term: Terminal) -> None:
        super().__init__(daemon=True)
        self.term = term
        self.seen = bytearray()
        self.changed = threading.Condition()
        self.stopping = False

    def run(self) -> None:
        try:
            while self.term.status == "running":
                data = self.term.read(wait=20.0)
                with self.changed:
                    self.seen += data
                    self.changed.notify_all()
        except Exception:
            if not self.stopping:  # the client closes under the read at the end
                raise

    def wait_for(self, count: int) -> None:
        with self.changed:
            self.changed.wait_for(lambda: len(self.seen) >= count, timeout=10)


def _http_key(term: Terminal, echoes: Echoes, key: bytes) -> float:
    want = len(echoes.seen) + 1
    began = time.perf_counter()
    term.send(key)
    echoes.wait_for(want)
    return time.perf_counter() - began


def _ws_key(session: TerminalSession, key: bytes) -> float:
    began = time.perf_counter()
    session.send(key)
    seen = b""
    while key not in seen:
        chunk = session.read(wait=10)
        if not chunk:
            raise SystemExit("WebSocket session: no echo in 10 s")
        seen += chunk
    return time.perf_counter() - began


def _raw_key(ws: WebSocket, key: bytes) -> float:
    began = time.perf_counter()
    ws.send(key)
    seen = b""
    while key not in seen:
        message = ws.receive(timeout=10)
        if not isinstance(message, bytes):
            raise SystemExit(f"agent WebSocket: {message!r} instead of the echo")
        seen += message
    return time.perf_counter() - began


def _exec_key(master: int, key: bytes) -> float:
    began = time.perf_counter()
    os.write(master, key)
    while True:
        ready, _, _ = select.select([master], [], [], 10)
        if not ready:
            raise SystemExit("kubectl exec: no echo in 10 s")
        if key in os.read(master, 4096):
            return time.perf_counter() - began


def _row(label: str, values: list[float]) -> str:
    p50, p90, p99 = (percentile(values, q) * 1000 for q in (0.5, 0.9, 0.99))
    return f"  {label:<28} p50 {p50:6.2f} ms   p90 {p90:6.2f} ms   p99 {p99:6.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keys", type=int, default=200)
    args = parser.parse_args()
    results: dict[str, Any] = {"load": os.getloadavg()}
    with operator_cluster(f"bench-terminal-{os.getpid()}") as cluster:
        kube = KubeJSON(cluster.kubeconfig)
        create_namespace(kube, NS)
        kubeconfig = cluster.kubeconfig.parent / "bench-terminal.kubeconfig"
        token_kubeconfig(kube, NS, "bench-terminal", cluster.kubeconfig, kubeconfig)
        pod = ready_sandbox(kube, NS, BOX)
        box_pod = kube.read(core_path("pods", NS, pod))
        image = next(c["image"] for c in box_pod["spec"]["containers"] if c["name"] == "sandbox")
        echo_name = echo_pod(kube, NS, "ws-echo", image, ECHO_SERVER, ECHO_PORT)["metadata"]["name"]
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        master, slave = pty.openpty()
        kubectl = subprocess.Popen(
            [str(cluster.kubectl), "exec", "-i", "-t", "-n", NS, pod, "-c", "sandbox", "--", "cat"],
            env=env,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
        )
        os.environ["KUBECONFIG"] = str(kubeconfig)
        with (
            SandboxClient(NS, gateway="proxy") as via_proxy,
            SandboxClient(NS, gateway_url=gateway_pod_url(kube)) as via_pod,
        ):
            proxied = via_proxy.connect(BOX).terminals.create(argv=["cat"])
            direct = via_pod.connect(BOX).terminals.create(argv=["cat"])
            polled = via_proxy.connect(BOX).terminals.create(argv=["cat"])
            raw = via_proxy.connect(BOX).terminals.create(argv=["cat"])
            echoes = Echoes(polled)
            echoes.start()
            agent = agent_client(kube, NS, BOX)
            ws_agent = handshake(agent, f"/v1/terminals/{raw.id}/attach", params={"cursor": "0"})
            assert isinstance(ws_agent, WebSocket), ws_agent
            assert "attached" in str(ws_agent.receive(timeout=10))
            assert via_proxy.kube is not None
            echo_path = f"/api/v1/namespaces/{NS}/services/http:{echo_name}:{ECHO_PORT}/proxy/"
            ws_echo = handshake(via_proxy.kube.http, echo_path)
            assert isinstance(ws_echo, WebSocket), ws_echo
            with (
                proxied.attach() as ws_proxy,
                direct.attach() as ws_pod,
                contextlib.closing(agent),
                contextlib.closing(ws_agent),
                contextlib.closing(ws_echo),
            ):
                assert (ws_proxy.transport, ws_pod.transport) == ("websocket", "websocket")
                routes: dict[str, Callable[[bytes], float]] = {
                    "WebSocket, API proxy": lambda key: _ws_key(ws_proxy, key),
                    "WebSocket, gateway pod": lambda key: _ws_key(ws_pod, key),
                    "WebSocket, agent pod": lambda key: _raw_key(ws_agent, key),
                    "HTTP, API proxy": lambda key: _http_key(polled, echoes, key),
                    "kubectl exec -it": lambda key: _exec_key(master, key),
                    "WebSocket echo, API proxy (floor)": lambda key: _raw_key(ws_echo, key),
                }
                times: dict[str, list[float]] = {name: [] for name in routes}
                for warm in KEYS[:5]:  # warm all: connections, the kubelet's stream
                    for measure in routes.values():
                        measure(bytes([warm]))
                for i in range(args.keys):
                    key = bytes([KEYS[i % len(KEYS)]])
                    for name, measure in routes.items():
                        times[name].append(measure(key))
            echoes.stopping = True
            for term in (proxied, direct, polled, raw):
                term.kill()
        kubectl.kill()
        kubectl.wait(10)
        os.close(master)
        os.close(slave)
        print(f"a key's echo from `cat` on a pty, {args.keys} keys each, round robin:")
        for name, values in times.items():
            print(_row(name, values))
        exec_p50 = statistics.median(times["kubectl exec -it"])
        for name in times:
            if name == "kubectl exec -it":
                continue
            ratio = statistics.median(times[name]) / exec_p50
            print(f"  ratio p50, {name}: {ratio:.2f}x (target <= 0.5x)")
        results["echo"] = {
            name: {
                "p50_s": statistics.median(values),
                "p90_s": percentile(values, 0.9),
                "p99_s": percentile(values, 0.99),
                "ratio_p50": statistics.median(values) / exec_p50,
            }
            for name, values in times.items()
        }
        kube.close()
    results["load_after"] = os.getloadavg()
    write_results("terminal_bench", results)


if __name__ == "__main__":
    main()
