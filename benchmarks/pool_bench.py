"""Warm pools on the real local node, side by side with cold starts of the same template.

    python benchmarks/pool_bench.py [--count 50] [--burst 100] [--parallel 20]

1. One at a time, alternating, `--count` each: a Sandbox claimed from a pool and a
   cold Sandbox of the pool's template, create -> Ready condition seen by a
   watch. Each is deleted once Ready (a claimed one takes its member along),
   and each sample starts on a settled node: the pool full again and nothing
   of the sample before still stopping, so neither kind pays for the other's
   teardown or refill.
2. Refill: the pool scaled to `--burst` members; the time until all are ready.
3. Burst: `--burst` claims, `--parallel` creates in flight, against the full
   pool: per-claim create -> Ready, and first create -> last Ready.
4. API writes by the operator (the kube-apiserver's audit log): per claim, on
   the claim's path (the claiming Sandbox and the member it took) and, apart,
   everything else in the same time (the refill making new members).
5. CPU: the machine's busy share and each node component's CPU seconds, idle
   with the full pool and over the burst, to show what bounds the burst.
6. The API floor, side by side on the same node: the operator stopped, this
   client makes the burst's API writes itself (the creates, and for each the
   three patches of a claim) at the same parallelism. No operator on this
   node can make the burst faster than that. Twice: on minimal objects (an
   empty Sandbox that is its own member), and on objects of the burst's own
   sizes (the members the burst claimed, handed over again with the
   operator's claim patch, and the statuses the burst's claimers were
   written), where the API server's admission and watch cost per write is
   the burst's.
7. The floor of one claim: the operator still stopped, a stand-in in this
   process follows Sandboxes with a watch of its own and answers each new one
   with a claim's requests (the member's pod read; the member's owner patch,
   conditioned on its resourceVersion, beside the claimer's finalizer; then
   the claimer's status with Ready), `--count` claims one at a time, timed as
   the sequential claims are. What the operator adds to a claim is the
   difference.

The template has an ephemeral workspace and the dense resource profile, so
that 100 members fit the node (maxPods 110, 2 cores): the cold start it is compared
with has no volume to provision either, which is its fastest case.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    CpuUse,
    Watcher,
    audit_flags,
    audit_requests,
    cpu_use,
    create_namespace,
    latency_row,
    percentile,
    wait_until,
    write_results,
)
from devcluster import deploy  # noqa: E402
from devcluster.cluster import LocalCluster  # noqa: E402
from devcluster.storage import StorageAddon  # noqa: E402
from sandbox_operator.builders import pool as pools  # noqa: E402
from sandbox_operator.resources import FINALIZER  # noqa: E402
from tests.kube import JSON, KubeJSON, api_path, core_path  # noqa: E402

T = TypeVar("T")

NS = "poolbench"
GROUP = "sandbox.dev/v1alpha1"
# The pool's size for the sequential samples.
WARM = 10
# How long the node's CPU is measured with the full pool and nothing asked.
IDLE_SECONDS = 10.0
OPERATOR_USER = f"system:serviceaccount:{deploy.NAMESPACE}:sandbox-operator"
WRITES = {"create", "update", "patch", "delete"}
# The dense resource profile: a hundred members and their agents fit one 2-core node.
TEMPLATE = {
    "description": "python, ephemeral workspace, dense",
    "sandbox": {
        "runtime": "python",
        "resources": {"profile": "dense"},
        "workspace": {"ephemeral": True},
    },
}


def sandboxes_path(name: str | None = None) -> str:
    return api_path(GROUP, "sandboxes", NS, name)


def pool_path(name: str | None = None) -> str:
    return api_path(GROUP, "sandboxpools", NS, name)


def ready_state(obj: JSON) -> str | None:
    conds = (obj.get("status") or {}).get("conditions") or []
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
    return "ready" if ready else None


# Monotonic times of this benchmark to wall clock (the audit log's), for minutes-long runs.
WALL = time.time() - time.monotonic()


def create_sandbox(kube: KubeJSON, name: str, spec: JSON) -> float:
    """Create; the moment just before the request (monotonic)."""
    started = time.monotonic()
    kube.create(
        sandboxes_path(),
        {"apiVersion": GROUP, "kind": "Sandbox", "metadata": {"name": name}, "spec": spec},
    )
    return started


def pool_status(kube: KubeJSON, name: str) -> JSON:
    return (kube.get(pool_path(name)) or {}).get("status") or {}


def wait_pool_ready(kube: KubeJSON, name: str, ready: int, timeout: float = 900) -> None:
    wait_until(lambda: pool_status(kube, name).get("ready", 0) >= ready, timeout)


def audit_writes(log: Path, since: float, until: float) -> list[JSON]:
    """The operator's write requests from `since` to `until` (epoch seconds)."""
    seen: set[str] = set()
    found: list[JSON] = []
    for line in log.read_text().splitlines():
        event = json.loads(line)
        if event["user"]["username"] != OPERATOR_USER or event["auditID"] in seen:
            continue
        if event["verb"] not in WRITES:
            continue
        received = datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp()
        if since <= received <= until:
            seen.add(event["auditID"])
            found.append(event)
    return found


def describe(event: JSON) -> str:
    ref = event.get("objectRef") or {}
    sub = ref.get("subresource")
    code = (event.get("responseStatus") or {}).get("code", 200)
    refused = f" ({code})" if code >= 300 else ""
    return f"{event['verb']} {ref.get('resource', '?')}{'/' + sub if sub else ''}{refused}"


@dataclass(frozen=True)
class Claim:
    """One claim as the benchmark saw it (wall clock, to match the audit log)."""

    name: str
    member: str
    created: float
    ready: float


def received(event: JSON) -> float:
    return datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp()


def claim_writes(writes: list[JSON], claims: list[Claim], until_ready: bool) -> list[JSON]:
    """The writes on the claims' path: on each claiming Sandbox, and on the member it
    took from its create on; up to its Ready when `until_ready`."""
    by_name = {c.name: c for c in claims} | {c.member: c for c in claims}
    mine = []
    for write in writes:
        claim = by_name.get((write.get("objectRef") or {}).get("name", ""))
        if claim is None or received(write) < claim.created:
            continue
        if until_ready and received(write) > claim.ready:
            continue
        mine.append(write)
    return mine


def stop_operator(kube: KubeJSON) -> None:
    """Scale the operator to nothing and wait until its pods are gone."""
    deployment = api_path("apps/v1", "deployments", deploy.NAMESPACE, deploy.RELEASE)
    kube.patch(deployment, {"spec": {"replicas": 0}})
    wait_until(
        lambda: (
            not kube.list(
                core_path("pods", deploy.NAMESPACE), label_selector=deploy.OPERATOR_SELECTOR
            )
        ),
        120,
    )


def owner_reference(owner: JSON) -> JSON:
    return {
        "apiVersion": GROUP,
        "kind": "Sandbox",
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def mark_patch() -> JSON:
    """The claimer's finalizer and Kopf's digest, as the operator writes them."""
    digest = {"kopf.sandbox.dev/last-handled-digest": "0" * 64}
    return {"metadata": {"finalizers": [FINALIZER], "annotations": digest}}


def member_patch(member: JSON, claimer: JSON) -> JSON:
    """A claim's patch of a member: conditioned on its resourceVersion."""
    return {
        "metadata": {
            "resourceVersion": member["metadata"]["resourceVersion"],
            "labels": {"sandbox.dev/pool": None, "floor": "member"},
            "ownerReferences": [owner_reference(claimer)],
        }
    }


def claimed_status(member: str) -> JSON:
    use = {
        "name": "warm",
        "outcome": "Claimed",
        "member": member,
        "memberUid": "-",
        "templateRef": {"kind": "SandboxTemplate", "name": "py"},
    }
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    ready = {"type": "Ready", "status": "True", "reason": "SandboxReady", "message": "claimed"}
    return {
        "status": {
            "phase": "Running",
            "pool": use,
            "conditions": [ready | {"lastTransitionTime": now}],
        }
    }


def api_floor(kube: KubeJSON, count: int, parallel: int, owner: JSON) -> tuple[float, CpuUse]:
    """The burst's API writes with no operator: `count` creates, each followed by a
    claim's three patches (the claimer's finalizer and digest; a member's owner
    and pool label, with its resourceVersion; the claimer's status with Ready),
    `parallel` at a time. The time from the first create to the last patch.
    The operator must be stopped."""

    def claim(name: str) -> None:
        kube.create(
            sandboxes_path(),
            {"apiVersion": GROUP, "kind": "Sandbox", "metadata": {"name": name}, "spec": {}},
        )
        path = sandboxes_path(name)
        marked = kube.patch(path, mark_patch())
        # Conditioned, as a claim is (here on the same object).
        kube.patch(path, member_patch(marked, owner))
        kube.patch(f"{path}/status", claimed_status(name))

    return in_parallel(claim, [f"floor-{i:03d}" for i in range(count)], parallel)


def api_floor_on_members(
    kube: KubeJSON, claimers: list[JSON], parallel: int
) -> tuple[float, CpuUse]:
    """The burst's API requests once more, on objects of the burst's own sizes: for
    each claimer of the burst, a new Sandbox of the same spec is created and
    marked, the member that claimer took is read (its pod, as a claim reads it)
    and handed over with the operator's own claim patch, and the new Sandbox
    gets the status its counterpart was written. `api_floor` does the same
    writes on minimal objects. The operator must be stopped."""
    members = {
        c["metadata"]["name"]: kube.read(sandboxes_path(c["status"]["pool"]["member"]))
        for c in claimers
    }

    def claim(claimer: JSON) -> None:
        name = f"again-{claimer['metadata']['name']}"
        created = kube.create(
            sandboxes_path(),
            {
                "apiVersion": GROUP,
                "kind": "Sandbox",
                "metadata": {"name": name},
                "spec": {"poolRef": {"name": "warm"}},
            },
        )
        path = sandboxes_path(name)
        kube.patch(path, mark_patch())
        member = members[claimer["metadata"]["name"]]
        member_name = member["metadata"]["name"]
        kube.get(core_path("pods", NS, member_name))
        kube.patch(sandboxes_path(member_name), pools.claim_patch(member, created))
        kube.patch(f"{path}/status", {"status": claimer["status"]})

    return in_parallel(claim, claimers, parallel)


def in_parallel(work: Callable[[T], None], items: list[T], parallel: int) -> tuple[float, CpuUse]:
    """`work` on every item, `parallel` at a time: the seconds from the first
    to the last, and the machine's CPU meanwhile."""
    with cpu_use() as used:
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            list(pool.map(work, items))
        took = time.monotonic() - started
    return took, used


def claim_floor(kubeconfig: Path, watch: Watcher, count: int) -> list[float]:
    """`count` claims, one at a time, answered by a stand-in that does a claim's
    requests as the operator does them (see the module's docstring, 7): create ->
    Ready seen by `watch`, in seconds. The operator must be stopped."""
    kube = KubeJSON(kubeconfig)
    pod = kube.list(core_path("pods", NS))[0]["metadata"]["name"]
    members = []
    for i in range(count):
        create_sandbox(kube, f"lone-member-{i:03d}", {})
        members.append(kube.read(sandboxes_path(f"lone-member-{i:03d}")))
    version = str(kube.read(sandboxes_path())["metadata"]["resourceVersion"])
    # Two clients: the finalizer goes beside the claim, as the operator sends it.
    claims, marks = KubeJSON(kubeconfig), KubeJSON(kubeconfig)
    side = ThreadPoolExecutor(max_workers=1)
    done = threading.Event()

    def answer(claimer: JSON) -> None:
        path = sandboxes_path(claimer["metadata"]["name"])
        member = members.pop(0)
        marking = side.submit(marks.patch, path, mark_patch())
        claims.get(core_path("pods", NS, pod))
        claims.patch(sandboxes_path(member["metadata"]["name"]), member_patch(member, claimer))
        claims.patch(f"{path}/status", claimed_status(member["metadata"]["name"]))
        marking.result()

    def react() -> None:
        try:
            for event in claims.watch(sandboxes_path(), version, timeout_seconds=600):
                obj = event["object"]
                if event["type"] == "ADDED" and obj["metadata"]["name"].startswith("lone-claim-"):
                    answer(obj)
        except Exception:  # closed under it once done (httpx's errors, or a closed stream's)
            if not done.is_set():
                raise  # the stand-in failed: the wait below says which claim went unanswered

    reactor = threading.Thread(target=react, daemon=True)
    reactor.start()
    took = []
    for i in range(count):
        name = f"lone-claim-{i:03d}"
        started = create_sandbox(kube, name, {"poolRef": {"name": "warm"}})
        _, seen = watch.wait(name, {"ready"}, timeout=60)
        took.append(seen - started)
        time.sleep(0.2)  # as the sequential claims, one at a time on a quiet control plane
    done.set()
    claims.close()  # ends the stand-in's watch
    reactor.join(timeout=10)
    side.shutdown()
    return took


@contextmanager
def cluster_with_audit(work: Path) -> Any:
    flags, log = audit_flags(work, [OPERATOR_USER])
    cluster = LocalCluster(
        f"bench-pool-{os.getpid()}", addons=[StorageAddon()], apiserver_args=flags
    )
    cluster.start()
    try:
        deploy.install_operator(cluster)
        deploy.wait_for_crds(cluster)
        yield cluster, log
    finally:
        cluster.stop(remove_state=True)


def settle(kube: KubeJSON, replicas: int) -> None:
    """Until the pool is full and no Sandbox or pod of an earlier sample is stopping."""

    def quiet() -> bool:
        if pool_status(kube, "warm").get("ready", 0) < replicas:
            return False
        going = [*kube.list(sandboxes_path()), *kube.list(core_path("pods", NS))]
        return not any(obj["metadata"].get("deletionTimestamp") for obj in going)

    wait_until(quiet, 300)


def claimed(watch: Watcher, name: str, started: float, seen: float) -> Claim:
    use = (watch.last[name].get("status") or {}).get("pool") or {}
    if use.get("outcome") != "Claimed":
        raise SystemExit(f"{name} was not served by the pool: {use}")
    return Claim(name, use["member"], WALL + started, WALL + seen)


def sequential(
    kube: KubeJSON, watch: Watcher, count: int, replicas: int
) -> tuple[list[Claim], list[float]]:
    """Claims and cold starts, alternating; (the claims, cold start seconds)."""
    claims: list[Claim] = []
    colds: list[float] = []
    for i in range(count):
        settle(kube, replicas)
        name = f"claim-{i}"
        started = create_sandbox(kube, name, {"poolRef": {"name": "warm"}})
        _, seen = watch.wait(name, {"ready"}, timeout=120)
        claims.append(claimed(watch, name, started, seen))
        kube.delete(sandboxes_path(name))
        settle(kube, replicas)
        cold = f"cold-{i}"
        started = create_sandbox(kube, cold, {"templateRef": {"name": "py"}})
        _, seen = watch.wait(cold, {"ready"}, timeout=300)
        colds.append(seen - started)
        kube.delete(sandboxes_path(cold))
    return claims, colds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--burst", type=int, default=100)
    parser.add_argument("--parallel", type=int, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pool-bench-"))
    with cluster_with_audit(work) as (cluster, log):
        kube = KubeJSON(cluster.kubeconfig)
        create_namespace(kube, NS, deploy.POD_SECURITY_RESTRICTED)
        kube.create(
            api_path(GROUP, "sandboxtemplates", NS),
            {
                "apiVersion": GROUP,
                "kind": "SandboxTemplate",
                "metadata": {"name": "py"},
                "spec": TEMPLATE,
            },
        )
        kube.create(
            pool_path(),
            {
                "apiVersion": GROUP,
                "kind": "SandboxPool",
                "metadata": {"name": "warm"},
                "spec": {"templateRef": {"name": "py"}, "replicas": WARM, "maxCreating": 5},
            },
        )
        wait_pool_ready(kube, "warm", WARM)
        with Watcher(cluster.kubeconfig, sandboxes_path(), ready_state) as watch:
            t0 = time.time()
            seq_claims, colds = sequential(kube, watch, args.count, WARM)
            seq_writes = audit_writes(log, t0, time.time() + 1)
            claims = [c.ready - c.created for c in seq_claims]
            print(latency_row("claim from a pool", claims), flush=True)
            print(latency_row("cold start, same template", colds), flush=True)

            # Refill: from WARM to `burst` ready members.
            started = time.monotonic()
            kube.patch(pool_path("warm"), {"spec": {"replicas": args.burst, "maxCreating": 20}})
            wait_pool_ready(kube, "warm", args.burst)
            refill_s = time.monotonic() - started
            # From now on the refill goes one member at a time: the node holds
            # 110 pods, and the burst is measured, not the refill.
            kube.patch(pool_path("warm"), {"spec": {"maxCreating": 1}})
            print(f"refilled in {refill_s:.1f} s; the burst starts", flush=True)

            # What the node spends with nothing asked of it: the burst competes with it.
            with cpu_use() as idle:
                time.sleep(IDLE_SECONDS)
            print(idle.report(), flush=True)

            names = [f"burst-{i:03d}" for i in range(args.burst)]
            # First create to last Ready: the machine's CPU, and whose it was.
            with cpu_use() as burst_cpu:
                wall0, first = time.time(), time.monotonic()
                with ThreadPoolExecutor(max_workers=args.parallel) as pool:
                    starts = dict(
                        zip(
                            names,
                            # One client for all (httpx pools its connections), as a
                            # backend keeps one: a TLS handshake per create is not a claim's.
                            pool.map(
                                lambda n: create_sandbox(kube, n, {"poolRef": {"name": "warm"}}),
                                names,
                            ),
                            strict=True,
                        )
                    )
                seen_at = {n: watch.wait(n, {"ready"}, timeout=300)[1] for n in names}
            # Kopf's own bookkeeping of the last claims (finalizer, digest) follows Ready.
            time.sleep(3)
            wall1 = time.time()
            burst_claims = [claimed(watch, n, starts[n], seen_at[n]) for n in names]
            burst = [c.ready - c.created for c in burst_claims]
            all_ready_s = max(seen_at.values()) - first
            outcomes = collections.Counter(
                ((watch.last[n].get("status") or {}).get("pool") or {}).get("outcome")
                for n in names
            )
            stop_operator(kube)
            floor_s, floor_cpu = api_floor(kube, args.burst, args.parallel, watch.last[names[0]])
            claimers = [watch.last[n] for n in names]
            members_s, members_cpu = api_floor_on_members(kube, claimers, args.parallel)
            lone = claim_floor(cluster.kubeconfig, watch, args.count)
        time.sleep(2)  # the audit backend flushes
        burst_writes = audit_writes(log, wall0, wall1)
        # Reads too: what the API server serves the operator during the burst.
        burst_requests = audit_requests(log, OPERATOR_USER, wall0, wall1)

    ratio = statistics.median(colds) / statistics.median(claims)
    print(f"\nSequential, {args.count} each (create -> Ready seen by a watch):")
    print(latency_row("claim from a pool", claims))
    print(latency_row("cold start, same template", colds))
    print(f"  cold / claim (p50)                   {ratio:8.1f}x")
    print(latency_row("floor: a stand-in's claim", lone))
    lone_ratio = statistics.median(claims) / statistics.median(lone)
    print(f"  claim / floor (p50)                  {lone_ratio:8.2f}x")
    print("  (targets: claim p50 <= 25 ms, p90 <= 50 ms)")
    print(f"\nRefill from {WARM} to {args.burst} ready members: {refill_s:.1f} s")
    print(f"\nBurst: {args.burst} claims, {args.parallel} creates in flight, pool of {args.burst}:")
    print(latency_row("claim", burst))
    print(f"  first create -> last Ready           {all_ready_s * 1000:8.1f} ms   (target <= 1 s)")
    print(f"  outcomes                             {dict(outcomes)}")
    before_seq = claim_writes(seq_writes, seq_claims, until_ready=True)
    before_burst = claim_writes(burst_writes, burst_claims, until_ready=True)
    # The burst's claimers are not deleted: all their writes in the window are the claim's.
    all_burst = claim_writes(burst_writes, burst_claims, until_ready=False)
    rest_burst = [w for w in burst_writes if w not in all_burst]
    print("\nOperator API writes per claim, on the claimer and the member it took (target <= 3):")
    rows = (
        ("sequential, up to Ready", before_seq, args.count),
        ("burst, up to Ready", before_burst, args.burst),
        ("burst, all", all_burst, args.burst),
    )
    for label, mine, count in rows:
        kinds = dict(collections.Counter(map(describe, mine)))
        print(f"  {label + ':':<25} {len(mine) / count:.2f}   {kinds}")
    print("Other operator writes during the burst (the refill, pool status, peering):")
    print(f"  {dict(collections.Counter(map(describe, rest_burst)))}")
    print(f"Every operator request during the burst:\n  {dict(burst_requests)}")
    print(f"Idle, the pool full ({IDLE_SECONDS:.0f} s):\n{idle.report()}")
    print(f"Burst, first create to last Ready:\n{burst_cpu.report()}")
    print(
        f"\nAPI floor: the burst's {args.burst} creates and {3 * args.burst} claim patches"
        f" from this client, {args.parallel} at a time, no operator: {floor_s * 1000:.0f} ms"
        f" (burst / floor {all_ready_s / floor_s:.1f}x)\n{floor_cpu.report()}"
    )
    print(
        f"\nAPI floor on the burst's own objects: its requests again (the same creates,"
        f" claim patches of the members it claimed, the statuses it wrote), {args.parallel}"
        f" at a time, no operator: {members_s * 1000:.0f} ms"
        f" (burst / floor {all_ready_s / members_s:.1f}x)\n{members_cpu.report()}"
    )
    write_results(
        "pool",
        {
            "count": args.count,
            "claim_p50_ms": statistics.median(claims) * 1000,
            "claim_p90_ms": percentile(claims, 0.9) * 1000,
            "claim_floor_p50_ms": statistics.median(lone) * 1000,
            "claim_floor_p90_ms": percentile(lone, 0.9) * 1000,
            "cold_p50_ms": statistics.median(colds) * 1000,
            "cold_p90_ms": percentile(colds, 0.9) * 1000,
            "refill_s": refill_s,
            "burst": args.burst,
            "parallel": args.parallel,
            "burst_p50_ms": statistics.median(burst) * 1000,
            "burst_p90_ms": percentile(burst, 0.9) * 1000,
            "burst_all_ready_ms": all_ready_s * 1000,
            "burst_outcomes": dict(outcomes),
            "writes_per_claim_until_ready_sequential": len(before_seq) / args.count,
            "writes_per_claim_until_ready_burst": len(before_burst) / args.burst,
            "writes_per_claim_burst": len(all_burst) / args.burst,
            "claim_path_writes": dict(collections.Counter(map(describe, all_burst))),
            "other_writes_burst": dict(collections.Counter(map(describe, rest_burst))),
            "requests_burst": dict(burst_requests),
            "api_floor_on_members_ms": members_s * 1000,
            "api_floor_on_members_cpu": members_cpu.to_json(),
            "idle_cpu": idle.to_json(),
            "burst_cpu": burst_cpu.to_json(),
            "api_floor_ms": floor_s * 1000,
            "api_floor_cpu": floor_cpu.to_json(),
        },
    )


if __name__ == "__main__":
    main()
