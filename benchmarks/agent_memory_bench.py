#!/usr/bin/env python3
"""Sandbox agent memory under attack, inside a 256 MiB memory cgroup.

Starts a real agent in a memory cgroup limited as the operator limits the
agent container (256 MiB, no swap), and a real runner outside it (the
sandbox container's side), then runs what hostile code in a sandbox could
do to the agent, one after the other:

- pipelining flood: 4 connections, each sending up to 150,000 tiny
  unauthenticated requests back to back without reading an answer;
- pipelined bodies: 8 connections, each a waiting request followed by a
  64 MiB body nobody has asked for;
- connection flood: 160 connections (the cap is 128), each pipelining until
  it stalls, then a new client;
- output floods: 16 concurrent commands, each printing 256 MiB;
- tar attacks: a gzip of a 300 MiB PAX header, and 2,000 long names;
- read attacks: a line range of a 1 GiB file without a newline, and a
  streamed read of it;
- round 2: connections held before auth, an xz asking for a 4 GiB
  dictionary, search/replace/patch/line ranges of hostile files, 10 s of
  alternating 1-byte writes, 30 scripts of 4 MiB, 32 downloads nobody reads
  beside 16 outputs of control characters, 48 outputs of 1.5 MiB at once.

Each attack runs against a fresh agent (in the same cgroup), so its peak is
its own.

Reported per attack and overall: the agent's peak RSS (sampled every 20 ms,
and the kernel's high-water mark VmHWM), the cgroup's peak charge (which
also counts page cache the agent's writes leave behind, reclaimable), the
log directory's peak size, OOM kills in the cgroup, and whether the agent
still answers. Target: peak RSS <= 128 MiB, no OOM kill.

Needs root and a memory cgroup (v2 ``memory.max``, or v1
``memory.limit_in_bytes``).

    .venv/bin/python benchmarks/agent_memory_bench.py [--limit-mib 256] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import http.client
import io
import json
import lzma
import os
import platform
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_results

MiB = 1 << 20
TARGET_RSS_MIB = 128


class Cgroup:
    """A memory cgroup of our own (v2 if the memory controller is there, else v1)."""

    def __init__(self, limit: int, name: str = "") -> None:
        self.v2 = self._v2_parent()
        name = name or f"sandbox-agent-bench-{os.getpid()}"
        if self.v2 is not None:
            self.path = self.v2 / name
            self.path.mkdir()
            (self.path / "memory.max").write_text(str(limit))
            (self.path / "memory.swap.max").write_text("0")
        else:
            own = self._v1_own()
            self.path = own / name
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            swap = self.path / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(limit))

    @staticmethod
    def _v2_parent() -> Path | None:
        root = Path("/sys/fs/cgroup")
        if not (root / "cgroup.controllers").exists():
            return None
        if "memory" not in (root / "cgroup.controllers").read_text().split():
            return None
        rel = next(
            line.split("::", 1)[1]
            for line in Path("/proc/self/cgroup").read_text().splitlines()
            if line.startswith("0::")
        )
        parent = root / rel.lstrip("/")
        # A v2 cgroup with processes may not have children with controllers:
        # use a sibling under the parent of ours when ours holds processes.
        if (parent / "cgroup.procs").read_text().strip():
            parent = parent.parent
        subtree = parent / "cgroup.subtree_control"
        if "memory" not in subtree.read_text().split():
            subtree.write_text("+memory")
        return parent

    @staticmethod
    def _v1_own() -> Path:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, rel = line.split(":", 2)
            if "memory" in controllers.split(","):
                return Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
        raise RuntimeError("no memory cgroup (v1 or v2) on this machine")

    @property
    def procs(self) -> str:
        return str(self.path / "cgroup.procs")

    def add(self, pid: int) -> None:
        Path(self.procs).write_text(str(pid))

    def peak(self) -> int:
        name = "memory.peak" if self.v2 is not None else "memory.max_usage_in_bytes"
        f = self.path / name
        return int(f.read_text()) if f.exists() else -1

    def oom_kills(self) -> int:
        name = "memory.events" if self.v2 is not None else "memory.oom_control"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Agent:
    def __init__(self, cgroup: Cgroup, env_extra: dict[str, str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="agent-mem-bench-"))
        self.workspace = self.dir / "ws"
        self.workspace.mkdir()
        (self.dir / "run").mkdir()
        self.logs = self.dir / "logs"
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
            "SANDBOX_AGENT_LOG_DIR": str(self.logs),
            "SANDBOX_AGENT_LOG_LEVEL": "warning",
            **env_extra,
        }
        procs = cgroup.procs

        def enter_cgroup() -> None:
            with open(procs, "w") as f:
                f.write("0")

        self.agent = subprocess.Popen(
            [sys.executable, "-m", "sandbox_agent"], env=env, preexec_fn=enter_cgroup
        )
        self._wait(lambda: self.get("/healthz")[0] == 200)
        self.runner = subprocess.Popen(
            [sys.executable, str(self.dir / "run" / "runner.py")],
            cwd=self.workspace,
            # No coalescing of small writes: the image sets this, not the agent.
            env={"PATH": env["PATH"], "LANG": "C.UTF-8", "SANDBOX_RUNNER_LINGER_MS": "0"},
        )
        self._wait(lambda: self.get("/readyz")[0] == 200)

    def request(
        self, method: str, path: str, body: bytes | None = None, timeout: float = 300
    ) -> tuple[int, bytes]:
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
            c.request(method, path, body=body, headers={"Authorization": f"Bearer {self.token}"})
            r = c.getresponse()
            data = r.read()
            c.close()
            return r.status, data
        except OSError:
            return 0, b""

    def get(self, path: str) -> tuple[int, bytes]:
        return self.request("GET", path, timeout=5)

    @staticmethod
    def _wait(pred: Callable[[], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise RuntimeError("agent did not come up")
            time.sleep(0.05)

    def status(self, key: str) -> int:
        """A VmXXX line of the agent's /proc status, in bytes (0 once it is gone)."""
        try:
            for line in Path(f"/proc/{self.agent.pid}/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def close(self) -> None:
        for p in (self.runner, self.agent):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class Sampler:
    """Peak RSS of the agent and peak size of its log directory, sampled."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.rss = 0
        self.logs = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            self.rss = max(self.rss, self.agent.status("VmRSS"))
            n += 1
            if n % 10 == 0:
                self.logs = max(self.logs, _du(self.agent.logs))
            time.sleep(0.02)

    def reset(self) -> None:
        self.rss = self.agent.status("VmRSS")
        self.logs = _du(self.agent.logs)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def _du(path: Path) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):  # pruned meanwhile
                total += os.lstat(os.path.join(root, n)).st_blocks * 512
    return total


# ---- attacks -----------------------------------------------------------------


def pipelining_flood(a: Agent) -> str:
    req = b"GET /v1/info HTTP/1.1\r\nHost: x\r\n\r\n"
    batch = req * 1000
    sent = [0] * 4

    def one(i: int) -> None:
        s = socket.create_connection(("127.0.0.1", a.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(2.0)
        try:
            while sent[i] < len(req) * 150_000:
                try:
                    sent[i] += s.send(batch[sent[i] % len(batch) :])
                except TimeoutError:
                    break
        finally:
            s.close()

    _threads(one, 4)
    # What was sent sits in the kernel's socket buffers: the agent stopped reading.
    return f"{sum(sent) // len(req):,} of 600,000 requests sent before the sends stalled"


def connection_flood(a: Agent) -> str:
    """As many connections as the agent allows, each pipelining until it stalls."""
    req = b"GET /v1/info HTTP/1.1\r\nHost: x\r\n\r\n"
    batch = req * 4000
    socks: list[socket.socket] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        s = socket.create_connection(("127.0.0.1", a.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(1.0)
        with contextlib.suppress(OSError):
            while True:
                s.send(batch)
        with lock:
            socks.append(s)

    _threads(one, 160)
    served = a.get("/healthz")[0]
    for s in socks:
        s.close()
    return f"160 connections stalled (cap 128): a new client then got {served}"


def pipelined_bodies(a: Agent) -> str:
    accepted = [0] * 8

    def one(i: int) -> None:
        s = socket.create_connection(("127.0.0.1", a.port))
        s.settimeout(2.0)
        s.sendall(b"GET /readyz?waitSeconds=5 HTTP/1.1\r\nHost: x\r\n\r\n")
        s.sendall(b"GET /readyz?waitSeconds=5 HTTP/1.1\r\nHost: x\r\n\r\n")
        s.sendall(b"PUT /v1/files/content?path=x HTTP/1.1\r\nHost: x\r\n")
        s.sendall(b"Content-Length: %d\r\n\r\n" % (64 * MiB))
        chunk = b"\0" * MiB
        try:
            for _ in range(64):
                s.sendall(chunk)
                accepted[i] += 1
        except OSError:
            pass  # stalled (the agent stopped reading), or closed after the 401
        s.close()

    _threads(one, 8)
    return f"{sum(accepted)} MiB of 512 MiB accepted"


def output_floods(a: Agent) -> str:
    outcomes: list[str] = []
    body = json.dumps(
        {
            "command": "yes AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA | head -c 268435456",
            "timeoutSeconds": 300,
        }
    ).encode()

    def one(i: int) -> None:
        status, data = a.request("POST", "/v1/executions", body)
        outcomes.append(str(status) if status != 200 else json.loads(data)["status"])

    _threads(one, 16)
    counts = {o: outcomes.count(o) for o in sorted(set(outcomes))}
    return f"16 x 256 MiB of output: {counts}"


def tar_attacks(a: Agent) -> str:
    body = b"x" * (300 * MiB)
    rec = b"%d comment=%s\n" % (len(body) + 20, body)
    del body
    head = tarfile.TarInfo("././@PaxHeader")
    head.type = tarfile.XHDTYPE
    head.size = len(rec)
    raw = head.tobuf(tarfile.USTAR_FORMAT) + rec + b"\0" * (-len(rec) % 512)
    del rec
    bomb = gzip.compress(raw, 1)
    del raw
    s1, _ = a.request("PUT", "/v1/files/archive?path=bomb", bomb)
    buf = io.BytesIO()
    deep = "/".join(["n" * 200] * 19)
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for i in range(2000):
            tar.addfile(tarfile.TarInfo(f"{deep}/{i:05d}"), io.BytesIO(b""))
    s2, _ = a.request("PUT", "/v1/files/archive?path=names", buf.getvalue())
    return f"PAX bomb ({len(bomb) // 1024} KiB gzip): {s1}; 2,000 long names: {s2}"


def read_attacks(a: Agent) -> str:
    with open(a.workspace / "sparse", "wb") as f:
        f.truncate(1 << 30)
    s1, _ = a.request("GET", "/v1/files/content?path=sparse&lineCount=1")
    s2, _ = a.request("GET", "/v1/files/content?path=sparse&startLine=2")
    c = http.client.HTTPConnection("127.0.0.1", a.port, timeout=300)
    c.request(
        "GET", "/v1/files/content?path=sparse", headers={"Authorization": f"Bearer {a.token}"}
    )
    r = c.getresponse()
    got = 0
    while chunk := r.read(4 * MiB):
        got += len(chunk)
    c.close()
    return f"line range of 1 GiB w/o newline: {s1}, {s2}; streamed read: {got // MiB} MiB"


# -- round 2: what finished records keep, what slow readers hold, whole files --


def xz_asking_for_4gib(tar: bytes) -> bytes:
    """An .xz of `tar` whose block header asks for a 4 GiB LZMA2 dictionary."""
    xz = bytearray(lzma.compress(tar, format=lzma.FORMAT_XZ, preset=0))
    start, size = 12, (xz[12] + 1) * 4  # the block header, after the stream header
    header = xz[start : start + size]
    header[4] = 40  # the dictionary size code: 4 GiB - 1
    header[-4:] = struct.pack("<I", zlib.crc32(bytes(header[:-4])))
    xz[start : start + size] = header
    return bytes(xz)


def preauth_hold(a: Agent) -> str:
    held = []
    for _ in range(140):
        s = socket.create_connection(("127.0.0.1", a.port), timeout=10)
        s.sendall(
            b"PUT /v1/files/content?path=x HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: 100000000\r\n\r\n" + b"y" * 100
        )
        held.append(s)
    answered = tried = 0
    end = time.monotonic() + 5
    while time.monotonic() < end:
        for s in held:
            with contextlib.suppress(OSError):
                s.send(b"y")
        tried += 1
        answered += a.get("/healthz")[0] == 200
        time.sleep(0.1)
    for s in held:
        s.close()
    return f"140 connections held before auth: /healthz answered {answered}/{tried}"


def xz_dictionary(a: Agent) -> str:
    body = xz_asking_for_4gib(b"\0" * 10240)
    statuses: list[int] = []
    _threads(
        lambda i: statuses.append(a.request("PUT", f"/v1/files/archive?path=x{i}", body)[0]), 8
    )
    return f"8 x {len(body)} B .tar.xz asking for a 4 GiB dictionary: {sorted(set(statuses))}"


def plant_hostile_files(ws: Path) -> None:
    """Files that cost whole-file operations most: 8 MiB of 2-byte lines
    (short.txt), 15 MiB with one astral character (astral.txt, "X" near its
    end), 48 MiB of 2-byte lines (lines48.txt), 64 MiB of newlines."""
    (ws / "short.txt").write_bytes(b"a\n" * ((4 << 20) - 8))
    with (ws / "astral.txt").open("wb") as f:  # within the 16 MiB edit limit
        f.truncate(15 * MiB)
        f.seek(15 * MiB)
        f.write("\N{GRINNING FACE} X\n".encode())
    (ws / "lines48.txt").write_bytes(b"a\n" * (24 << 20))
    (ws / "newlines.txt").write_bytes(b"\n" * (64 << 20))


def whole_files(a: Agent) -> str:
    plant_hostile_files(a.workspace)
    diff = "--- a/lines48.txt\n+++ b/lines48.txt\n@@ -1 +1 @@\n-a\n+b\n"
    calls = [
        ("POST", "/v1/files/search", {"pattern": "zz", "path": "short.txt"}),
        ("POST", "/v1/files/search", {"pattern": "zz", "path": "short.txt"}),
        ("POST", "/v1/files/replace", {"path": "astral.txt", "find": "X", "replace": "Y"}),
        ("POST", "/v1/files/patch", {"patch": diff}),
        *[("GET", f"/v1/files/content?path=newlines.txt&startLine={(64 << 20) + 9}", None)] * 6,
    ]
    statuses: list[int] = []

    def one(i: int) -> None:
        method, path, body = calls[i]
        payload = None if body is None else json.dumps(body).encode()
        statuses.append(a.request(method, path, payload)[0])

    _threads(one, len(calls))
    return f"search, replace, patch and line ranges of hostile files: {sorted(statuses)}"


def tiny_records(a: Agent) -> str:
    script = (
        "import os, time\nend = time.time() + 10\nwhile time.time() < end:\n"
        "    os.write(1, b'o'); os.write(2, b'e')\n"
    )
    body = json.dumps({"command": f'python3 -c "{script}"', "timeoutSeconds": 60}).encode()
    status, data = a.request("POST", "/v1/executions", body)
    ex = json.loads(data)
    page_status, page = a.request("GET", f"/v1/executions/{ex['id']}/output")
    chunks = len(json.loads(page)["chunks"]) if page_status == 200 else -1
    return (
        f"10 s of alternating 1-byte writes: {status}, {ex.get('stdoutBytes')} B,"
        f" a page of {chunks} chunks"
    )


def long_scripts(a: Agent) -> str:
    body = json.dumps({"command": "true\n# " + "x" * (4 * MiB - 100) + "\n"}).encode()
    statuses = [a.request("POST", "/v1/executions", body)[0] for _ in range(30)]
    listed, _ = a.request("GET", "/v1/executions")
    return f"30 x 4 MiB scripts: {sorted(set(statuses))}; list: {listed}"


def unread_answers(a: Agent) -> str:
    (a.workspace / "big.bin").write_bytes(os.urandom(64 * MiB))
    (a.workspace / "tree").mkdir(exist_ok=True)
    for i in range(8):
        (a.workspace / "tree" / f"f{i}").write_bytes(os.urandom(8 * MiB))
    readers = []
    for i in range(32):
        s = socket.create_connection(("127.0.0.1", a.port), timeout=10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        path = "/v1/files/content?path=big.bin" if i % 2 else "/v1/files/archive?path=tree"
        s.sendall(
            f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {a.token}\r\n\r\n".encode()
        )
        readers.append(s)
    body = json.dumps({"command": "head -c 1500000 /dev/zero | tr '\\0' '\\1'"}).encode()
    statuses: list[int] = []
    _threads(lambda i: statuses.append(a.request("POST", "/v1/executions", body)[0]), 16)
    time.sleep(2)
    for s in readers:
        s.close()
    return (
        f"32 downloads nobody reads + 16 x 1.5 MiB of control characters: {sorted(set(statuses))}"
    )


def concurrent_outputs(a: Agent) -> str:
    body = json.dumps({"command": "head -c 1500000 /dev/zero | tr '\\0' x"}).encode()
    whole = marked = silent = refused = 0

    def one(i: int) -> None:
        nonlocal whole, marked, silent, refused
        status, data = a.request("POST", "/v1/executions", body)
        if status != 200:
            refused += 1
            return
        ex = json.loads(data)
        if len(ex["stdout"]) == 1500000:
            whole += 1
        elif ex["stdoutTruncated"] and ex["stdout"]:
            marked += 1  # the tail cap (1.33 MiB at 256 MiB), said so
        else:
            silent += 1

    _threads(one, 48)
    return (
        f"48 x 1.5 MiB at once: {whole} whole, {marked} tail only (marked),"
        f" {silent} without their tail, {refused} refused (429)"
    )


def _threads(fn: Callable[[int], None], n: int) -> None:
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


ATTACKS: list[tuple[str, Callable[[Agent], str]]] = [
    ("pipelining flood", pipelining_flood),
    ("pipelined bodies", pipelined_bodies),
    ("connection flood", connection_flood),
    ("output floods", output_floods),
    ("tar attacks", tar_attacks),
    ("read attacks", read_attacks),
    ("pre-auth hold", preauth_hold),
    ("xz dictionary", xz_dictionary),
    ("whole files", whole_files),
    ("tiny records", tiny_records),
    ("long scripts", long_scripts),
    ("unread answers", unread_answers),
    ("concurrent outputs", concurrent_outputs),
]


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(limit_mib: int, env: dict[str, str]) -> dict[str, Any]:
    """Each attack against a fresh agent in the same cgroup: a peak is the
    attack's own, not what earlier ones left in the heap."""
    cg = Cgroup(limit_mib * MiB)
    rows: list[dict[str, Any]] = []
    base = hwm = 0
    try:
        for name, attack in ATTACKS:
            agent = Agent(cg, env)
            sampler = Sampler(agent)
            try:
                base = base or agent.status("VmRSS")
                sampler.reset()
                t = time.monotonic()
                what = attack(agent)
                time.sleep(0.2)
                alive = agent.agent.poll() is None and agent.get("/healthz")[0] == 200
                hwm = max(hwm, agent.status("VmHWM"))
                rows.append(
                    {
                        "attack": name,
                        "what": what,
                        "seconds": round(time.monotonic() - t, 1),
                        "peak_rss_mib": round(max(sampler.rss, agent.status("VmHWM")) / MiB, 1),
                        "peak_log_dir_mib": round(sampler.logs / MiB, 1),
                        "agent_alive": alive,
                    }
                )
            finally:
                sampler.close()
                agent.close()
            print(
                f"  {name:18} peak RSS {rows[-1]['peak_rss_mib']:7.1f} MiB  "
                f"logs {rows[-1]['peak_log_dir_mib']:6.1f} MiB  "
                f"alive {rows[-1]['agent_alive']}  ({what})",
                flush=True,
            )
        return {
            "limit_mib": limit_mib,
            "cgroup": "v2" if cg.v2 is not None else "v1",
            "baseline_rss_mib": round(base / MiB, 1),
            "peak_rss_mib": round(max(r["peak_rss_mib"] for r in rows), 1),
            "vm_hwm_mib": round(hwm / MiB, 1),
            "cgroup_peak_mib": round(cg.peak() / MiB, 1),
            "oom_kills": cg.oom_kills(),
            "agent_alive": all(r["agent_alive"] for r in rows),
            "attacks": rows,
        }
    finally:
        cg.remove()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit-mib", type=int, default=256)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (a memory cgroup of its own)", file=sys.stderr)
        return 2
    # The agent as the operator configures it for a container of this limit.
    env = {
        "SANDBOX_AGENT_MEMORY_LIMIT_BYTES": str(args.limit_mib * MiB),
        "SANDBOX_AGENT_MAX_LOG_DIR_BYTES": str(192 * MiB),
    }
    print(f"agent memory under attack, {args.limit_mib} MiB cgroup (load {_loadavg()})")
    results = run(args.limit_mib, env)
    results.update(
        {
            "machine": f"{platform.node()} {os.cpu_count()} cpus",
            "loadavg_after": _loadavg(),
            "target_peak_rss_mib": TARGET_RSS_MIB,
        }
    )
    print(
        f"peak RSS {results['peak_rss_mib']} MiB (VmHWM {results['vm_hwm_mib']} MiB, "
        f"baseline {results['baseline_rss_mib']} MiB; target <= {TARGET_RSS_MIB}), "
        f"cgroup peak {results['cgroup_peak_mib']} MiB incl. page cache, "
        f"OOM kills {results['oom_kills']}, agent alive {results['agent_alive']} "
        f"(load {results['loadavg_after']})"
    )
    write_results("agent_memory", results)
    if args.json:
        print(json.dumps(results, indent=2))
    ok = (
        results["peak_rss_mib"] <= TARGET_RSS_MIB
        and results["oom_kills"] == 0
        and results["agent_alive"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
