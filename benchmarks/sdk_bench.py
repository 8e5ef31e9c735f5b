"""The SDK against raw HTTP, on the real local node, side by side in one run.

    python benchmarks/sdk_bench.py [--execs 300] [--mib-execs 40] [--creates 6]

1. `execute("true")` through the SDK against the same request sent with a bare
   httpx.Client (the same JSON body, idempotency key included, and its JSON
   parsed), interleaved call by call; both to the gateway, over two routes:
   its pod directly (what a client in the cluster gets) and the API server's
   service proxy (what a laptop gets).
2. The same with 1 MiB of output (`head -c 1048576`).
3. `create()` -> usable (the SDK's create, waiting for Ready, then a first
   `execute("true")`) against the operator's own create -> Ready (a Sandbox
   POSTed and watched), interleaved.

Target: the SDK adds at most 1 ms at p50 over raw HTTP.
"""

from __future__ import annotations

import argparse
import os
import ssl
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    create_namespace,
    latency_row,
    operator_cluster,
    sandbox_ready,
    wait_until,
    write_results,
)
from devcluster import deploy  # noqa: E402
from sandbox_sdk import Sandbox, SandboxClient  # noqa: E402
from tests.kube import KubeJSON, api_path, core_path  # noqa: E402

NS = "bench-sdk"
MIB = "head -c 1048576 /dev/zero | tr '\\0' x"
Call = Callable[[], Any]


def _user_token(kube: KubeJSON, ns: str = NS) -> str:
    """A ServiceAccount bound to the chart's user role, as a service would have."""
    rbac = "rbac.authorization.k8s.io/v1"
    kube.create(core_path("serviceaccounts", ns), {"metadata": {"name": "bench"}})
    kube.create(
        api_path(rbac, "rolebindings", ns),
        {
            "metadata": {"name": "bench"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": f"{deploy.RELEASE}-user",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "bench", "namespace": ns}],
        },
    )
    issued = kube.create(
        core_path("serviceaccounts", ns, "bench", "token"),
        {"spec": {"expirationSeconds": 7200}},
    )
    return str(issued["status"]["token"])


def _gateway_pod(kube: KubeJSON) -> str:
    pods = kube.list(
        core_path("pods", deploy.NAMESPACE), label_selector="app.kubernetes.io/name=sandbox-gateway"
    )
    ready = [p for p in pods if (p.get("status") or {}).get("podIP")]
    return f"http://{ready[0]['status']['podIP']}:8080"


def _raw_exec(http: httpx.Client, path: str, headers: dict[str, str], command: str) -> Call:
    def call() -> Any:
        body = {"command": command, "timeoutSeconds": 180, "idempotencyKey": uuid.uuid4().hex}
        response = http.post(path, json=body, headers=headers)
        assert response.status_code == 200, response.text
        return response.json()

    return call


def _interleaved(a: Call, b: Call, count: int) -> tuple[list[float], list[float]]:
    times_a: list[float] = []
    times_b: list[float] = []
    for _ in range(5):  # warm both: connections, caches in the gateway
        a()
        b()
    for _ in range(count):
        for call, times in ((a, times_a), (b, times_b)):
            began = time.perf_counter()
            call()
            times.append(time.perf_counter() - began)
    return times_a, times_b


def _row(label: str, sdk: list[float], raw: list[float]) -> dict[str, float]:
    added = (statistics.median(sdk) - statistics.median(raw)) * 1000
    print(latency_row(f"{label}, SDK", sdk))
    print(latency_row(f"{label}, raw HTTP", raw))
    print(f"  {'':<36} SDK adds {added:+.2f} ms at p50 (target <= 1 ms)")
    return {
        "sdk_p50_ms": statistics.median(sdk) * 1000,
        "raw_p50_ms": statistics.median(raw) * 1000,
        "added_p50_ms": added,
    }


def _admin_tls(cluster_kubeconfig: Path) -> tuple[str, ssl.SSLContext]:
    from sandbox_sdk.config import from_kubeconfig

    config = from_kubeconfig([cluster_kubeconfig])
    assert isinstance(config.ssl_context, ssl.SSLContext)
    return config.server, config.ssl_context


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--execs", type=int, default=300)
    parser.add_argument("--mib-execs", type=int, default=40)
    parser.add_argument("--creates", type=int, default=6)
    args = parser.parse_args()
    results: dict[str, Any] = {"load": os.getloadavg()}
    with operator_cluster(f"bench-sdk-{os.getpid()}") as cluster:
        kube = KubeJSON(cluster.kubeconfig)
        create_namespace(kube, NS)
        token = _user_token(kube)
        direct = _gateway_pod(kube)
        server, tls = _admin_tls(cluster.kubeconfig)
        proxy_base = (
            f"/api/v1/namespaces/{deploy.NAMESPACE}/services/http:{deploy.RELEASE}-gateway:80/proxy"
        )
        path = f"/v1/namespaces/{NS}/sandboxes/box/executions"
        os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
        with (
            SandboxClient(NS, gateway_url=direct, gateway_token=token) as sdk_direct,
            SandboxClient(NS, gateway="proxy", gateway_token=token) as sdk_proxy,
            httpx.Client(base_url=direct, timeout=60) as raw_direct,
            httpx.Client(base_url=server + proxy_base, verify=tls, timeout=60) as raw_proxy,
        ):
            box = sdk_direct.create("python", name="box")
            box_proxy: Sandbox = sdk_proxy.connect("box")
            routes = [
                ("direct", box, raw_direct, {"Authorization": f"Bearer {token}"}),
                ("API proxy", box_proxy, raw_proxy, {"X-Sandbox-Authorization": f"Bearer {token}"}),
            ]
            print(f"execute through the gateway, {args.execs} calls each, interleaved")
            for route, handle, raw, headers in routes:
                for label, command, count in (
                    ("true", "true", args.execs),
                    ("1 MiB", MIB, args.mib_execs),
                ):

                    def sdk_call(h: Sandbox = handle, c: str = command) -> Any:
                        result = h.execute(c)
                        assert result.ok
                        return result

                    raw_call = _raw_exec(raw, path, headers, command)
                    sdk_times, raw_times = _interleaved(sdk_call, raw_call, count)
                    results[f"{route} {label}"] = _row(f"{label} ({route})", sdk_times, raw_times)
            box.destroy()

            print(f"create -> usable, {args.creates} each, interleaved")
            sdk_creates: list[float] = []
            raw_creates: list[float] = []
            for i in range(args.creates):
                began = time.perf_counter()
                made = sdk_direct.create("python", name=f"sdk-{i}")
                made.execute("true")
                sdk_creates.append(time.perf_counter() - began)
                made.destroy(wait=False)
                began = time.perf_counter()
                name = f"raw-{i}"
                kube.create(
                    api_path("sandbox.dev/v1alpha1", "sandboxes", NS),
                    {
                        "apiVersion": "sandbox.dev/v1alpha1",
                        "kind": "Sandbox",
                        "metadata": {"name": name},
                        "spec": {"runtime": "python"},
                    },
                )
                wait_until(lambda: sandbox_ready(kube, NS, name))  # noqa: B023 -- called at once
                raw_creates.append(time.perf_counter() - began)
                kube.delete(api_path("sandbox.dev/v1alpha1", "sandboxes", NS, name))
                time.sleep(2)  # let the deletions finish before the next pair
            print(latency_row("SDK create() -> usable", sdk_creates))
            print(latency_row("operator create -> Ready", raw_creates))
            results["create"] = {
                "sdk_p50_s": statistics.median(sdk_creates),
                "operator_p50_s": statistics.median(raw_creates),
            }
        kube.close()
    results["load_after"] = os.getloadavg()
    write_results("sdk_bench", results)


if __name__ == "__main__":
    main()
