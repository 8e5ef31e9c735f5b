"""A pause that keeps memory against one that keeps the workspace, on the node.

    python benchmarks/memory_pause_bench.py [--count 3] [--sizes 100,500,1024]

For each size, gVisor Sandboxes with `pauseMode: Memory` and with the default
`Workspace`, interleaved, `--count` each: a process in the sandbox holds that
many MiB of touched memory; then

1. pause: `spec.paused: true` until the pod is gone (for Memory: the save by
   checkpointd included);
2. resume: `spec.paused: false` until the Sandbox is Ready (for Memory: the
   restore of the image included; the process is there again, checked; for
   Workspace it is gone, as that mode says);

and the image's size on the node (status.memory.bytes). The target of the
feature: a Memory resume of a 500 MiB sandbox within 2x a Workspace resume of
the same sandbox, measured side by side here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    agent_client,
    create_namespace,
    operator_cluster,
    sandbox_ready,
    wait_until,
    write_results,
)
from devcluster import gvisor  # noqa: E402
from tests.kube import JSON, KubeJSON, api_path, core_path  # noqa: E402

NS = "bench-memory"
HOLD = """\
import os, time
held = bytearray(os.urandom(1 << 20)) * {mib}
open("held", "w").write(str(os.getpid()))
while True:
    time.sleep(60)
"""


def _sandbox(kube: KubeJSON, name: str, mode: str, mib: int) -> None:
    kube.create(
        api_path("sandbox.dev/v1alpha1", "sandboxes", NS),
        {
            "apiVersion": "sandbox.dev/v1alpha1",
            "kind": "Sandbox",
            "metadata": {"name": name},
            "spec": {
                "runtime": "python",
                "runtimeClassName": gvisor.RUNTIME_CLASS,
                "resources": {"memory": f"{mib + 512}Mi", "profile": "dense"},
                "lifecycle": {"pauseMode": mode},
            },
        },
    )
    wait_until(lambda: sandbox_ready(kube, NS, name), 300)


def _hold(kube: KubeJSON, name: str, mib: int) -> str:
    """Start the holder; its pid once its memory is touched."""
    with agent_client(kube, NS, name) as agent:
        put = agent.put(
            "/v1/files/content", params={"path": "hold.py"}, content=HOLD.format(mib=mib)
        )
        assert put.status_code < 300, put.text
        started = agent.post(
            "/v1/executions", json={"command": "exec python3 hold.py", "background": True}
        )
        assert started.status_code == 202, started.text

        def held() -> str | None:
            got = agent.get("/v1/files/content", params={"path": "held"})
            return got.text if got.status_code == 200 and got.text else None

        wait_until(held, 300)
        return str(held())


def _alive(kube: KubeJSON, name: str, pid: str) -> bool:
    with agent_client(kube, NS, name) as agent:
        # Its whole command line, not just its PID: a fresh sandbox numbers its
        # processes the same way, and this very check may have that PID now.
        check = f"test \"$(tr '\\0' ' ' < /proc/{pid}/cmdline)\" = 'python3 hold.py '"
        ran = agent.post("/v1/executions", json={"command": check})
        return bool(ran.status_code == 200 and ran.json().get("exitCode") == 0)


def _patch(kube: KubeJSON, name: str, paused: bool) -> None:
    kube.patch(
        api_path("sandbox.dev/v1alpha1", "sandboxes", NS, name), {"spec": {"paused": paused}}
    )


def _status(kube: KubeJSON, name: str) -> JSON:
    body = kube.read(api_path("sandbox.dev/v1alpha1", "sandboxes", NS, name))
    return dict(body.get("status") or {})


@dataclass
class Runs:
    """One size and mode: each run's figures."""

    pause_s: list[float] = field(default_factory=list)
    resume_s: list[float] = field(default_factory=list)
    image_mib: list[float] = field(default_factory=list)
    process_kept: list[bool] = field(default_factory=list)
    # MemoryKept's reason and message after the resume (Memory only).
    memory_kept: list[str] = field(default_factory=list)


def one(kube: KubeJSON, name: str, mode: str, mib: int, into: Runs) -> None:
    _sandbox(kube, name, mode, mib)
    pid = _hold(kube, name, mib)
    began = time.monotonic()
    _patch(kube, name, True)
    wait_until(lambda: kube.get(core_path("pods", NS, name)) is None, 300)
    into.pause_s.append(round(time.monotonic() - began, 2))
    image = int((_status(kube, name).get("memory") or {}).get("bytes") or 0)
    into.image_mib.append(round(image / (1 << 20)))
    began = time.monotonic()
    _patch(kube, name, False)
    wait_until(lambda: sandbox_ready(kube, NS, name), 300)
    into.resume_s.append(round(time.monotonic() - began, 2))
    into.process_kept.append(_alive(kube, name, pid))
    if mode == "Memory":

        def verdict() -> str | None:
            for cond in _status(kube, name).get("conditions") or []:
                if cond["type"] == "MemoryKept" and cond["reason"] != "Checkpointed":
                    return f"{cond['reason']}: {cond.get('message', '')}"
            return None

        wait_until(verdict, 60)
        into.memory_kept.append(str(verdict()))
    kube.delete(api_path("sandbox.dev/v1alpha1", "sandboxes", NS, name))
    wait_until(lambda: kube.get(core_path("pods", NS, name)) is None, 120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=3)
    parser.add_argument("--sizes", default="100,500,1024")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    modes = ("Memory", "Workspace")
    runs = {(mib, mode): Runs() for mib in sizes for mode in modes}
    with operator_cluster("bench-memory") as cluster:
        kube = KubeJSON(cluster.kubeconfig)
        create_namespace(kube, NS)
        for mib in sizes:
            for i in range(args.count):
                for mode in modes:  # interleaved: the same machine state for both
                    one(kube, f"{mode.lower()}-{mib}-{i}", mode, mib, runs[(mib, mode)])
    median = statistics.median
    print(f"{'size':>6} {'mode':<10} {'pause p50':>10} {'resume p50':>11} {'image':>9}  kept")
    for (mib, mode), row in runs.items():
        print(
            f"{mib:>4}Mi {mode:<10} {median(row.pause_s):>9.2f}s {median(row.resume_s):>10.2f}s"
            f" {median(row.image_mib):>6.0f}MiB  {row.process_kept}"
        )
    for (mib, mode), row in runs.items():
        for said in row.memory_kept:
            if not said.startswith("MemoryRestored"):
                print(f"{mib} MiB {mode}: {said}")
    for mib in sizes:
        ratio = median(runs[(mib, "Memory")].resume_s) / median(runs[(mib, "Workspace")].resume_s)
        print(f"{mib} MiB: Memory resume / Workspace resume = {ratio:.2f}x")
    write_results(
        "memory_pause", {f"{mib}MiB {mode}": asdict(row) for (mib, mode), row in runs.items()}
    )


if __name__ == "__main__":
    main()
