"""E2B's Python SDK through the E2B adapter against our own SDK, side by side in one run.

    python benchmarks/e2b_bench.py [--runs 200] [--file-runs 60] [--code-runs 200]
                                   [--cpu-runs 100] [--creates 10] [--cluster NAME]

A new node cluster with the chart installed with `gateway.e2b.enabled=true`
(the E2B listener on the gateway Service's port `e2b`), a Pod Security
`restricted` namespace with the two warm pools of examples/pool-e2b.yaml
(`base` and `code-interpreter-v1`, one member each), and a ServiceAccount
bound to the chart's user role: its token is both SDKs' credential (E2B's
API key, our SDK's gateway token and kubeconfig user), so RBAC sees the same
caller on both paths. Both SDKs reach the gateway the same way, at its
Service's ClusterIP (kube-proxy on the node), over plain HTTP/1.1: E2B's
`e2b` and `e2b_code_interpreter` at port `e2b` (what E2B_API_URL and
E2B_SANDBOX_URL say), ours at port `http` (`gateway_url`; its lifecycle calls
go to the API server with the same token). `--cluster local` runs against a
running cluster instead (`make up`'s: namespace `default`, ServiceAccount
`sandbox-demo`, its pools e2b-base and e2b-code-interpreter; `--gateway-url`
and `--e2b-url` point both SDKs at a gateway process run from a checkout).

One sandbox, made by E2B's code interpreter `Sandbox.create()`, and our SDK's
handle on it (`connect(sandbox_id)`: an E2B ID is the Sandbox's name). Call by
call, interleaved, after 5 warm-up calls of each:

1. `commands.run("true")` against `execute(["/bin/bash", "-l", "-c", "true"])`,
   the argv E2B's SDK sends for it (the same process in the sandbox);
2. `files.write` of 1 MiB against `files.write` of the same bytes;
3. `run_code("x+1")` against `run_code("x+1")`, both in the sandbox's default
   Python context (`x = 1` set first);

each followed by `--cpu-runs` calls of one path, then of the other, for the
CPU each costs per call: the gateway's pods and the sandbox's pod (their
cgroups) and this process (the SDK's own work). Then:

4. create -> usable, each template in turn, interleaved: E2B's
   `Sandbox.create(template)` then a first `commands.run("true")`, against our
   `create(pool=...)` then a first `execute`; each killed then, and every
   sample starts on a settled namespace (the pool full again, the sample
   before gone), so neither pays for the other's refill.

Target (issue): the E2B path within 1.2x of ours (ratios E2B / ours printed).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    create_namespace,
    operator_cluster,
    percentile,
    wait_until,
    write_results,
)
from devcluster import deploy  # noqa: E402
from devcluster.cluster import LocalCluster  # noqa: E402
from sandbox_sdk import Sandbox as OurSandbox  # noqa: E402
from sandbox_sdk import SandboxClient  # noqa: E402
from tests.kube import JSON, KubeJSON, api_path, core_path  # noqa: E402

GROUP = "sandbox.dev/v1alpha1"
NS = "bench-e2b"
ACCOUNT = "bench"
# What `make up` leaves for `--cluster`: its demo account and the example's pools.
LOCAL_NS, LOCAL_ACCOUNT = "default", "sandbox-demo"
POOLS = REPO / "examples" / "pool-e2b.yaml"
# E2B's command for `commands.run(cmd)` (its SDK's Commands._start).
TRUE_ARGV = ["/bin/bash", "-l", "-c", "true"]
MIB = 1 << 20
WARM_UP = 5
Call = Callable[[], Any]


def _timed(call: Call) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def interleaved(e2b: Call, ours: Call, count: int) -> tuple[list[float], list[float]]:
    """`count` timings of each, call by call, after warming both."""
    for _ in range(WARM_UP):
        e2b()
        ours()
    e2b_times: list[float] = []
    our_times: list[float] = []
    for _ in range(count):
        e2b_times.append(_timed(e2b))
        our_times.append(_timed(ours))
    return e2b_times, our_times


def compare(label: str, e2b: list[float], ours: list[float], tail: float) -> JSON:
    """A row pair with its ratios (E2B / ours) at p50 and at `tail`."""
    name = f"p{round(tail * 100)}"
    e50, o50 = statistics.median(e2b), statistics.median(ours)
    etail, otail = percentile(e2b, tail), percentile(ours, tail)
    unit, scale = ("s", 1.0) if o50 > 1 else ("ms", 1000.0)
    for who, p50, ptail in (("E2B SDK", e50, etail), ("our SDK", o50, otail)):
        print(
            f"  {label + ', ' + who:<44} p50 {p50 * scale:8.1f} {unit}"
            f"   {name} {ptail * scale:8.1f} {unit}"
        )
    ratio50, ratio_tail = e50 / o50, etail / otail
    print(f"  {'':<44} E2B / ours: p50 {ratio50:.2f}x, {name} {ratio_tail:.2f}x (target <= 1.2x)")
    return {
        "count": len(e2b),
        "e2b_p50_s": e50,
        f"e2b_{name}_s": etail,
        "ours_p50_s": o50,
        f"ours_{name}_s": otail,
        "ratio_p50": ratio50,
        f"ratio_{name}": ratio_tail,
    }


# -- the cluster side --------------------------------------------------------------------


def gateway_urls(kube: KubeJSON) -> tuple[str, str]:
    """(ours, E2B's): the gateway Service's ClusterIP at its ports `http` and `e2b`."""
    service = kube.read(core_path("services", deploy.NAMESPACE, f"{deploy.RELEASE}-gateway"))
    ports = {p.get("name"): p["port"] for p in service["spec"]["ports"]}
    if "e2b" not in ports:
        raise SystemExit("the gateway Service has no port e2b: install with gateway.e2b.enabled")
    address = service["spec"]["clusterIP"]
    return f"http://{address}:{ports['http']}", f"http://{address}:{ports['e2b']}"


def user_account(kube: KubeJSON, ns: str, name: str) -> None:
    """A ServiceAccount bound in `ns` to the chart's user role."""
    rbac = "rbac.authorization.k8s.io/v1"
    kube.create(core_path("serviceaccounts", ns), {"metadata": {"name": name}})
    kube.create(
        api_path(rbac, "rolebindings", ns),
        {
            "metadata": {"name": name},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": f"{deploy.RELEASE}-user",
            },
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
        },
    )


def account_token(kube: KubeJSON, ns: str, name: str) -> str:
    issued = kube.create(
        core_path("serviceaccounts", ns, name, "token"), {"spec": {"expirationSeconds": 7200}}
    )
    return str(issued["status"]["token"])


def token_kubeconfig(admin: Path, token: str, target: Path) -> None:
    """`admin` with its user swapped for `token`: our SDK's lifecycle calls (create,
    delete) go to the API server as the same ServiceAccount as everything else."""
    config: dict[str, Any] = yaml.safe_load(admin.read_text())
    for user in config["users"]:
        user["user"] = {"token": token}
    target.write_text(yaml.safe_dump(config))


def pools_of(ns: str) -> dict[str, str]:
    """template name -> SandboxPool name, as examples/pool-e2b.yaml has them."""
    found: dict[str, str] = {}
    for doc in yaml.safe_load_all(POOLS.read_text()):
        if doc and doc.get("kind") == "SandboxPool":
            found[doc["spec"]["templateRef"]["name"]] = doc["metadata"]["name"]
    return found


def create_pools(kube: KubeJSON, ns: str) -> None:
    for doc in yaml.safe_load_all(POOLS.read_text()):
        if doc and doc.get("kind") == "SandboxPool":
            kube.create(api_path(GROUP, "sandboxpools", ns), doc)


def pool_full(kube: KubeJSON, ns: str, name: str) -> bool:
    pool = kube.get(api_path(GROUP, "sandboxpools", ns, name)) or {}
    wanted = (pool.get("spec") or {}).get("replicas", 1)
    return bool(((pool.get("status") or {}).get("ready") or 0) >= wanted)


def settle(kube: KubeJSON, ns: str, pools: list[str], gone: list[str]) -> None:
    """Until every pool is full and the sandboxes `gone` names no longer exist."""
    wait_until(
        lambda: (
            all(pool_full(kube, ns, p) for p in pools)
            and all(kube.get(api_path(GROUP, "sandboxes", ns, n)) is None for n in gone)
        ),
        timeout=600,
    )


# -- the measurements ----------------------------------------------------------------------


@dataclass
class Meters:
    """CPU seconds used so far by the gateway's pods and the sandbox's pod (their
    cgroups: every process, short-lived ones included) and by this process (the
    SDKs' own work)."""

    cluster: LocalCluster
    gateway_pods: list[str]
    sandbox_pod: str

    def read(self) -> dict[str, float]:
        def pod(uid: str) -> float:
            usage = self.cluster.pod_cgroup("cpuacct", uid) / "cpuacct.usage"
            return int(usage.read_text()) / 1e9

        return {
            "gateway": sum(pod(uid) for uid in self.gateway_pods),
            "sandbox pod": pod(self.sandbox_pod),
            "client": time.process_time(),
        }


def meters(cluster: LocalCluster, kube: KubeJSON, ns: str, name: str) -> Meters:
    gateways = kube.list(
        core_path("pods", deploy.NAMESPACE), label_selector="app.kubernetes.io/name=sandbox-gateway"
    )
    body = kube.read(api_path(GROUP, "sandboxes", ns, name))
    pod = kube.read(core_path("pods", ns, body["status"]["podName"]))
    return Meters(cluster, [p["metadata"]["uid"] for p in gateways], pod["metadata"]["uid"])


def cpu_per_call(label: str, meter: Meters, e2b: Call, ours: Call, count: int) -> JSON:
    """CPU milliseconds per call of each path, `count` calls of one then of the other."""
    found: JSON = {}
    for who, call in (("E2B SDK", e2b), ("our SDK", ours)):
        before = meter.read()
        for _ in range(count):
            call()
        after = meter.read()
        found[who] = {k: (after[k] - before[k]) * 1000 / count for k in before}
    parts = ", ".join(
        f"{k} {found['E2B SDK'][k]:.2f} / {found['our SDK'][k]:.2f}" for k in found["E2B SDK"]
    )
    print(f"  {label + ', CPU ms per call, E2B / ours:':<44} {parts}")
    return found


def same_sandbox(
    cluster: LocalCluster,
    kube: KubeJSON,
    ns: str,
    e2b_opts: JSON,
    client: SandboxClient,
    args: argparse.Namespace,
) -> JSON:
    """Commands, files and code on one sandbox, through both SDKs."""
    from e2b_code_interpreter import Sandbox as CodeInterpreter  # type: ignore[import-untyped]

    results: JSON = {}
    sbx = CodeInterpreter.create(timeout=3600, **e2b_opts)
    try:
        ours: OurSandbox = client.connect(sbx.sandbox_id)
        meter = meters(cluster, kube, ns, sbx.sandbox_id)
        print(f"sandbox {sbx.sandbox_id} (code-interpreter-v1, made by E2B's SDK)")

        def e2b_true() -> None:
            assert sbx.commands.run("true").exit_code == 0

        def our_true() -> None:
            assert ours.execute(TRUE_ARGV).exit_code == 0

        print(f'commands.run("true") / execute, {args.runs} each, interleaved')
        results["command"] = compare("true", *interleaved(e2b_true, our_true, args.runs), 0.99)
        results["command"]["cpu_ms"] = cpu_per_call(
            "true", meter, e2b_true, our_true, args.cpu_runs
        )

        data = os.urandom(MIB)

        def e2b_write() -> None:
            sbx.files.write("/home/user/e2b-bench.bin", data)

        def our_write() -> None:
            ours.files.write("our-bench.bin", data)

        print(f"files.write of 1 MiB, {args.file_runs} each, interleaved")
        results["write_1mib"] = compare(
            "1 MiB", *interleaved(e2b_write, our_write, args.file_runs), 0.99
        )
        results["write_1mib"]["cpu_ms"] = cpu_per_call(
            "1 MiB", meter, e2b_write, our_write, args.cpu_runs
        )
        assert ours.files.read_bytes("e2b-bench.bin") == data

        began = time.perf_counter()
        assert sbx.run_code("x = 1").error is None
        results["kernel_start_s"] = time.perf_counter() - began

        def e2b_code() -> None:
            assert sbx.run_code("x+1").text == "2"

        def our_code() -> None:
            assert ours.run_code("x+1").text == "2"

        print(f'run_code("x+1"), {args.code_runs} each, interleaved (kernel start:'
              f' {results["kernel_start_s"] * 1000:.0f} ms)')  # fmt: skip
        results["run_code"] = compare("x+1", *interleaved(e2b_code, our_code, args.code_runs), 0.99)
        results["run_code"]["cpu_ms"] = cpu_per_call(
            "x+1", meter, e2b_code, our_code, args.cpu_runs
        )
    finally:
        sbx.kill()
    return results


def outcome(kube: KubeJSON, ns: str, name: str) -> str:
    """What the Sandbox got from its pool: Claimed (a warm member) or ColdStart."""
    body = kube.get(api_path(GROUP, "sandboxes", ns, name)) or {}
    return str(((body.get("status") or {}).get("pool") or {}).get("outcome"))


def creates(
    kube: KubeJSON, ns: str, e2b_opts: JSON, client: SandboxClient, count: int
) -> dict[str, JSON]:
    """create -> usable from each warm pool, E2B's SDK and ours in turn."""
    from e2b import Sandbox as E2BSandbox

    pools = pools_of(ns)
    results: dict[str, JSON] = {}
    for template, pool in pools.items():
        e2b_times: list[float] = []
        e2b_created: list[float] = []
        our_times: list[float] = []
        our_created: list[float] = []
        claims: collections.Counter[str] = collections.Counter()
        for _ in range(count):
            settle(kube, ns, list(pools.values()), [])
            began = time.perf_counter()
            sbx = E2BSandbox.create(template, timeout=600, **e2b_opts)
            e2b_created.append(time.perf_counter() - began)
            assert sbx.commands.run("true").exit_code == 0
            e2b_times.append(time.perf_counter() - began)
            claims[f"E2B {outcome(kube, ns, sbx.sandbox_id)}"] += 1
            sbx.kill()
            settle(kube, ns, list(pools.values()), [sbx.sandbox_id])

            began = time.perf_counter()
            box = client.create(pool=pool)
            our_created.append(time.perf_counter() - began)
            assert box.execute(TRUE_ARGV).exit_code == 0
            our_times.append(time.perf_counter() - began)
            claims[f"ours {outcome(kube, ns, box.name)}"] += 1
            box.destroy(wait=False)
            settle(kube, ns, list(pools.values()), [box.name])
        print(
            f"create -> usable from the {pool} pool (template {template}), {count} each"
            f" ({', '.join(f'{k}: {v}' for k, v in sorted(claims.items()))})"
        )
        row = compare(template, e2b_times, our_times, 0.9)
        e2b_p50, our_p50 = statistics.median(e2b_created), statistics.median(our_created)
        print(
            f"  {'':<44} of which create() returned: E2B p50 {e2b_p50 * 1000:.1f} ms,"
            f" ours {our_p50 * 1000:.1f} ms"
        )
        row |= {"e2b_create_p50_s": e2b_p50, "ours_create_p50_s": our_p50, "outcomes": claims}
        results[template] = row
    return results


def run(
    cluster: LocalCluster, kube: KubeJSON, ns: str, account: str, args: argparse.Namespace
) -> JSON:
    ours_url, e2b_url = gateway_urls(kube)
    ours_url, e2b_url = args.gateway_url or ours_url, args.e2b_url or e2b_url
    token = account_token(kube, ns, account)
    e2b_opts: JSON = {"api_key": token, "api_url": e2b_url, "sandbox_url": e2b_url}
    results: JSON = {"gateway": ours_url, "e2b_listener": e2b_url}
    with tempfile.TemporaryDirectory() as scratch:
        kubeconfig = Path(scratch) / "user.kubeconfig"
        token_kubeconfig(cluster.kubeconfig, token, kubeconfig)
        with SandboxClient(
            ns, kubeconfig=kubeconfig, gateway_url=ours_url, gateway_token=token
        ) as client:
            results["same_sandbox"] = same_sandbox(cluster, kube, ns, e2b_opts, client, args)
            if args.creates:
                results["create"] = creates(kube, ns, e2b_opts, client, args.creates)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--file-runs", type=int, default=60)
    parser.add_argument("--code-runs", type=int, default=200)
    parser.add_argument("--cpu-runs", type=int, default=100)
    parser.add_argument("--creates", type=int, default=10)
    parser.add_argument(
        "--cluster",
        help=f"a running cluster's name (`make up`'s: local): namespace {LOCAL_NS},"
        f" ServiceAccount {LOCAL_ACCOUNT} and its pools; default: a new cluster",
    )
    parser.add_argument(
        "--gateway-url",
        help="with --cluster: a gateway's main listener instead of the Service's port http"
        " (e.g. a gateway process run from a checkout, to profile it)",
    )
    parser.add_argument("--e2b-url", help="with --cluster: that gateway's E2B listener")
    args = parser.parse_args()
    if (args.gateway_url or args.e2b_url) and not args.cluster:
        parser.error("--gateway-url and --e2b-url go with --cluster")
    results: JSON = {"load": os.getloadavg()}
    if args.cluster:
        cluster = deploy.node_cluster(args.cluster)
        kube = KubeJSON(cluster.kubeconfig)
        results |= run(cluster, kube, LOCAL_NS, LOCAL_ACCOUNT, args)
        kube.close()
    else:
        with operator_cluster(f"bench-e2b-{os.getpid()}", ["gateway.e2b.enabled=true"]) as cluster:
            kube = KubeJSON(cluster.kubeconfig)
            create_namespace(kube, NS, deploy.POD_SECURITY_RESTRICTED)
            user_account(kube, NS, ACCOUNT)
            create_pools(kube, NS)
            settle(kube, NS, list(pools_of(NS).values()), [])
            results |= run(cluster, kube, NS, ACCOUNT, args)
            kube.close()
    results["load_after"] = os.getloadavg()
    write_results("e2b_bench", results)


if __name__ == "__main__":
    main()
