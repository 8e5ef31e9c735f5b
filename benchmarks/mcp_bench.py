"""sandbox-mcp against the SDK it is built on, on the real local node, side by
side in one run.

    python benchmarks/mcp_bench.py [--calls 300]

`sandbox_run_command` of `true` through MCP, over stdio (the server a local
client launches) and over streamable HTTP (the server as the chart runs it,
here on the host with the caller's bearer token), against `execute("true")`
through the SDK in the benchmark's own process, interleaved call by call. All
three reach the same sandbox (the same caller and session key) through the
gateway's pod address. Target: MCP adds at most 3 ms at p50.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import httpx2
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mcp import Client  # noqa: E402
from mcp.client.stdio import StdioServerParameters  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
from sandbox_mcp.sessions import SESSION_LABEL, identity_of, session_label  # noqa: E402

from benchmarks.common import (  # noqa: E402
    create_namespace,
    latency_row,
    operator_cluster,
    write_results,
)
from benchmarks.sdk_bench import _gateway_pod, _user_token  # noqa: E402
from sandbox_sdk import AsyncSandbox, AsyncSandboxClient  # noqa: E402
from tests.kube import KubeJSON  # noqa: E402

NS = "bench-mcp"
SESSION = "bench"
Call = Callable[[], Awaitable[Any]]
BIN = Path(sys.executable).parent


def _user_kubeconfig(admin: Path, token: str, work: Path) -> tuple[Path, str, Path]:
    """The user's kubeconfig (token), the API server and its CA as a file."""
    config = yaml.safe_load(admin.read_text())
    cluster = config["clusters"][0]["cluster"]
    ca = work / "ca.crt"
    if "certificate-authority-data" in cluster:
        ca.write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
    else:
        ca.write_bytes(Path(cluster["certificate-authority"]).read_bytes())
    user = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "c",
                "cluster": {"server": cluster["server"], "certificate-authority": str(ca)},
            }
        ],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "u", "context": {"cluster": "c", "user": "u", "namespace": NS}}],
        "current-context": "u",
    }
    path = work / "user.kubeconfig"
    path.write_text(yaml.safe_dump(user))
    return path, str(cluster["server"]), ca


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _interleaved(calls: dict[str, Call], count: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(10):  # warm: connections, caches, the sessions' sandbox handle
        for call in calls.values():
            await call()
    for _ in range(count):
        for label, call in calls.items():
            began = time.perf_counter()
            await call()
            times[label].append(time.perf_counter() - began)
    return times


class HttpServer:
    """sandbox-mcp --transport=http on the host, as the chart runs it in a pod."""

    def __init__(self, server: str, ca: Path, gateway: str, log: Path) -> None:
        self.url = f"http://127.0.0.1:{_free_port()}"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    str(BIN / "sandbox-mcp"),
                    "--transport=http",
                    f"--port={self.url.rsplit(':', 1)[1]}",
                    f"--api-server={server}",
                    f"--ca-file={ca}",
                    f"--gateway-url={gateway}",
                    f"--namespace={NS}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while not self._up():
            if time.monotonic() > deadline:
                raise SystemExit(f"sandbox-mcp http did not start: {log.read_text()}")
            time.sleep(0.1)

    def _up(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def _run(
    calls: int, kubeconfig: Path, gateway: str, token: str, http_url: str
) -> dict[str, Any]:
    stdio = Client(
        StdioServerParameters(
            command=str(BIN / "sandbox-mcp"),
            args=[
                f"--kubeconfig={kubeconfig}",
                f"--namespace={NS}",
                f"--session={SESSION}",
                "--on-end=destroy",
            ],
            env={"PATH": os.environ["PATH"], "SANDBOX_GATEWAY_URL": gateway},
        )
    )
    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {token}", "X-Sandbox-Session": SESSION}, timeout=120
    )
    remote = Client(streamable_http_client(f"{http_url}/mcp", http_client=http), mode="legacy")
    async with (
        stdio,
        remote,
        AsyncSandboxClient(NS, kubeconfig=kubeconfig, gateway_url=gateway) as sdk,
    ):
        started = time.perf_counter()
        first = await stdio.call_tool("sandbox_run_command", {"command": "true"})
        assert not first.is_error, first
        print(
            f"  the first call made the session's sandbox in {time.perf_counter() - started:.2f} s"
        )
        label = session_label(await identity_of(sdk), SESSION)
        [found] = await sdk.list(labels={SESSION_LABEL: label})
        assert found.metadata.name is not None
        box = AsyncSandbox(sdk, found.metadata.name, NS)

        async def via_sdk() -> None:
            assert (await box.execute("true")).ok

        def via(client: Client) -> Call:
            async def call() -> None:
                result = await client.call_tool("sandbox_run_command", {"command": "true"})
                assert not result.is_error, result

            return call

        print(f"sandbox_run_command `true`, {calls} calls each, interleaved")
        times = await _interleaved(
            {"SDK execute": via_sdk, "MCP stdio": via(stdio), "MCP HTTP": via(remote)}, calls
        )
    base = statistics.median(times["SDK execute"])
    results: dict[str, Any] = {}
    for name, values in times.items():
        print(latency_row(name, values))
        results[name] = {"p50_ms": statistics.median(values) * 1000}
    for name in ("MCP stdio", "MCP HTTP"):
        added = (statistics.median(times[name]) - base) * 1000
        results[name]["added_p50_ms"] = added
        print(f"  {name:<36} adds {added:+.2f} ms at p50 over the SDK (target <= 3 ms)")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    results: dict[str, Any] = {"load": os.getloadavg()}
    with (
        operator_cluster(f"bench-mcp-{os.getpid()}") as cluster,
        tempfile.TemporaryDirectory() as tmp,
    ):
        work = Path(tmp)
        kube = KubeJSON(cluster.kubeconfig)
        create_namespace(kube, NS)
        token = _user_token(kube, NS)
        gateway = _gateway_pod(kube)
        kubeconfig, server, ca = _user_kubeconfig(Path(cluster.kubeconfig), token, work)
        http = HttpServer(server, ca, gateway, work / "mcp.log")
        try:
            results.update(asyncio.run(_run(args.calls, kubeconfig, gateway, token, http.url)))
        finally:
            http.stop()
        kube.close()
    results["load_after"] = os.getloadavg()
    write_results("mcp_bench", results)


if __name__ == "__main__":
    main()
