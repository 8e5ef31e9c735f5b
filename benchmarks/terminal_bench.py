"""A keystroke's echo: a terminal through the gateway against `kubectl exec -it`, side by side.

    python benchmarks/terminal_bench.py [--keys 200]

One sandbox on the real local node, `cat` on a pseudo-terminal in it (the
terminal's line discipline echoes each key at once). Each measured key is
one byte sent, then the time until its echo is back:

- terminal: the SDK's terminal (`sandbox.terminals`), the route `kubectl
  sandbox shell` takes: a POST of the key through the API server's service
  proxy and the gateway, the echo from a long-poll read that was waiting;
- kubectl exec -it: `kubectl exec -i -t box -c sandbox -- cat` on a local
  pty (the API server's stream to the kubelet and the container runtime).

Keys alternate between the two, one at a time. Target (issue): the
terminal's p50 within 0.5x of kubectl exec's.
"""

from __future__ import annotations

import argparse
import os
import pty
import select
import statistics
import subprocess
import sys
import threading
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

NS = "bench-terminal"
BOX = "box"
KEYS = b"abcdefghijklmnopqrstuvwxyz"


class Echoes(threading.Thread):
    """Reads a terminal's output (the SDK's long-poll) and notes when each key came back."""

    def __init__(self, term: Any) -> None:
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


def _terminal_key(term: Any, echoes: Echoes, key: bytes) -> float:
    want = len(echoes.seen) + 1
    began = time.perf_counter()
    term.send(key)
    echoes.wait_for(want)
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
        with SandboxClient(NS) as client:
            term = client.connect(BOX).terminals.create(argv=["cat"])
            echoes = Echoes(term)
            echoes.start()
            for warm in KEYS[:5]:  # warm both: connections, the kubelet's stream
                _terminal_key(term, echoes, bytes([warm]))
                _exec_key(master, bytes([warm]))
            ours: list[float] = []
            theirs: list[float] = []
            for i in range(args.keys):
                key = bytes([KEYS[i % len(KEYS)]])
                ours.append(_terminal_key(term, echoes, key))
                theirs.append(_exec_key(master, key))
            echoes.stopping = True
            term.kill()
        kubectl.kill()
        kubectl.wait(10)
        os.close(master)
        os.close(slave)
        print(f"a key's echo from `cat` on a pty, {args.keys} keys each, alternating:")
        print(latency_row("terminal (SDK, gateway)", ours))
        print(latency_row("kubectl exec -it", theirs))
        ratio = statistics.median(ours) / statistics.median(theirs)
        print(f"  ratio p50: {ratio:.2f}x (target <= 0.5x)")
        results["echo"] = {
            "terminal_p50_s": statistics.median(ours),
            "terminal_p99_s": percentile(ours, 0.99),
            "kubectl_exec_p50_s": statistics.median(theirs),
            "kubectl_exec_p99_s": percentile(theirs, 0.99),
            "ratio_p50": ratio,
        }
        kube.close()
    results["load_after"] = os.getloadavg()
    write_results("terminal_bench", results)


if __name__ == "__main__":
    main()
