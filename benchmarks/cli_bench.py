"""`kubectl sandbox exec` against `kubectl exec`, on the real local node, side by side.

    python benchmarks/cli_bench.py [--execs 30]

One sandbox; `true` run in it by both commands, interleaved call by call, each a
new process as a person at a shell starts it: `kubectl sandbox exec box -- true`
(kubectl finds the plugin on PATH: Python's start-up, the SDK's imports, the
kubeconfig, the gateway's route, the command) against `kubectl exec box -c
sandbox -- true` (the API server's exec stream to the kubelet). Both read the
same kubeconfig, a ServiceAccount's bearer token: the cluster's own kubeconfig
holds a client certificate, which the gateway does not take, and the SDK would
then fetch a token per call (a third request that `kubectl exec` does not make).
Also the plugin's imports alone: `python -c 'import sandbox_sdk.cli'`, with
what `exec`'s one request needs (`sandbox_sdk._oneshot`), and with the client
the other commands (and `exec`'s hand-offs) need.

Target: `kubectl sandbox exec` within 1.5x of `kubectl exec` at p50.
"""

from __future__ import annotations

import argparse
import compileall
import os
import statistics
import subprocess
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
    ready_sandbox,
    token_kubeconfig,
    write_results,
)
from tests.kube import KubeJSON  # noqa: E402

NS = "bench-cli"
BOX = "box"
PLUGIN = Path(sys.executable).parent / "kubectl-sandbox"


def _timed(argv: list[str], env: dict[str, str]) -> float:
    began = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr}")
    return elapsed


def _imports(count: int, env: dict[str, str]) -> dict[str, float]:
    """p50 seconds of a bare interpreter, the CLI module's import, the imports
    of `exec`'s one request, and the client's."""
    statements = {
        "python -c pass": "pass",
        "import sandbox_sdk.cli": "import sandbox_sdk.cli",
        "... and exec's one request": "import sandbox_sdk.cli, sandbox_sdk._oneshot",
        "... and the client": "import sandbox_sdk.cli as c; c._client_class()",
    }
    found = {}
    for label, statement in statements.items():
        times = [_timed([sys.executable, "-c", statement], env) for _ in range(count)]
        print(latency_row(label, times))
        found[label] = statistics.median(times)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--execs", type=int, default=30)
    args = parser.parse_args()
    results: dict[str, Any] = {"load": os.getloadavg()}
    # Bytecode as an install has it (pip compiles on install; an editable install
    # writes it on first import, unless PYTHONDONTWRITEBYTECODE is set, as here):
    # otherwise every call compiles the plugin's modules again (~20 ms).
    compileall.compile_dir(str(REPO / "sandbox-sdk" / "src"), quiet=1)
    with operator_cluster(f"bench-cli-{os.getpid()}") as cluster:
        kube = KubeJSON(cluster.kubeconfig)
        create_namespace(kube, NS)
        kubeconfig = cluster.kubeconfig.parent / "bench-cli.kubeconfig"
        token_kubeconfig(kube, NS, "bench-cli", cluster.kubeconfig, kubeconfig)
        pod = ready_sandbox(kube, NS, BOX)
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            # kubectl finds `kubectl-sandbox` on PATH, as an installed plugin is found.
            "PATH": f"{PLUGIN.parent}{os.pathsep}{Path(cluster.kubectl).parent}"
            f"{os.pathsep}{os.environ.get('PATH', '')}",
        }
        kubectl = str(cluster.kubectl)
        plugin = [kubectl, "sandbox", "exec", "-n", NS, BOX, "--", "true"]
        plain = [kubectl, "exec", "-n", NS, pod, "-c", "sandbox", "--", "true"]
        for _ in range(3):  # warm both: the page cache, the gateway's and kubelet's connections
            _timed(plugin, env)
            _timed(plain, env)
        plugin_times: list[float] = []
        plain_times: list[float] = []
        for _ in range(args.execs):
            plugin_times.append(_timed(plugin, env))
            plain_times.append(_timed(plain, env))
        print(f"`true` in one sandbox, {args.execs} each, interleaved, each a new process:")
        print(latency_row("kubectl sandbox exec", plugin_times))
        print(latency_row("kubectl exec", plain_times))
        ratio = statistics.median(plugin_times) / statistics.median(plain_times)
        print(f"  ratio p50: {ratio:.2f}x (target <= 1.5x)")
        print("Start-up of the plugin alone:")
        results["imports_p50_s"] = _imports(max(5, args.execs // 3), env)
        results["exec"] = {
            "plugin_p50_s": statistics.median(plugin_times),
            "kubectl_p50_s": statistics.median(plain_times),
            "ratio_p50": ratio,
        }
        kube.close()
    results["load_after"] = os.getloadavg()
    write_results("cli_bench", results)


if __name__ == "__main__":
    main()
