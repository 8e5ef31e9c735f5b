#!/usr/bin/env python3
"""Sandbox agent benchmark: agent + runner round trips against the local floor.

Starts a real agent and a real runner (temp dirs, loopback port), then
measures side by side on this machine:

- exec round trip through agent+runner vs a direct ``subprocess.run`` of the
  same argv (the floor), for ``true`` and for a command printing 1 MiB,
  sequentially (p50/p99 latency) and 10-way concurrent (throughput);
- writing and reading a 100 MiB file through the agent vs a plain local
  copy (``shutil.copyfile``).

The client is stdlib ``http.client`` with one keep-alive connection per
thread and parses every JSON result (as a real client would).

    .venv/bin/python benchmarks/agent_bench.py [--iterations N] [--json]

Targets: overhead over the floor <= 1.5 ms (p50, true) and <= 3 ms (1 MiB);
10-way throughput >= 45% of the floor's; file throughput >= 50% of the copy.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_results

MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


class Agent:
    """A real agent + runner pair in a temporary directory."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="agent-bench-"))
        self.workspace = self.dir / "ws"
        self.workspace.mkdir()
        (self.dir / "run").mkdir()
        self.token = secrets.token_urlsafe(32)
        (self.dir / "token").write_text(self.token)
        self.port = _free_port()
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "SANDBOX_AGENT_HOST": "127.0.0.1",
            "SANDBOX_AGENT_PORT": str(self.port),
            "SANDBOX_AGENT_TOKEN_FILE": str(self.dir / "token"),
            "SANDBOX_AGENT_WORKSPACE": str(self.workspace),
            "SANDBOX_AGENT_RUNTIME_DIR": str(self.dir / "run"),
            "SANDBOX_AGENT_LOG_DIR": str(self.dir / "logs"),
            "SANDBOX_AGENT_LOG_LEVEL": "warning",
            "SANDBOX_AGENT_MAX_UPLOAD_BYTES": str(1024 * MiB),
        }
        self.agent = subprocess.Popen([sys.executable, "-m", "sandbox_agent"], env=env)
        self._wait(lambda: self._get("/healthz") == 200)
        self.runner = subprocess.Popen(
            [sys.executable, str(self.dir / "run" / "runner.py")],
            cwd=self.workspace,
            env={"PATH": env["PATH"], "LANG": "C.UTF-8"},
        )
        self._wait(lambda: self._get("/readyz") == 200)

    def _get(self, path: str) -> int:
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            c.request("GET", path)
            status = c.getresponse().status
            c.close()
            return status
        except OSError:
            return 0

    @staticmethod
    def _wait(pred: Callable[[], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise RuntimeError("agent did not come up")
            time.sleep(0.05)

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU time used so far by the agent and by the runner (not their children)."""

        def cpu(pid: int) -> float:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        return cpu(self.agent.pid), cpu(self.runner.pid)

    def client(self) -> Client:
        return Client(self.port, self.token)

    def close(self) -> None:
        for p in (self.runner, self.agent):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class Client:
    """Keep-alive HTTP client (one connection; not thread-safe)."""

    def __init__(self, port: int, token: str) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120, blocksize=MiB)
        self.auth = f"Bearer {token}"

    def exec(self, body: bytes) -> dict[str, Any]:
        self.conn.request(
            "POST",
            "/v1/executions",
            body=body,
            headers={"Authorization": self.auth, "Content-Type": "application/json"},
        )
        r = self.conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"exec failed: {r.status} {data[:200]!r}")
        result: dict[str, Any] = json.loads(data)
        return result

    def put_file(self, rel: str, src: Path) -> None:
        with open(src, "rb") as f:
            self.conn.request(
                "PUT",
                f"/v1/files/content?path={rel}",
                body=f,
                headers={"Authorization": self.auth, "Content-Length": str(src.stat().st_size)},
            )
            r = self.conn.getresponse()
            r.read()
            if r.status != 200:
                raise RuntimeError(f"write failed: {r.status}")

    def get_file(self, rel: str, dst: Path) -> None:
        self.conn.request(
            "GET", f"/v1/files/content?path={rel}", headers={"Authorization": self.auth}
        )
        r = self.conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"read failed: {r.status}")
        with open(dst, "wb") as f:
            while chunk := r.read(4 * MiB):
                f.write(chunk)


def sequential(fn: Callable[[], object], n: int) -> list[float]:
    for _ in range(max(3, n // 20)):  # warm up
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def concurrent(make: Callable[[], Callable[[], object]], threads: int, per_thread: int) -> float:
    """Requests per second with ``threads`` workers, each with its own callable."""
    workers = [make() for _ in range(threads)]
    for w in workers:
        w()
    barrier = threading.Barrier(threads + 1)

    def run(w: Callable[[], object]) -> None:
        barrier.wait()
        for _ in range(per_thread):
            w()

    ts = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in ts:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in ts:
        t.join()
    return threads * per_thread / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--iterations", type=int, default=400, help="sequential samples per case")
    ap.add_argument("--per-thread", type=int, default=60, help="requests per thread, 10-way")
    ap.add_argument("--file-mib", type=int, default=100)
    ap.add_argument("--file-reps", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="also write benchmarks/results/*.json")
    args = ap.parse_args()

    agent = Agent()
    rows: list[tuple[str, str, str, str, str]] = []
    cpu_note: list[str] = []
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "loadavg_before": os.getloadavg(),
    }
    try:
        big = agent.workspace / "one-mib.txt"
        big.write_bytes((b"0123456789abcdef" * 4 + b"\n") * (MiB // 65) + b"x" * (MiB % 65))
        assert big.stat().st_size == MiB
        cases = {
            "true": ["true"],
            "1 MiB stdout": ["head", "-c", str(MiB), str(big)],
        }
        for name, argv in cases.items():
            body = json.dumps({"argv": argv}).encode()
            c = agent.client()

            def via_agent(c: Client = c, body: bytes = body) -> None:
                res = c.exec(body)
                assert res["exitCode"] == 0, res

            def floor(argv: list[str] = argv) -> None:
                subprocess.run(argv, capture_output=True, check=True)

            # interleave agent/floor blocks so background load hits both alike
            a_lat: list[float] = []
            f_lat: list[float] = []
            agent_cpu = runner_cpu = 0.0
            calls = 0
            for _ in range(4):
                a0, r0 = agent.cpu_seconds()
                a_lat += sequential(via_agent, args.iterations // 4)
                a1, r1 = agent.cpu_seconds()
                agent_cpu += a1 - a0
                runner_cpu += r1 - r0
                calls += args.iterations // 4 + max(3, args.iterations // 4 // 20)  # + warm-up
                f_lat += sequential(floor, args.iterations // 4)
            per_call = 1e3 / calls
            if name == "1 MiB stdout":
                assert len(c.exec(body)["stdout"]) == MiB
            a50, f50 = statistics.median(a_lat), statistics.median(f_lat)
            a99, f99 = _pct(a_lat, 0.99), _pct(f_lat, 0.99)
            over = (a50 - f50) * 1e3
            target = 1.5 if name == "true" else 3.0
            rows.append(
                (
                    f"exec {name}, sequential",
                    f"p50 {a50 * 1e3:.2f} ms, p99 {a99 * 1e3:.2f} ms",
                    f"p50 {f50 * 1e3:.2f} ms, p99 {f99 * 1e3:.2f} ms",
                    f"+{over:.2f} ms at p50",
                    f"<= +{target} ms: {'met' if over <= target else 'MISSED'}",
                )
            )
            cpu_note.append(
                f"exec {name}: agent {agent_cpu * per_call:.2f} ms CPU, "
                f"runner {runner_cpu * per_call:.2f} ms CPU per call"
            )
            results[f"exec_{name}_sequential"] = {
                "agent_p50_ms": a50 * 1e3, "agent_p99_ms": a99 * 1e3,
                "floor_p50_ms": f50 * 1e3, "floor_p99_ms": f99 * 1e3,
                "overhead_p50_ms": over,
            }  # fmt: skip

            def make_agent(body: bytes = body) -> Callable[[], object]:
                cl = agent.client()
                return lambda: cl.exec(body)

            def make_floor(argv: list[str] = argv) -> Callable[[], object]:
                return lambda: subprocess.run(argv, capture_output=True, check=True)

            per = args.per_thread if name == "true" else max(10, args.per_thread // 3)
            a_rps = statistics.median(concurrent(make_agent, 10, per) for _ in range(3))
            f_rps = statistics.median(concurrent(make_floor, 10, per) for _ in range(3))
            ratio = a_rps / f_rps
            rows.append(
                (
                    f"exec {name}, 10 concurrent",
                    f"{a_rps:.0f} req/s",
                    f"{f_rps:.0f} req/s",
                    f"{ratio:.0%} of floor",
                    f">= 45%: {'met' if ratio >= 0.45 else 'MISSED'}",
                )
            )
            results[f"exec_{name}_10way"] = {"agent_rps": a_rps, "floor_rps": f_rps, "ratio": ratio}

        # files: 100 MiB through the agent vs a plain local copy
        scratch = Path(tempfile.mkdtemp(prefix="agent-bench-files-"))
        try:
            src = scratch / "src.bin"
            with open(src, "wb") as f:
                for _ in range(args.file_mib):
                    f.write(os.urandom(MiB))
            size = args.file_mib * MiB
            c = agent.client()
            w_t, r_t, cp_t, py_t = [], [], [], []
            for _ in range(args.file_reps):
                t = time.perf_counter()
                c.put_file("bench.bin", src)
                w_t.append(time.perf_counter() - t)
                t = time.perf_counter()
                c.get_file("bench.bin", scratch / "back.bin")
                r_t.append(time.perf_counter() - t)
                t = time.perf_counter()
                shutil.copyfile(src, scratch / "copy.bin")
                cp_t.append(time.perf_counter() - t)
                t = time.perf_counter()
                with open(src, "rb") as fi, open(scratch / "pycopy.bin", "wb") as fo:
                    while block := fi.read(4 * MiB):
                        fo.write(block)
                py_t.append(time.perf_counter() - t)
            assert (scratch / "back.bin").stat().st_size == size
            cp = statistics.median(cp_t)
            pycp = statistics.median(py_t)
            for label, ts in (("write", w_t), ("read", r_t)):
                med = statistics.median(ts)
                ratio = cp / med
                rows.append(
                    (
                        f"file {label} {args.file_mib} MiB",
                        f"{med * 1e3:.0f} ms ({size / med / MiB:.0f} MiB/s)",
                        f"copyfile {cp * 1e3:.0f} ms ({size / cp / MiB:.0f} MiB/s); "
                        f"read/write loop {pycp * 1e3:.0f} ms",
                        f"{ratio:.0%} of copy throughput",
                        f">= 50%: {'met' if ratio >= 0.5 else 'MISSED'}",
                    )
                )
                results[f"file_{label}"] = {
                    "agent_ms": med * 1e3,
                    "copy_ms": cp * 1e3,
                    "python_copy_ms": pycp * 1e3,
                    "ratio": ratio,
                }
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    finally:
        agent.close()
    results["loadavg_after"] = os.getloadavg()

    head = ("case", "agent+runner", "floor (direct)", "ratio", "target")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
    line = " | ".join
    print(line(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(line(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    print()
    for note in cpu_note:
        print(note)
    results["cpu_per_call"] = cpu_note
    print(f"load average before/after: {results['loadavg_before']} / {results['loadavg_after']}")
    if args.json:
        write_results("agent_bench", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
