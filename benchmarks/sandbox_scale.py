"""Create N Sandboxes against a real local control plane; measure the operator.

    python benchmarks/sandbox_scale.py [--sizes 1000,3000,10000]

For each size, on a control plane of its own with the operator running as in
production (`kopf run -m sandbox_operator`, default settings) under the
chart's RBAC rules, it reports:

- the time from the first create until every Sandbox has its pod and a
  written status, and the operator's peak RSS and CPU over it;
- the API requests the operator made per Sandbox (from the API server's audit
  log, by the operator's ServiceAccount identity);
- the reconcile latency of a single change among N settled Sandboxes: a spec
  edit until the status reports its generation (p50 and max of a few);
- what N idle Sandboxes cost: the operator's API writes and CPU over an idle
  window longer than its reconcile interval (the writes must be 0);
- the floor beside it: on another fresh control plane, the same N Sandboxes
  and every write the operator made for them (its children's bodies, its two
  patches and its status, captured from its pass over one Sandbox there),
  replayed by a client with nothing between the requests (64 Sandboxes at a
  time: as many requests in flight as the operator allows itself). That is
  what the API server and etcd cost on this machine whatever the operator
  does (`--no-floor` leaves it out).

There is no kubelet in this tier: "done" means pod created and status written.
Progress is followed by watches, as a controller would: listing every pod
twice a second costs a 10,000-Sandbox API server more than the operator does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    Watcher,
    audit_flags,
    audit_requests,
    process_cpu,
    write_results,
)
from devcluster.controlplane import ControlPlane  # noqa: E402
from sandbox_operator.kube import Kube  # noqa: E402
from sandbox_operator.resources import (  # noqa: E402
    CLAIMS,
    NETWORK_POLICIES,
    PODS,
    SANDBOXES,
    SECRETS,
    Resource,
)
from tests.integration.harness import OperatorProcess, operator_credentials  # noqa: E402
from tests.kube import KubeJSON  # noqa: E402

OPERATOR_USER = "system:serviceaccount:sandbox-system:sandbox-operator"
NAMESPACE = "bench"
WRITES = ("create", "update", "patch", "delete", "deletecollection")


def rss_mib(pid: int, field: str = "VmHWM") -> float:
    """Peak (VmHWM) or current (VmRSS) resident memory of `pid`."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field}")


def sandbox_body(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "sandbox.dev/v1alpha1",
        "kind": "Sandbox",
        "metadata": {"name": name},
        "spec": {"runtime": "python", "lifecycle": {"idleTimeout": "30m"}},
    }


async def create_all(kubeconfig: Path, count: int, concurrency: int) -> None:
    kube = Kube.from_environment(str(kubeconfig))
    path = SANDBOXES.path(NAMESPACE)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            await kube.create(path, sandbox_body(f"sbx-{i:05d}"))

    await asyncio.gather(*(one(i) for i in range(count)))
    await kube.close()


# The floor's model Sandbox: as long as the benchmark's names, so that every
# replayed body has the size of the operator's.
MODEL = "sbx-model"
# What the operator creates for a Sandbox, by its child name (identity.names).
CHILDREN: tuple[tuple[Resource, str], ...] = (
    (SECRETS, f"{MODEL}-agent-token"),
    (CLAIMS, f"{MODEL}-workspace"),
    (NETWORK_POLICIES, MODEL),
    (PODS, MODEL),
)
SERVER_FIELDS = ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields")


@dataclass
class Writes:
    """The operator's writes for one Sandbox, as JSON text naming MODEL."""

    children: list[tuple[Resource, str]]
    finalizers: str
    annotations: str
    status: str


def capture(kubeconfig: Path, creds: Path, work: Path) -> Writes:
    """Run the operator over one Sandbox and keep what it wrote."""
    admin = KubeJSON(kubeconfig)
    (work / "model").mkdir()
    operator = OperatorProcess(creds, work / "model", {})
    operator.start()
    try:
        admin.create(SANDBOXES.path(NAMESPACE), sandbox_body(MODEL))
        deadline = time.monotonic() + 120
        while not written(admin.get(SANDBOXES.path(NAMESPACE, MODEL)) or {}):
            if time.monotonic() > deadline:
                raise SystemExit("the floor's model Sandbox got no status in 120 s")
            time.sleep(0.2)
    finally:
        operator.stop()
    sandbox = admin.read(SANDBOXES.path(NAMESPACE, MODEL))
    children = []
    for resource, name in CHILDREN:
        body = admin.read(resource.path(NAMESPACE, name))
        for key in SERVER_FIELDS:
            body["metadata"].pop(key, None)
        body.pop("status", None)
        children.append((resource, json.dumps(body)))
    meta = sandbox["metadata"]
    return Writes(
        children=children,
        finalizers=json.dumps({"metadata": {"finalizers": meta.get("finalizers") or []}}),
        annotations=json.dumps({"metadata": {"annotations": meta.get("annotations") or {}}}),
        status=json.dumps({"status": sandbox["status"]}),
    )


async def replay(kubeconfig: Path, writes: Writes, count: int, concurrency: int) -> None:
    """Each Sandbox created and given what the operator gave the model, in the
    operator's order, `concurrency` Sandboxes at a time."""
    kube = Kube.from_environment(str(kubeconfig))
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        name = f"sbx-{i:05d}"
        path = SANDBOXES.path(NAMESPACE, name)
        async with gate:
            created = await kube.create(SANDBOXES.path(NAMESPACE), sandbox_body(name))
            assert created is not None
            await kube.patch(path, json.loads(writes.finalizers))
            for resource, text in writes.children:
                body = json.loads(text.replace(MODEL, name))
                for owner in body["metadata"].get("ownerReferences") or []:
                    owner["uid"] = created["metadata"]["uid"]
                await kube.create(resource.path(NAMESPACE), body)
            await kube.patch(path, json.loads(writes.annotations.replace(MODEL, name)))
            await kube.patch(f"{path}/status", json.loads(writes.status.replace(MODEL, name)))

    await asyncio.gather(*(one(i) for i in range(count)))
    await kube.close()


def written(obj: dict[str, Any]) -> str | None:
    """A Sandbox whose status names its pod: the operator has been through it."""
    return "written" if (obj.get("status") or {}).get("podName") else None


def reconciled(watch: Watcher, name: str, generation: int) -> bool:
    """The status of Sandbox `name` reports `generation` (or a later one)."""
    obj = watch.last.get(name) or {}
    return int((obj.get("status") or {}).get("observedGeneration", 0)) >= generation


@dataclass
class Result:
    count: int
    created_s: float = 0.0
    done_s: float = 0.0
    rss_peak: float = 0.0
    rss_idle: float = 0.0
    rss_start: float = 0.0
    cpu_operator: float = 0.0
    cpu_cluster: float = 0.0
    requests: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    idle_s: float = 0.0
    idle_writes: dict[str, int] = field(default_factory=dict)
    idle_reads: int = 0
    idle_cpu: float = 0.0
    tracebacks: int = 0
    floor_s: float = 0.0
    floor_cpu_cluster: float = 0.0
    floor_cpu_client: float = 0.0


def prepare(cp: ControlPlane, admin: KubeJSON, work: Path) -> Path:
    """The CRDs, the operator's credentials (the chart's RBAC; their kubeconfig is
    returned) and the namespace the Sandboxes go in."""
    for crd in _crds():
        admin.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    time.sleep(2)  # CRDs established
    creds = operator_credentials(cp, admin, REPO, work / "operator.kubeconfig")
    admin.create("/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
    return creds


def run_size(count: int, args: argparse.Namespace) -> Result:
    result = Result(count)
    work = Path(tempfile.mkdtemp(prefix=f"sandbox-scale-{count}-"))
    flags, audit_log = audit_flags(work, [OPERATOR_USER])
    cp = ControlPlane(f"bench-{os.getpid()}", apiserver_args=flags)
    cp.start()
    operator: OperatorProcess | None = None
    watches: list[Watcher] = []
    try:
        admin = KubeJSON(cp.kubeconfig)
        creds = prepare(cp, admin, work)
        operator = OperatorProcess(creds, work, {})
        operator.start()
        assert operator.proc is not None
        pid = operator.proc.pid
        sandboxes = Watcher(cp.kubeconfig, SANDBOXES.path(NAMESPACE), written)
        pods = Watcher(cp.kubeconfig, PODS.path(NAMESPACE), lambda _: "made", keep_last=False)
        watches = [sandboxes, pods]
        result.rss_start = rss_mib(pid)
        cpu_operator0 = process_cpu(pid)
        cpu_cluster0 = sum(process_cpu(p) for p in cp.pids().values())

        # 1. Create them all; wait for every pod and status.
        started = time.time()
        t0 = time.monotonic()
        asyncio.run(create_all(cp.kubeconfig, count, args.concurrency))
        result.created_s = time.monotonic() - t0
        deadline = t0 + args.timeout
        statused = sandboxes.until(
            lambda: sandboxes.counts["written"] == count, deadline - time.monotonic()
        )
        podded = pods.until(
            lambda: pods.counts["made"] == count, max(0.0, deadline - time.monotonic())
        )
        result.done_s = time.monotonic() - t0
        finished = time.time()
        if not (statused and podded):
            raise SystemExit(
                f"{count}: not done after {args.timeout}s: status"
                f" {sandboxes.counts['written']}, pods {pods.counts['made']}"
            )
        result.rss_peak = rss_mib(pid)
        result.cpu_operator = process_cpu(pid) - cpu_operator0
        result.cpu_cluster = sum(process_cpu(p) for p in cp.pids().values()) - cpu_cluster0

        # 2. One change at a time among `count` settled Sandboxes: spec -> status.
        time.sleep(args.settle)
        for k in range(args.changes):
            name = f"sbx-{(k * count) // args.changes:05d}"
            t1 = time.monotonic()
            edited = admin.patch(
                SANDBOXES.path(NAMESPACE, name),
                {"spec": {"lifecycle": {"idleTimeout": f"{31 + k}m"}}},
            )
            generation: int = edited["metadata"]["generation"]
            if not sandboxes.until(partial(reconciled, sandboxes, name, generation), 120):
                raise SystemExit(f"{count}: the change to {name} was not reconciled in 120 s")
            result.latencies.append(time.monotonic() - t1)
            time.sleep(1)

        # 3. Idle: longer than the reconcile interval (what a periodic pass would
        # cost shows in it); the Sandboxes here wait for nothing, so only their
        # resync (10 min, spread by UID) would wake them.
        time.sleep(2)  # the last change's own writes are over
        idle_cpu0, idle0 = process_cpu(pid), time.time()
        time.sleep(args.idle)
        idle1 = time.time()
        result.idle_s = idle1 - idle0
        result.idle_cpu = process_cpu(pid) - idle_cpu0
        result.rss_idle = rss_mib(pid, "VmRSS")
        time.sleep(1)  # let the audit backend flush
        result.requests = dict(audit_requests(audit_log, OPERATOR_USER, started, finished))
        idle = audit_requests(audit_log, OPERATOR_USER, idle0, idle1)
        result.idle_writes = {k: v for k, v in idle.items() if k.split()[0] in WRITES}
        result.idle_reads = sum(v for k, v in idle.items() if k.split()[0] not in WRITES)
        result.tracebacks = len(operator.errors())
        print(f"  (work dir, with the audit and operator logs: {work})")
        return result
    finally:
        for watch in watches:
            watch.close()
        if operator is not None:
            operator.stop()
        cp.stop(remove_state=True)


def run_floor(count: int, args: argparse.Namespace, result: Result) -> None:
    """The same Sandboxes and writes without the operator (see the module's doc):
    the time until every pod and status is written, as for the operator's run,
    and the CPU of the control plane and of the client that wrote them."""
    work = Path(tempfile.mkdtemp(prefix=f"sandbox-scale-floor-{count}-"))
    cp = ControlPlane(f"floor-{os.getpid()}")
    cp.start()
    watches: list[Watcher] = []
    try:
        admin = KubeJSON(cp.kubeconfig)
        creds = prepare(cp, admin, work)
        writes = capture(cp.kubeconfig, creds, work)
        sandboxes = Watcher(cp.kubeconfig, SANDBOXES.path(NAMESPACE), written)
        pods = Watcher(cp.kubeconfig, PODS.path(NAMESPACE), lambda _: "made", keep_last=False)
        watches = [sandboxes, pods]
        cpu_cluster0 = sum(process_cpu(p) for p in cp.pids().values())
        cpu_client0 = process_cpu(os.getpid())
        t0 = time.monotonic()
        asyncio.run(replay(cp.kubeconfig, writes, count, args.floor_concurrency))
        # The watches began after the model Sandbox: they count the replayed ones.
        if not (
            sandboxes.until(lambda: sandboxes.counts["written"] == count, args.timeout)
            and pods.until(lambda: pods.counts["made"] == count, args.timeout)
        ):
            raise SystemExit(f"floor {count}: the replayed writes were not all seen")
        result.floor_s = time.monotonic() - t0
        result.floor_cpu_cluster = sum(process_cpu(p) for p in cp.pids().values()) - cpu_cluster0
        # The watches' threads are in this process too: the client's whole cost.
        result.floor_cpu_client = process_cpu(os.getpid()) - cpu_client0
    finally:
        for watch in watches:
            watch.close()
        cp.stop(remove_state=True)


def report(results: list[Result], concurrency: int) -> None:
    print(f"\nSandboxes created {concurrency} at a time; columns are sizes, each on its own")
    print("control plane and operator.\n")
    rows: list[tuple[str, Callable[[Result], str]]] = [
        ("Sandboxes", lambda r: f"{r.count:,}"),
        ("all creates accepted (s)", lambda r: f"{r.created_s:.1f}"),
        ("every pod and status written (s)", lambda r: f"{r.done_s:.1f}"),
        ("  per 1,000 Sandboxes (s)", lambda r: f"{r.done_s / r.count * 1000:.1f}"),
        ("operator peak RSS (MiB)", lambda r: f"{r.rss_peak:.1f}"),
        ("  RSS when idle after (MiB)", lambda r: f"{r.rss_idle:.1f}"),
        ("operator CPU (s)", lambda r: f"{r.cpu_operator:.1f}"),
        ("  per Sandbox (ms)", lambda r: f"{r.cpu_operator / r.count * 1000:.1f}"),
        ("etcd + apiserver + controller-manager CPU (s)", lambda r: f"{r.cpu_cluster:.1f}"),
        ("API requests per Sandbox", lambda r: f"{sum(r.requests.values()) / r.count:.2f}"),
        ("one change -> status, p50 (ms)", lambda r: f"{statistics.median(r.latencies) * 1e3:.0f}"),
        ("one change -> status, max (ms)", lambda r: f"{max(r.latencies) * 1e3:.0f}"),
        ("idle window (s)", lambda r: f"{r.idle_s:.0f}"),
        ("  API writes in it", lambda r: f"{sum(r.idle_writes.values())}"),
        ("  API reads in it", lambda r: f"{r.idle_reads}"),
        ("  operator CPU share (%)", lambda r: f"{r.idle_cpu / r.idle_s * 100:.1f}"),
        ("handler tracebacks", lambda r: f"{r.tracebacks}"),
    ]
    if any(r.floor_s for r in results):
        rows += [
            ("floor: the same writes, no operator (s)", lambda r: f"{r.floor_s:.1f}"),
            ("  operator's run / floor", lambda r: f"{r.done_s / r.floor_s:.2f}x"),
            ("  control plane CPU (s)", lambda r: f"{r.floor_cpu_cluster:.1f}"),
            ("  the writing client's CPU (s)", lambda r: f"{r.floor_cpu_client:.1f}"),
        ]
    width = max(len(label) for label, _ in rows)
    for label, cell in rows:
        print(f"  {label:<{width}} " + " ".join(f"{cell(r):>10}" for r in results))
    print(
        "\n  Targets: 10,000 in <= 150 s (or its floor), per 1,000 within 10 %, peak RSS"
        " <= 400 MiB, operator CPU <= 12 ms per Sandbox, idle <= 3 %, 0 idle writes."
    )
    for r in results:
        print(f"\n  API requests at {r.count:,} (per Sandbox):")
        for key, value in sorted(r.requests.items(), key=lambda kv: -kv[1]):
            if value >= r.count / 100:
                print(f"    {key:<40} {value:7d}  ({value / r.count:.2f})")
        for key, value in r.idle_writes.items():
            print(f"    idle write: {key} {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1000,3000,10000", help="comma-separated counts")
    parser.add_argument("--concurrency", type=int, default=20, help="client-side creates in flight")
    parser.add_argument("--timeout", type=float, default=900, help="per size")
    parser.add_argument("--changes", type=int, default=5, help="single changes timed per size")
    parser.add_argument("--settle", type=float, default=5, help="seconds before the changes")
    parser.add_argument(
        "--idle",
        type=float,
        default=45,
        help="idle window; longer than the reconcile interval (30 s)",
    )
    parser.add_argument("--no-floor", action="store_true", help="leave out the API floor")
    parser.add_argument(
        "--floor-concurrency",
        type=int,
        default=64,
        help="Sandboxes the floor's client writes at a time (each one's writes in order);"
        " the operator's default is 64 requests in flight",
    )
    args = parser.parse_args()
    results = []
    failed = None
    for count in (int(size) for size in args.sizes.split(",")):
        print(f"== {count:,} Sandboxes", flush=True)
        try:
            result = run_size(count, args)
            if not args.no_floor:
                print(f"== {count:,} Sandboxes: the floor", flush=True)
                run_floor(count, args, result)
        except SystemExit as exc:
            # The sizes measured before stay reported; the run still fails.
            failed = exc
            break
        results.append(result)
    if results:
        report(results, args.concurrency)
        sizes = [asdict(r) for r in results]
        write_results("scale", {"concurrency": args.concurrency, "sizes": sizes})
    if failed is not None:
        raise failed


def _crds() -> list[dict[str, Any]]:
    from sandbox_operator.api.crd import all_crds

    return [json.loads(json.dumps(d)) for d in all_crds().values()]


if __name__ == "__main__":
    main()
