"""Where the operator's memory goes with N Sandboxes: a tracemalloc census.

    PYTHONPATH=sandbox-agent/src:operator:sandbox-sdk/src:. \\
        .venv/bin/python hack/operator_memory.py [--count 2000] [--top 40]

Starts a private control plane (etcd, kube-apiserver, controller-manager, as
the integration tier does), applies the CRDs and runs the operator as in
production (`kopf run -m sandbox_operator.main`, the chart's RBAC) but under
tracemalloc; creates `--count` Sandboxes and waits until every one has its
pod and a written status (no kubelet: pods stay Pending), lets it settle,
then has the operator write its census: the live allocations grouped by the
line that made them, largest first, and the total. tracemalloc slows the
operator down several times and adds its own bookkeeping to RSS: compare the
shares, not the absolute figures, with `benchmarks/sandbox_scale.py`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CENSUS_ENV = "OPERATOR_MEMORY_CENSUS"


def child(argv: list[str]) -> None:
    """Run Kopf's command line under tracemalloc; SIGUSR1 writes the census."""
    import tracemalloc

    tracemalloc.start(1)
    out = Path(os.environ[CENSUS_ENV])
    top = int(os.environ.get("OPERATOR_MEMORY_TOP", "40"))

    def census(signum: int, frame: object) -> None:
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)]
        )
        stats = snapshot.statistics("lineno")
        total = sum(s.size for s in stats)
        lines = [f"total traced: {total / 2**20:.1f} MiB in {sum(s.count for s in stats)} blocks"]
        for stat in stats[:top]:
            frame_ = stat.traceback[0]
            where = f"{frame_.filename.replace(str(REPO) + '/', '')}:{frame_.lineno}"
            lines.append(f"{stat.size / 2**20:8.1f} MiB {stat.count:9d}  {where}")
        # By file too: the many small pieces of one of Kopf's per-object records
        # (a daemon, a logger, a cause) are spread over lines of the same module.
        lines.append("by file:")
        for stat in snapshot.statistics("filename")[:top]:
            name = stat.traceback[0].filename.replace(str(REPO) + "/", "")
            lines.append(f"{stat.size / 2**20:8.1f} MiB {stat.count:9d}  {name}")
        lines.append("held by (each object counted once, by the first holder listed):")
        lines.extend(f"{size / 2**20:8.1f} MiB  {name}" for name, size in holders())
        # Tasks alive, by what they run: a task per object (a daemon, a worker
        # that has not exited) keeps its frames and everything they hold.
        lines.append("tasks alive, by coroutine:")
        lines.extend(f"{count:8d}  {name}" for name, count in tasks_alive())
        tmp = out.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(out)

    signal.signal(signal.SIGUSR1, census)
    from kopf.cli import main as kopf_main

    sys.argv = ["kopf", *argv]
    kopf_main()


def holders() -> list[tuple[str, int]]:
    """Deep sizes of what the operator keeps per object: each of Kopf's indexes,
    Kopf's per-object memories, and each field of the operator's context."""
    import gc

    from kopf._core.engines.indexing import OperatorIndexers
    from kopf._core.reactor.inventory import ResourceMemories

    from sandbox_operator.context import OperatorContext

    indexes: list[tuple[str, object]] = []
    memories: list[tuple[str, object]] = []
    context: list[tuple[str, object]] = []
    # Kopf's indexers and memories exist before the operator's startup handler
    # freezes what exists (collector.py): get_objects() skips frozen objects.
    gc.unfreeze()
    for obj in gc.get_objects():
        if isinstance(obj, OperatorIndexers):
            indexes.extend((f"index {name}", index) for name, index in obj.indices.items())
        elif isinstance(obj, ResourceMemories):
            # Field by field across every object's memory: which of Kopf's
            # per-object records costs what (the daemons' live bodies first).
            fields: dict[str, list[object]] = {}
            for memory in obj.iter_all_memories():
                fields.setdefault("daemons' live bodies", []).append(
                    memory.daemons_memory.live_fresh_body
                )
                for name, value in vars(memory).items():
                    fields.setdefault(f"memories: {name}", []).append(value)
            memories.extend(fields.items())
        elif isinstance(obj, OperatorContext):
            context.extend((f"ctx.{name}", value) for name, value in vars(obj).items())
    seen: set[int] = set()
    # The operator's own state first: every per-object memo of Kopf's reaches
    # the context, which would otherwise all count as "memories: memo".
    return [(name, _deep_size(root, seen)) for name, root in [*context, *indexes, *memories]]


def tasks_alive() -> list[tuple[str, int]]:
    """The event loop's tasks by the qualified name of their coroutine, most first."""
    import asyncio
    from collections import Counter

    # The handler runs in the loop's thread between two steps of the loop.
    loop = asyncio.get_running_loop()
    names = Counter(
        getattr(task.get_coro(), "__qualname__", "?") for task in asyncio.all_tasks(loop)
    )
    return names.most_common(15)


def _deep_size(root: object, seen: set[int]) -> int:
    """Bytes of `root` and what it reaches through containers and the attributes
    of Kopf's and the operator's own objects (not modules, classes or code)."""
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type | type(sys) | type(len)):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
        elif type(obj).__module__.split(".")[0] in ("kopf", "sandbox_operator"):
            stack.extend(getattr(obj, "__dict__", {}).values())
            for slot in getattr(type(obj), "__slots__", ()):
                stack.extend([getattr(obj, slot)] if hasattr(obj, slot) else [])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--settle", type=float, default=20, help="seconds after the last status")
    args = parser.parse_args()

    from benchmarks.common import Watcher
    from benchmarks.sandbox_scale import NAMESPACE, create_all, prepare, rss_mib, written
    from devcluster.controlplane import ControlPlane
    from sandbox_operator.resources import SANDBOXES
    from tests.integration.harness import OperatorProcess
    from tests.kube import KubeJSON

    work = Path(tempfile.mkdtemp(prefix="operator-memory-"))
    census = work / "census.txt"
    cp = ControlPlane(f"memory-{os.getpid()}")
    cp.start()
    operator = None
    try:
        creds = prepare(cp, KubeJSON(cp.kubeconfig), work)
        env = {CENSUS_ENV: str(census), "OPERATOR_MEMORY_TOP": str(args.top)}
        operator = OperatorProcess(creds, work, env, kopf=[sys.executable, __file__, "--child"])
        operator.start()
        assert operator.proc is not None
        sandboxes = Watcher(cp.kubeconfig, SANDBOXES.path(NAMESPACE), written)
        import asyncio

        started = time.monotonic()
        asyncio.run(create_all(cp.kubeconfig, args.count, 20))
        if not sandboxes.until(lambda: sandboxes.counts["written"] == args.count, 1800):
            raise SystemExit(f"only {sandboxes.counts['written']} statuses written")
        print(f"{args.count} Sandboxes written in {time.monotonic() - started:.0f} s", flush=True)
        time.sleep(args.settle)
        sandboxes.close()
        print(f"operator RSS {rss_mib(operator.proc.pid, 'VmRSS'):.0f} MiB", flush=True)
        os.kill(operator.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 600
        while not census.exists():
            if time.monotonic() > deadline:
                raise SystemExit("no census from the operator")
            time.sleep(1)
        print(census.read_text())
    finally:
        if operator is not None:
            operator.stop()
        cp.stop(remove_state=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
    else:
        main()
