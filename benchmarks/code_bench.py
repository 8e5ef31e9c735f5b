"""`x + 1` on a warm code context through the gateway, against a command and a local kernel.

    python benchmarks/code_bench.py [--runs 100]

One python sandbox on the real local node, its default context warmed up
(`x = 1`). Each round runs, one after another:

- run_code, API proxy: `sandbox.run_code("x + 1")` with the SDK from a
  kubeconfig, through the API server's service proxy, the gateway, the
  agent, the runner and the kernel's bridge to the IPython kernel in the
  pod, until `finished`;
- run_code, gateway pod: the same to the gateway's pod directly (what a
  client in the cluster has: the gateway Service's name);
- run_code, agent pod: the agent's `POST /v1/code/run` with its own token
  (not a route users have: it says what the gateway and the API server add);
- execute: `sandbox.execute(["python3", "-c", "print(1 + 1)"])` through the
  API proxy, what an agent without contexts does (a new interpreter each time);
- local kernel: the same cell sent with `jupyter_client` to an IPython kernel
  on this machine, waiting for its reply and its idle status (the floor: what
  a kernel costs without any of our layers);
- HTTP echo, pod / API proxy: a POST answered at once with two ndjson lines by
  a do-nothing server in a pod of the sandbox's image, straight to the pod and
  through the API server's service proxy (as the SDK reaches the gateway) with
  the same kubeconfig: the difference is
  what the API server's proxy adds to any request, which no gateway can take
  back (the API proxy route is reported with and without it).

Target (issue): run_code's p50 through the gateway within the floor's + 3 ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    agent_client,
    create_namespace,
    echo_pod,
    gateway_pod_url,
    latency_row,
    operator_cluster,
    percentile,
    ready_sandbox,
    token_kubeconfig,
    write_results,
)
from sandbox_sdk import SandboxClient  # noqa: E402
from sandbox_sdk.config import from_kubeconfig  # noqa: E402
from tests.kube import KubeJSON, core_path  # noqa: E402

NS = "bench-code"
BOX = "box"
ECHO_PORT = 8090
# Answers every POST with a streamed two-line ndjson body, keeping the connection.
HTTP_ECHO = (
    f"PORT = {ECHO_PORT}\n"
    + """
import socket, threading
BODY = b'{"type":"started"}\\n{"type":"finished","status":"ok"}\\n'
HEAD = b"HTTP/1.1 200 OK\\r\\ncontent-type: application/x-ndjson\\r\\n"
ANSWER = HEAD + b"transfer-encoding: chunked\\r\\n\\r\\n%x\\r\\n%s\\r\\n0\\r\\n\\r\\n" % (
    len(BODY), BODY)
def serve(conn):
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stream = conn.makefile("rb")
    while True:
        length = 0
        while (line := stream.readline()) not in (b"", b"\\r\\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if not line:
            return
        stream.read(length)
        conn.sendall(ANSWER)
listener = socket.create_server(("", PORT), reuse_port=True)
while True:
    threading.Thread(target=serve, args=(listener.accept()[0],), daemon=True).start()
"""
)


class LocalKernel:
    """An IPython kernel on this machine, driven as the bridge in the pod drives its own."""

    def __init__(self) -> None:
        from jupyter_client.manager import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel()
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, code: str) -> float:
        began = time.perf_counter()
        msg_id = self.kc.execute(code, store_history=True, allow_stdin=False)
        while True:
            msg = self.kc.get_iopub_msg(timeout=10)
            if (
                msg["parent_header"].get("msg_id") == msg_id
                and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
            ):
                break
        while self.kc.get_shell_msg(timeout=10)["parent_header"].get("msg_id") != msg_id:
            pass
        return time.perf_counter() - began

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def _timed(call: Callable[[], Any]) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def _agent_run(agent: httpx.Client, code: str) -> None:
    """One run straight to the agent, read to its `finished` event."""
    with agent.stream("POST", "/v1/code/run", json={"code": code}) as response:
        response.raise_for_status()
        last = b""
        for line in response.iter_lines():
            last = line.encode() if isinstance(line, str) else line
    assert b'"finished"' in last, last
    assert b'"ok"' in last, last


def _echo_run(client: httpx.Client, path: str) -> None:
    with client.stream("POST", path, json={"code": "x + 1"}) as response:
        response.raise_for_status()
        lines = list(response.iter_lines())
    assert any('"finished"' in line for line in lines), lines


def _proxy_client(kubeconfig: Path) -> httpx.Client:
    """An HTTP client for the API server as the SDK makes one from a kubeconfig."""
    cluster = from_kubeconfig([kubeconfig])
    token = cluster.credentials.token() if cluster.credentials else None
    return httpx.Client(
        base_url=cluster.server,
        verify=cluster.ssl_context,
        headers={"Authorization": f"Bearer {token}"} if token else {},
        timeout=30,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=100)
    args = parser.parse_args()
    results: dict[str, Any] = {"load": os.getloadavg()}
    local = LocalKernel()
    try:
        with operator_cluster(f"bench-code-{os.getpid()}") as cluster:
            kube = KubeJSON(cluster.kubeconfig)
            create_namespace(kube, NS)
            kubeconfig = cluster.kubeconfig.parent / "bench-code.kubeconfig"
            token_kubeconfig(kube, NS, "bench-code", cluster.kubeconfig, kubeconfig)
            pod = kube.read(core_path("pods", NS, ready_sandbox(kube, NS, BOX)))
            image = next(c["image"] for c in pod["spec"]["containers"] if c["name"] == "sandbox")
            echo = echo_pod(kube, NS, "http-echo", image, HTTP_ECHO, ECHO_PORT)
            echo_proxy_path = (
                f"/api/v1/namespaces/{NS}/services/http:http-echo:{ECHO_PORT}/proxy/run"
            )
            os.environ["KUBECONFIG"] = str(kubeconfig)
            with (
                SandboxClient(NS, gateway="proxy") as via_proxy,
                SandboxClient(NS, gateway_url=gateway_pod_url(kube)) as via_pod,
                agent_client(kube, NS, BOX) as agent,
                httpx.Client(
                    base_url=f"http://{echo['status']['podIP']}:{ECHO_PORT}"
                ) as echo_pod_client,
                _proxy_client(kubeconfig) as echo_proxy_client,
            ):
                proxied, direct = via_proxy.connect(BOX), via_pod.connect(BOX)
                began = time.perf_counter()
                assert proxied.run_code("x = 1").status == "ok"
                first = time.perf_counter() - began  # the kernel's start
                local.run("x = 1")
                routes: dict[str, Callable[[], Any]] = {
                    "run_code, API proxy": lambda: proxied.run_code("x + 1"),
                    "run_code, gateway pod": lambda: direct.run_code("x + 1"),
                    "run_code, agent pod": lambda: _agent_run(agent, "x + 1"),
                    "execute python3 -c": lambda: proxied.execute(
                        ["python3", "-c", "print(1 + 1)"]
                    ),
                    "local kernel (floor)": lambda: local.run("x + 1"),
                    "HTTP echo, pod": lambda: _echo_run(echo_pod_client, "/run"),
                    "HTTP echo, API proxy": lambda: _echo_run(echo_proxy_client, echo_proxy_path),
                }
                for _ in range(5):  # warm every route
                    for call in routes.values():
                        call()
                times: dict[str, list[float]] = {name: [] for name in routes}
                for _ in range(args.runs):  # interleaved: load hits every route alike
                    for name, call in routes.items():
                        times[name].append(_timed(call))
            kube.close()
    finally:
        local.close()
    print(f"`x + 1`, {args.runs} runs each, interleaved (first run_code, with the kernel's")
    print(f"start: {first * 1000:.0f} ms):")
    for name, values in times.items():
        print(latency_row(name, values))
    floor = statistics.median(times["local kernel (floor)"])
    over = {name: (statistics.median(times[name]) - floor) * 1000 for name in routes}
    for name in ("run_code, gateway pod", "run_code, API proxy", "run_code, agent pod"):
        print(f"  {name} over the floor, p50: {over[name]:.1f} ms")
    api_server = over["HTTP echo, API proxy"] - over["HTTP echo, pod"]
    print(f"  the API server's proxy, p50 (echo through it - echo straight): {api_server:.1f} ms")
    print(
        "  run_code, API proxy over the floor less the API server's proxy, p50:"
        f" {over['run_code, API proxy'] - api_server:.1f} ms"
    )
    print("  (target: the gateway's routes within the floor + 3 ms)")
    results["x_plus_1"] = {
        "first_run_s": first,
        "api_server_proxy_p50_ms": api_server,
        **{
            name: {
                "p50_s": statistics.median(values),
                "p99_s": percentile(values, 0.99),
                "over_floor_p50_ms": over[name],
            }
            for name, values in times.items()
        },
    }
    results["load_after"] = os.getloadavg()
    write_results("code_bench", results)


if __name__ == "__main__":
    main()
