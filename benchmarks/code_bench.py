"""`x + 1` on a warm code context through the gateway, against a command and a local kernel.

    python benchmarks/code_bench.py [--runs 100]

One python sandbox on the real local node, its default context warmed up
(`x = 1`). Each round runs, one after another:

- run_code: `sandbox.run_code("x + 1")` with the SDK, through the API
  server's service proxy, the gateway, the agent, the runner and the
  kernel's bridge to the IPython kernel in the pod, until `finished`;
- execute: `sandbox.execute(["python3", "-c", "print(1 + 1)"])`, the same
  route, what an agent without contexts does (a new interpreter each time);
- local kernel: the same cell sent with `jupyter_client` to an IPython kernel
  on this machine, waiting for its reply and its idle status (the floor: what
  a kernel costs without any of our layers).

Target (issue): run_code's p50 within the floor's + 3 ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    create_namespace,
    latency_row,
    operator_cluster,
    percentile,
    ready_sandbox,
    token_kubeconfig,
    write_results,
)
from sandbox_sdk import SandboxClient  # noqa: E402
from tests.kube import KubeJSON  # noqa: E402

NS = "bench-code"
BOX = "box"


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


def _timed(call: Any) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


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
            ready_sandbox(kube, NS, BOX)
            os.environ["KUBECONFIG"] = str(kubeconfig)
            with SandboxClient(NS) as client:
                sandbox = client.connect(BOX)
                began = time.perf_counter()
                assert sandbox.run_code("x = 1").status == "ok"
                first = time.perf_counter() - began  # the kernel's start
                local.run("x = 1")
                for _ in range(5):  # warm every route
                    sandbox.run_code("x + 1")
                    sandbox.execute(["python3", "-c", "print(1 + 1)"])
                    local.run("x + 1")
                code: list[float] = []
                command: list[float] = []
                floor: list[float] = []
                for _ in range(args.runs):
                    code.append(_timed(lambda: sandbox.run_code("x + 1")))
                    command.append(
                        _timed(lambda: sandbox.execute(["python3", "-c", "print(1 + 1)"]))
                    )
                    floor.append(local.run("x + 1"))
            kube.close()
    finally:
        local.close()
    print(f"`x + 1`, {args.runs} runs each, interleaved (first run_code, with the kernel's")
    print(f"start: {first * 1000:.0f} ms):")
    print(latency_row("run_code (SDK, gateway)", code))
    print(latency_row("execute python3 -c", command))
    print(latency_row("local kernel (floor)", floor))
    over = (statistics.median(code) - statistics.median(floor)) * 1000
    print(f"  run_code over the floor, p50: {over:.1f} ms (target <= 3 ms)")
    print(f"  run_code / execute, p50: {statistics.median(code) / statistics.median(command):.2f}x")
    results["x_plus_1"] = {
        "first_run_s": first,
        "run_code_p50_s": statistics.median(code),
        "run_code_p99_s": percentile(code, 0.99),
        "execute_p50_s": statistics.median(command),
        "execute_p99_s": percentile(command, 0.99),
        "local_kernel_p50_s": statistics.median(floor),
        "local_kernel_p99_s": percentile(floor, 0.99),
        "over_floor_p50_ms": over,
    }
    results["load_after"] = os.getloadavg()
    write_results("code_bench", results)


if __name__ == "__main__":
    main()
