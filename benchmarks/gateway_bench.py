#!/usr/bin/env python3
"""sandbox-gateway against calling the sandbox agent directly, side by side.

    python benchmarks/gateway_bench.py [--iterations 300] [--sandboxes 1000]

One run on loopback: a private control plane with an audit log of the
gateway's requests, the CRDs, the operator and the gateway as processes under
the chart's RBAC rules, one Sandbox whose pod is played by this script (pod
status written as a kubelet would, a real agent and runner on a loopback
address as the pod IP), and a caller ServiceAccount bound to the chart's user
role. Then, interleaved sample by sample (direct, gateway, gateway, direct,
...), with stdlib `http.client`, one keep-alive connection per thread, every
JSON answer parsed:

- `true` (POST executions {"argv": ["true"]}) and 1 MiB of output, sequential:
  p50/p99;
- the same with 10 threads: requests/s over a fixed count;
- a 100 MiB file in the agent's workspace, downloaded with GET files/content;
- `true` while the same gateway streams a 1 GiB download to another reader,
  against `true` with nothing beside it (blocks: quiet, busy, quiet);
- the API requests the gateway's ServiceAccount made while the measured calls
  ran (caches warmed first), from the API server's audit log;
- the gateway's RSS once `--sandboxes` more Sandboxes are in its route table
  (created through the API; the operator makes their agent-token Secrets and
  pods, as in a cluster; their pods stay Pending, as nothing plays them).

Targets: <= 1 ms added at p50 for `true`, <= 2 ms for 1 MiB; >= 70 % of the
direct 10-way throughput; `true` beside the download <= 2x its quiet
latency through the gateway; no API request per proxied call once warm; gateway
RSS <= 150 MB with 1,000 Sandboxes. A missed target is reported, not an error.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.agent_bench import concurrent  # noqa: E402
from benchmarks.common import (  # noqa: E402
    audit_flags,
    audit_requests,
    percentile,
    process_cpu,
    write_results,
)
from benchmarks.sandbox_scale import NAMESPACE, create_all  # noqa: E402
from devcluster.controlplane import ControlPlane  # noqa: E402
from devcluster.helm import helm_binary  # noqa: E402
from sandbox_operator.gateway.config import GatewaySettings  # noqa: E402
from sandbox_operator.resources import LABEL_MANAGED_BY, MANAGED_BY, SANDBOXES, SECRETS  # noqa: E402
from tests.integration.conftest import RELEASE, kubectl  # noqa: E402
from tests.integration.harness import (  # noqa: E402
    OPERATOR_NAMESPACE,
    AgentProcess,
    GatewayProcess,
    Node,
    OperatorProcess,
    gateway_credentials,
    next_pod_ip,
    operator_credentials,
    secret_token,
    wait_for,
)
from tests.integration.test_gateway import caller  # noqa: E402
from tests.kube import JSON, KubeJSON, core_path  # noqa: E402
from tests.sandboxes import Sandboxes  # noqa: E402

MiB = 1 << 20
GATEWAY_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:sandbox-gateway"
SANDBOX = "box"
TRUE = json.dumps({"argv": ["true"]}).encode()
ONE_MIB = json.dumps({"argv": ["sh", "-c", f"head -c {MiB} /dev/zero | tr '\\0' x"]}).encode()


class Client:
    """One keep-alive connection to the agent (direct) or to the gateway (`prefix`
    names the sandbox); not thread-safe: one per thread."""

    def __init__(self, host: str, port: int, token: str, prefix: str = "") -> None:
        self.conn = http.client.HTTPConnection(host, port, timeout=120, blocksize=MiB)
        self.auth = f"Bearer {token}"
        self.base = prefix or "/v1"
        self.buffer = bytearray(4 * MiB)

    def exec(self, body: bytes) -> JSON:
        self.conn.request(
            "POST",
            f"{self.base}/executions",
            body=body,
            headers={"Authorization": self.auth, "Content-Type": "application/json"},
        )
        response = self.conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"exec: {response.status} {data[:300]!r}")
        result: JSON = json.loads(data)
        if result.get("exitCode") != 0:
            raise RuntimeError(f"exec: {str(result)[:300]}")
        return result

    def download(self, path: str) -> int:
        """GET files/content of `path`; the bytes received (read and dropped)."""
        self.conn.request(
            "GET", f"{self.base}/files/content?path={path}", headers={"Authorization": self.auth}
        )
        response = self.conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"download: {response.status} {response.read()[:300]!r}")
        view, total = memoryview(self.buffer), 0
        while count := response.readinto(view):
            total += count
        return total

    def close(self) -> None:
        self.conn.close()


class Setup:
    """Everything the measurements need; `close()` stops what was started."""

    def __init__(self, work: Path) -> None:
        self.work = work
        flags, self.audit_log = audit_flags(work, [GATEWAY_USER])
        self.cp = ControlPlane(f"gwbench-{os.getpid()}", die_with_parent=True, apiserver_args=flags)
        self.operator: OperatorProcess | None = None
        self.gateway: GatewayProcess | None = None
        self.agent: AgentProcess | None = None
        self.kube: KubeJSON | None = None

    def start(self) -> None:
        self.cp.start()
        self.kube = kube = KubeJSON(self.cp.kubeconfig)
        applied = kubectl(self.cp, "apply", "-f", str(REPO / "crds"))
        assert applied.returncode == 0, applied.stderr
        established = kubectl(
            self.cp,
            "wait",
            "--for=condition=Established",
            "crd",
            "-l",
            "app.kubernetes.io/part-of=sandbox-operator",
            "--timeout=60s",
        )
        assert established.returncode == 0, established.stderr
        # The chart's user and viewer roles, as the chart renders them.
        rendered = subprocess.run(
            [
                str(helm_binary()),
                "template",
                RELEASE,
                str(REPO / "charts/sandbox-operator"),
                "-n",
                OPERATOR_NAMESPACE,
                "--show-only",
                "templates/access.yaml",
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        applied = kubectl(self.cp, "apply", "-f", "-", input=rendered)
        assert applied.returncode == 0, applied.stderr
        operator_config = operator_credentials(self.cp, kube, REPO, self.work / "operator.conf")
        gateway_config = gateway_credentials(self.cp, kube, REPO, self.work / "gateway.conf")
        kube.create(core_path("namespaces"), {"metadata": {"name": NAMESPACE}})
        wait_for(
            lambda: kube.get(core_path("serviceaccounts", NAMESPACE, "default")),
            60,
            "the namespace's default ServiceAccount",
        )
        # Operator and gateway with their default settings (the chart's).
        self.operator = OperatorProcess(operator_config, self.work, {})
        self.operator.start()
        self.gateway = GatewayProcess(gateway_config, self.work / "gateway")
        self.gateway.start()
        self.caller_token = caller(kube, NAMESPACE, "bench-user", "user")
        # The sandbox, its pod played with a real agent and runner.
        sandboxes = Sandboxes(kube, NAMESPACE)
        sandboxes.create(SANDBOX, {"runtime": "python"})
        wait_for(lambda: kube.get(core_path("pods", NAMESPACE, SANDBOX)), 60, "the pod")
        self.agent_token = secret_token(kube, NAMESPACE, SANDBOX)
        self.agent = AgentProcess(self.work / "agent", next_pod_ip(), 8080, self.agent_token)
        self.agent.start()
        Node(kube).run_pod(NAMESPACE, SANDBOX, self.agent.ip)
        sandboxes.wait_phase(SANDBOX, "Running", timeout=60)
        wait_for(self._served, 60, "the sandbox to be served through the gateway")

    def _served(self) -> bool:
        try:
            self.via_gateway().exec(TRUE)
            return True
        except (RuntimeError, OSError):
            return False

    @property
    def gateway_pid(self) -> int:
        assert self.gateway is not None
        assert self.gateway.proc is not None
        return self.gateway.proc.pid

    def direct(self) -> Client:
        assert self.agent is not None
        return Client(self.agent.ip, self.agent.port, self.agent_token)

    def via_gateway(self) -> Client:
        assert self.gateway is not None
        prefix = f"/v1/namespaces/{NAMESPACE}/sandboxes/{SANDBOX}"
        return Client("127.0.0.1", self.gateway.port, self.caller_token, prefix)

    def readyz(self) -> JSON:
        assert self.gateway is not None
        with urllib.request.urlopen(f"{self.gateway.url}/readyz", timeout=10) as response:
            answer: JSON = json.loads(response.read())
            return answer

    def close(self) -> None:
        for process in (self.gateway, self.operator, self.agent):
            if process is not None:
                process.stop()
        if self.kube is not None:
            self.kube.close()
        self.cp.stop(remove_state=True)


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def interleaved(
    direct: Callable[[], object], gateway: Callable[[], object], n: int
) -> tuple[list[float], list[float]]:
    """`n` samples of each, alternating which goes first."""
    d: list[float] = []
    g: list[float] = []
    for i in range(n):
        order = ((direct, d), (gateway, g)) if i % 2 == 0 else ((gateway, g), (direct, d))
        for call, samples in order:
            started = time.perf_counter()
            call()
            samples.append(time.perf_counter() - started)
    return d, g


Row = tuple[str, str, str, str, str]


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


class Bench:
    """The measurements, in order; each adds table rows, notes and results."""

    def __init__(self, setup: Setup, args: argparse.Namespace) -> None:
        self.setup = setup
        self.args = args
        self.pid = setup.gateway_pid
        self.rows: list[Row] = []
        self.notes: list[str] = []
        self.results: dict[str, Any] = {}
        # The measured windows (name, start, end, calls through the gateway), for
        # reading the audit log per window.
        self.windows: list[tuple[str, float, float, int]] = []

    def sequential(self, name: str, body: bytes, target_ms: float) -> None:
        direct, gateway = self.setup.direct(), self.setup.via_gateway()
        expected = 0 if body is TRUE else MiB
        for client in (direct, gateway):
            assert len(client.exec(body)["stdout"]) == expected
        n = self.args.iterations
        # Warm both paths and the gateway's caches.
        interleaved(lambda: direct.exec(body), lambda: gateway.exec(body), max(10, n // 10))
        started, cpu0 = time.time(), process_cpu(self.pid)
        d, g = interleaved(lambda: direct.exec(body), lambda: gateway.exec(body), n)
        gateway_cpu = (process_cpu(self.pid) - cpu0) / n
        self.windows.append((f"{name}, sequential", started, time.time(), n))
        direct.close()
        gateway.close()
        d50, g50 = statistics.median(d) * 1e3, statistics.median(g) * 1e3
        d99, g99 = percentile(d, 0.99) * 1e3, percentile(g, 0.99) * 1e3
        added = g50 - d50
        self.rows.append(
            (
                f"{name}, sequential x {n}",
                f"p50 {d50:.2f} ms, p99 {d99:.2f} ms",
                f"p50 {g50:.2f} ms, p99 {g99:.2f} ms",
                f"+{added:.2f} ms p50, +{g99 - d99:.2f} ms p99",
                f"<= +{target_ms:g} ms p50: {verdict(added <= target_ms)}",
            )
        )
        self.notes.append(f"{name}: gateway CPU {gateway_cpu * 1e3:.2f} ms per call")
        self.results[f"{name}_sequential"] = {
            "direct_p50_ms": d50, "direct_p99_ms": d99,
            "gateway_p50_ms": g50, "gateway_p99_ms": g99,
            "added_p50_ms": added, "added_p99_ms": g99 - d99,
            "gateway_cpu_ms_per_call": gateway_cpu * 1e3,
            "target_added_p50_ms": target_ms, "met": added <= target_ms,
        }  # fmt: skip

    def throughput(self, name: str, body: bytes, per: int) -> None:
        def make_direct() -> Callable[[], object]:
            client = self.setup.direct()
            return lambda: client.exec(body)

        def make_gateway() -> Callable[[], object]:
            client = self.setup.via_gateway()
            return lambda: client.exec(body)

        direct_rps: list[float] = []
        gateway_rps: list[float] = []
        started, cpu0, calls = time.time(), process_cpu(self.pid), 0
        for i in range(self.args.rounds):
            if i % 2 == 0:
                direct_rps.append(concurrent(make_direct, 10, per))
                gateway_rps.append(concurrent(make_gateway, 10, per))
            else:
                gateway_rps.append(concurrent(make_gateway, 10, per))
                direct_rps.append(concurrent(make_direct, 10, per))
            calls += 10 * (per + 1)  # each worker warms its connection with one call
        gateway_cpu = (process_cpu(self.pid) - cpu0) / calls
        self.windows.append((f"{name}, 10-way", started, time.time(), calls))
        d_rps, g_rps = statistics.median(direct_rps), statistics.median(gateway_rps)
        ratio = g_rps / d_rps
        self.rows.append(
            (
                f"{name}, 10 threads x {per}",
                f"{d_rps:.0f} req/s",
                f"{g_rps:.0f} req/s",
                f"{ratio:.0%} of direct",
                f">= 70%: {verdict(ratio >= 0.7)}",
            )
        )
        self.notes.append(f"{name}, 10-way: gateway CPU {gateway_cpu * 1e3:.2f} ms per call")
        self.results[f"{name}_10way"] = {
            "direct_rps": d_rps, "gateway_rps": g_rps, "ratio": ratio,
            "direct_rounds": direct_rps, "gateway_rounds": gateway_rps,
            "gateway_cpu_ms_per_call": gateway_cpu * 1e3, "met": ratio >= 0.7,
        }  # fmt: skip

    def download(self) -> None:
        assert self.setup.agent is not None
        mib, reps = self.args.file_mib, self.args.file_reps
        size = mib * MiB
        with (self.setup.agent.workspace / "download.bin").open("wb") as out:
            for _ in range(mib):
                out.write(os.urandom(MiB))
        direct, gateway = self.setup.direct(), self.setup.via_gateway()
        for client in (direct, gateway):  # warm: page cache, connections, caches
            assert client.download("download.bin") == size
        started, cpu0 = time.time(), process_cpu(self.pid)
        d, g = interleaved(
            lambda: direct.download("download.bin"), lambda: gateway.download("download.bin"), reps
        )
        gateway_cpu = (process_cpu(self.pid) - cpu0) / reps
        self.windows.append(("download", started, time.time(), reps))
        direct.close()
        gateway.close()
        d_mbs, g_mbs = size / statistics.median(d) / 1e6, size / statistics.median(g) / 1e6
        self.rows.append(
            (
                f"download {mib} MiB x {reps}",
                f"{d_mbs:.0f} MB/s",
                f"{g_mbs:.0f} MB/s",
                f"{g_mbs / d_mbs:.0%} of direct",
                "(none)",
            )
        )
        self.notes.append(f"download: gateway CPU {gateway_cpu * 1e3:.0f} ms per {mib} MiB")
        self.results["download"] = {
            "bytes": size, "direct_mb_s": d_mbs, "gateway_mb_s": g_mbs,
            "ratio": g_mbs / d_mbs, "gateway_cpu_s_per_download": gateway_cpu,
        }  # fmt: skip

    def beside_download(self) -> None:
        """`true`, direct and through the gateway, with nothing else going on and
        while the same gateway replica streams a download of `--bulk-mib` to a
        reader that takes it as fast as it comes; in blocks (quiet, busy, quiet)
        of the same run."""
        assert self.setup.agent is not None
        size = self.args.bulk_mib * MiB
        with (self.setup.agent.workspace / "bulk.bin").open("wb") as out:
            out.truncate(size)  # sparse: read from memory, as a cached file is
        direct, gateway = self.setup.direct(), self.setup.via_gateway()
        n = max(20, self.args.iterations // 2)
        interleaved(lambda: direct.exec(TRUE), lambda: gateway.exec(TRUE), 10)  # warm
        quiet_d, quiet_g = interleaved(lambda: direct.exec(TRUE), lambda: gateway.exec(TRUE), n)

        stop, moved = threading.Event(), [0, 0.0]

        def downloads() -> None:
            reader = self.setup.via_gateway()
            started = time.perf_counter()
            while not stop.is_set():
                moved[0] += reader.download("bulk.bin")
            moved[1] = time.perf_counter() - started
            reader.close()

        thread = threading.Thread(target=downloads, daemon=True)
        thread.start()
        time.sleep(0.5)  # the download is flowing
        busy_d, busy_g = interleaved(lambda: direct.exec(TRUE), lambda: gateway.exec(TRUE), 2 * n)
        stop.set()
        thread.join()
        more_d, more_g = interleaved(lambda: direct.exec(TRUE), lambda: gateway.exec(TRUE), n)
        direct.close()
        gateway.close()
        quiet_d += more_d
        quiet_g += more_g
        qd, qg = statistics.median(quiet_d) * 1e3, statistics.median(quiet_g) * 1e3
        bd, bg = statistics.median(busy_d) * 1e3, statistics.median(busy_g) * 1e3
        ratio = bg / qg
        rate = moved[0] / moved[1] / 1e6 if moved[1] else 0.0
        self.rows.append(
            (
                f"true beside a {self.args.bulk_mib} MiB download x {2 * n}",
                f"p50 {qd:.2f} -> {bd:.2f} ms ({bd / qd:.1f}x)",
                f"p50 {qg:.2f} -> {bg:.2f} ms ({ratio:.1f}x)",
                f"download {rate:.0f} MB/s meanwhile",
                f"<= 2x quiet: {verdict(ratio <= 2.0)}",
            )
        )
        self.results["true_beside_download"] = {
            "bulk_bytes": size, "samples": 2 * n,
            "direct_quiet_p50_ms": qd, "direct_busy_p50_ms": bd,
            "gateway_quiet_p50_ms": qg, "gateway_busy_p50_ms": bg,
            "gateway_busy_p99_ms": percentile(busy_g, 0.99) * 1e3,
            "ratio": ratio, "download_mb_s": rate, "met": ratio <= 2.0,
        }  # fmt: skip

    def api_requests(self) -> None:
        """What the gateway asked the API server while the measured calls ran."""
        time.sleep(2)  # the audit backend writes behind
        phases: dict[str, Any] = {}
        requests = calls = 0
        defaults = GatewaySettings()
        # Reviews in use are refreshed in the background at three quarters of
        # their life, whatever the call rate: the most a window can hold is its
        # length over those periods (one caller, one operation per window here).
        refresh_bound = 0
        for name, since, until, count in self.windows:
            refresh_bound += math.ceil((until - since) / (0.75 * defaults.access_review_seconds))
            refresh_bound += math.ceil((until - since) / (0.75 * defaults.token_review_seconds))
            found = audit_requests(self.setup.audit_log, GATEWAY_USER, since, until)
            requests += sum(found.values())
            calls += count
            phases[name] = {"calls": count, "requests": dict(found), "seconds": until - since}
            self.notes.append(
                f"API requests during {name} ({until - since:.1f} s, {count} calls): "
                f"{dict(found) or 'none'}"
            )
        # The log does see the gateway: its cold calls (and watches) are in it.
        everything = audit_requests(self.setup.audit_log, GATEWAY_USER, 0, time.time())
        if not everything["create tokenreviews"] or not everything["create subjectaccessreviews"]:
            raise SystemExit(f"the audit log misses the gateway's reviews: {dict(everything)}")
        self.notes.append(f"API requests by the gateway over the whole run: {dict(everything)}")
        self.notes.append(
            f"the gateway trusts a SubjectAccessReview {defaults.access_review_seconds:g} s and a "
            f"TokenReview {defaults.token_review_seconds:g} s (its defaults, used here) and asks "
            "again in the background at three quarters of that, per caller, sandbox and "
            f"operation: at most {refresh_bound} such refreshes fit these windows"
        )
        self.rows.append(
            (
                "API requests by the gateway, warm",
                "-",
                f"{requests} in {calls} calls (refreshes)",
                f"{requests / calls:.4f} per call",
                f"none per call: {verdict(requests <= refresh_bound)}",
            )
        )
        self.results["api_requests"] = {
            "per_phase": phases,
            "total": requests,
            "calls": calls,
            "per_call": requests / calls,
        }

    def rss(self) -> None:
        """The gateway's RSS once `--sandboxes` more Sandboxes are in its route table."""
        setup, kube = self.setup, self.setup.kube
        assert kube is not None
        rss_one = status_kib(self.pid, "VmRSS") / 1024
        started = time.monotonic()
        asyncio.run(create_all(setup.cp.kubeconfig, self.args.sandboxes, 20))
        wanted = self.args.sandboxes + 1
        wait_for(
            lambda: setup.readyz()["routes"] >= wanted,
            self.args.timeout,
            f"{wanted} routes in the gateway",
            interval=0.5,
        )
        routes_after = time.monotonic() - started

        def settled() -> tuple[int, int]:
            secrets = kube.list(
                SECRETS.path(NAMESPACE), label_selector=f"{LABEL_MANAGED_BY}={MANAGED_BY}"
            )
            sandboxes = kube.list(SANDBOXES.path(NAMESPACE))
            return len(secrets), sum(1 for s in sandboxes if (s.get("status") or {}).get("podName"))

        try:
            wait_for(
                lambda: min(settled()) >= wanted,
                self.args.timeout,
                "the operator's Secrets and statuses",
                interval=1.0,
            )
        except AssertionError as exc:
            self.notes.append(f"RSS read before the operator was done: {exc}")
        secrets, statuses = settled()
        time.sleep(3)  # the last watch events applied
        routes = int(setup.readyz()["routes"])
        rss = status_kib(self.pid, "VmRSS") / 1024
        peak = status_kib(self.pid, "VmHWM") / 1024
        rss_mb = rss * MiB / 1e6
        self.rows.append(
            (
                f"gateway RSS, {routes} routes",
                "-",
                f"{rss:.1f} MiB = {rss_mb:.1f} MB (peak {peak:.1f} MiB)",
                f"{rss_one:.1f} MiB with 1 route",
                f"<= 150 MB: {verdict(rss_mb <= 150)}",
            )
        )
        self.notes.append(
            f"RSS: {self.args.sandboxes} Sandboxes created through the API (20 in flight); "
            f"the operator made {secrets} agent-token Secrets and {statuses} pods and statuses; "
            f"the gateway had {wanted} routes {routes_after:.1f} s after the first create"
        )
        self.results["rss"] = {
            "routes": routes, "secrets": secrets, "statuses": statuses,
            "rss_mib": rss, "rss_mb": rss_mb, "peak_mib": peak, "rss_one_route_mib": rss_one,
            "met": rss_mb <= 150,
        }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=300, help="sequential samples each")
    parser.add_argument("--sandboxes", type=int, default=1000, help="for the RSS measurement")
    parser.add_argument("--per-thread", type=int, default=100, help="requests per thread, 10-way")
    parser.add_argument("--rounds", type=int, default=3, help="10-way rounds each (median)")
    parser.add_argument("--file-mib", type=int, default=100)
    parser.add_argument("--file-reps", type=int, default=5)
    parser.add_argument("--bulk-mib", type=int, default=1024, help="the download beside `true`")
    parser.add_argument("--timeout", type=float, default=600, help="for the Sandboxes to settle")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    setup = Setup(work)
    loadavg_before = os.getloadavg()
    try:
        setup.start()
        bench = Bench(setup, args)
        bench.sequential("true", TRUE, 1.0)
        bench.sequential("1 MiB output", ONE_MIB, 2.0)
        bench.throughput("true", TRUE, args.per_thread)
        bench.throughput("1 MiB output", ONE_MIB, max(10, args.per_thread // 4))
        bench.download()
        bench.beside_download()
        bench.api_requests()
        bench.rss()
        assert setup.gateway is not None
        tracebacks = len(setup.gateway.errors())
    finally:
        setup.close()
        shutil.rmtree(work, ignore_errors=True)
    loadavg_after = os.getloadavg()

    head = ("case", "direct to the agent", "through the gateway", "gateway vs direct", "target")
    widths = [max(len(r[i]) for r in [head, *bench.rows]) for i in range(5)]
    print()
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for row in bench.rows:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    print()
    for note in bench.notes:
        print(note)
    print(f"handler tracebacks in the gateway log: {tracebacks}")
    print(f"load average before/after: {loadavg_before} / {loadavg_after}")
    write_results(
        "gateway_bench",
        {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "loadavg_before": loadavg_before,
            "loadavg_after": loadavg_after,
            "iterations": args.iterations,
            "gateway_tracebacks": tracebacks,
            **bench.results,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
