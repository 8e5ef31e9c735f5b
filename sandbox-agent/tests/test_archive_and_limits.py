"""Tar round trips, archive bombs, and every configured limit."""

from __future__ import annotations

import concurrent.futures
import gzip
import io
import lzma
import os
import stat
import struct
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from conftest import Sandbox, wait_until

# The benchmark's crafted archive (benchmarks/agent_memory_bench.py), as the
# hostile tier uses it.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.agent_memory_bench import xz_asking_for_4gib


def test_tar_download_upload_roundtrip(sandbox: Sandbox, wsdir: str) -> None:
    src = sandbox.workspace / wsdir / "src"
    (src / "pkg" / "empty").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("print('hi')\n")
    (src / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(src / "run.sh", 0o755)
    os.symlink("pkg/mod.py", src / "link")
    os.mkfifo(src / "fifo")  # not archived
    r = sandbox.client.get("/v1/files/archive", params={"path": f"{wsdir}/src"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        names = {m.name: m for m in tar.getmembers()}
    assert set(names) == {"pkg", "pkg/empty", "pkg/mod.py", "run.sh", "link"}
    assert names["link"].issym() and names["link"].linkname == "pkg/mod.py"
    up = sandbox.client.put(
        "/v1/files/archive", params={"path": f"{wsdir}/copy"}, content=r.content
    )
    assert up.status_code == 200, up.text
    assert up.json() == {"path": f"{wsdir}/copy", "entries": 5, "bytes": len("print('hi')\n") + 10}
    dst = sandbox.workspace / wsdir / "copy"
    assert (dst / "pkg/mod.py").read_text() == "print('hi')\n"
    assert os.readlink(dst / "link") == "pkg/mod.py"
    mode = stat.S_IMODE((dst / "run.sh").stat().st_mode)
    assert mode & 0o111 and mode & 0o020  # executable kept, group may write


def _tar(*members: tuple[str, bytes | None, int]) -> bytes:
    """A tar of (name, data or None for a directory, mode) members, in order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data, mode in members:
            info = tarfile.TarInfo(name)
            info.mode = mode
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_archive_parents_without_entries_open_to_the_group(sandbox: Sandbox, wsdir: str) -> None:
    # The runtime container shares only the group with the agent: a parent the
    # archive never names must still let it in (as the SDK's write_many sends).
    # A directory's own entry, even after its contents, sets its mode.
    body = _tar(
        ("app/www/index.html", b"<h1>hi</h1>\n", 0o644),
        ("lib/x/y.txt", b"y", 0o644),
        ("lib/x", None, 0o750),
    )
    r = sandbox.client.put("/v1/files/archive", params={"path": wsdir}, content=body)
    assert r.status_code == 200, r.text
    root = sandbox.workspace / wsdir
    for d in ("app", "app/www", "lib"):
        assert stat.S_IMODE((root / d).stat().st_mode) == 0o775, d
    assert stat.S_IMODE((root / "lib/x").stat().st_mode) == 0o770
    assert stat.S_IMODE((root / "app/www/index.html").stat().st_mode) == 0o664


def test_gzip_download_and_upload(sandbox: Sandbox, wsdir: str) -> None:
    sandbox.write(f"{wsdir}/g/a.txt", b"a" * 10000)
    r = sandbox.client.get("/v1/files/archive", params={"path": f"{wsdir}/g", "gzip": "true"})
    assert r.content[:2] == b"\x1f\x8b"
    up = sandbox.client.put("/v1/files/archive", params={"path": f"{wsdir}/g2"}, content=r.content)
    assert up.status_code == 200
    assert sandbox.read(f"{wsdir}/g2/a.txt") == b"a" * 10000


def test_archive_errors(sandbox: Sandbox, wsdir: str) -> None:
    r = sandbox.client.put("/v1/files/archive", params={"path": wsdir}, content=os.urandom(5000))
    assert sandbox.error(r, 400) == "invalid_archive"
    good = io.BytesIO()
    with tarfile.open(fileobj=good, mode="w") as tar:
        ti = tarfile.TarInfo("f")
        ti.size = 100_000
        tar.addfile(ti, io.BytesIO(b"x" * 100_000))
    truncated = good.getvalue()[:50_000]
    r = sandbox.client.put("/v1/files/archive", params={"path": wsdir}, content=truncated)
    assert sandbox.error(r, 400) == "invalid_archive"
    r = sandbox.client.get("/v1/files/archive", params={"path": f"{wsdir}/nope"})
    assert sandbox.error(r, 404) == "not_found"
    sandbox.write(f"{wsdir}/file", b"x")
    r = sandbox.client.get("/v1/files/archive", params={"path": f"{wsdir}/file"})
    assert sandbox.error(r, 400) == "not_a_directory"


def test_compressed_archives_decompress_within_a_memory_limit(sandbox: Sandbox, wsdir: str) -> None:
    """A 4 GiB dictionary asked for in a few bytes is refused, not allocated."""
    tar = _tar(("x/a.txt", b"hello\n" * 1000, 0o644))
    for name, body in (
        ("xz", lzma.compress(tar, format=lzma.FORMAT_XZ)),
        ("lzma", lzma.compress(tar, format=lzma.FORMAT_ALONE)),
        ("xz -9", lzma.compress(tar, format=lzma.FORMAT_XZ, preset=9)),
    ):
        r = sandbox.client.put(
            "/v1/files/archive", params={"path": f"{wsdir}/{name}"}, content=body
        )
        assert r.status_code == 200, (name, r.text)
        assert sandbox.read(f"{wsdir}/{name}/x/a.txt") == b"hello\n" * 1000
    alone = bytearray(lzma.compress(tar, format=lzma.FORMAT_ALONE))
    alone[1:5] = struct.pack("<I", 0xFFFFFFFF)  # the header's dictionary size
    for name, body in (("xz", xz_asking_for_4gib(tar)), ("lzma", bytes(alone))):
        assert len(body) < 4096
        r = sandbox.client.put(
            "/v1/files/archive", params={"path": f"{wsdir}/big-{name}"}, content=body
        )
        assert sandbox.error(r, 413) == "archive_too_large", name
        assert "MiB of memory" in r.json()["error"]["message"], r.text
        assert not (sandbox.workspace / wsdir / f"big-{name}").exists() or not any(
            (sandbox.workspace / wsdir / f"big-{name}").iterdir()
        )
    assert sandbox.client.get("/healthz").status_code == 200


def _bomb(size: int) -> bytes:
    """A gzip'd tar whose one member unpacks to ``size`` zero bytes."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        ti = tarfile.TarInfo("zeros")
        ti.size = size
        tar.addfile(ti, io.BytesIO(bytes(size)))
    return gzip.compress(raw.getvalue(), 9)


def test_archive_limits(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(
        env={
            "SANDBOX_AGENT_MAX_EXTRACT_BYTES": str(8 << 20),
            "SANDBOX_AGENT_MAX_ARCHIVE_ENTRIES": "10",
            "SANDBOX_AGENT_MAX_UPLOAD_BYTES": str(4 << 20),
        }
    )
    bomb = _bomb(64 << 20)
    assert len(bomb) < 1 << 20  # small on the wire
    r = sb.client.put("/v1/files/archive", params={"path": "bomb"}, content=bomb)
    assert sb.error(r, 413) == "archive_too_large"
    assert not (sb.workspace / "bomb" / "zeros").exists()
    many = io.BytesIO()
    with tarfile.open(fileobj=many, mode="w") as tar:
        for i in range(11):
            tar.addfile(tarfile.TarInfo(f"f{i}"), io.BytesIO(b""))
    r = sb.client.put("/v1/files/archive", params={"path": "many"}, content=many.getvalue())
    assert sb.error(r, 413) == "archive_too_large"
    r = sb.client.put("/v1/files/archive", params={"path": "big"}, content=os.urandom(5 << 20))
    assert sb.error(r, 413) == "body_too_large"
    r = sb.client.put("/v1/files/content", params={"path": "big"}, content=os.urandom(5 << 20))
    assert sb.error(r, 413) == "body_too_large"
    assert not (sb.workspace / "big").exists()

    # a chunked upload (no Content-Length) is cut off at the limit too
    def gen() -> object:
        for _ in range(6):
            yield os.urandom(1 << 20)

    r = sb.client.put("/v1/files/content", params={"path": "big2"}, content=gen())  # type: ignore[arg-type]
    assert sb.error(r, 413) == "body_too_large"
    assert [p.name for p in sb.workspace.iterdir() if p.name.startswith(".big")] == []
    assert sb.sh("echo still-alive")["stdout"] == "still-alive\n"


def test_request_body_limit(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(env={"SANDBOX_AGENT_MAX_BODY_BYTES": "1000"})
    r = sb.client.post("/v1/executions", json={"command": "echo " + "x" * 2000})
    assert sb.error(r, 413) == "body_too_large"
    assert sb.sh("echo ok")["stdout"] == "ok\n"


def test_concurrency_limit(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(env={"SANDBOX_AGENT_MAX_CONCURRENT_EXECUTIONS": "3"})
    ids = [sb.run(expect=202, command="sleep 30", background=True)["id"] for _ in range(3)]
    r = sb.client.post("/v1/executions", json={"command": "true"})
    assert sb.error(r, 429) == "too_many_executions"
    r = sb.client.post("/v1/executions/stream", json={"command": "true"})
    assert sb.error(r, 429) == "too_many_executions"
    # an idempotent replay of a known key is not a new execution
    sb.client.post(f"/v1/executions/{ids[0]}/cancel")
    keyed = sb.run(expect=202, command="sleep 30", background=True, idempotencyKey="k1")
    again = sb.run(expect=200, command="sleep 30", background=True, idempotencyKey="k1")
    assert again["id"] == keyed["id"]
    for ex_id in [*ids, keyed["id"]]:
        sb.client.post(f"/v1/executions/{ex_id}/cancel")
    assert sb.sh("echo free")["stdout"] == "free\n"


def test_timeout_limit(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(max_timeout=10, default_timeout=5)
    assert sb.sh("true")["timeoutSeconds"] == 5
    r = sb.client.post("/v1/executions", json={"command": "true", "timeoutSeconds": 11})
    assert sb.error(r, 400) == "timeout_too_large"


def test_capture_and_log_caps(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(max_capture_bytes=1000, max_log_bytes=100_000)
    ex = sb.sh("head -c 500000 /dev/zero | tr '\\0' a; echo; echo tail-line")
    assert ex["stdoutTruncated"] is True and len(ex["stdout"]) == 1000
    assert ex["stdout"].endswith("tail-line\n")
    assert ex["stdoutBytes"] == 500000 + 11
    assert ex["logTruncated"] is True
    assert ex["outputCursor"] <= 100000
    page = sb.client.get(f"/v1/executions/{ex['id']}/output", params={"maxBytes": 1 << 20}).json()
    assert page["logTruncated"] is True and page["finished"] is True
    assert sum(len(c["data"]) for c in page["chunks"]) < 100000
    # Control characters take six bytes each in JSON: their tail is cut so the
    # answer stays within the cap too.
    ex = sb.sh("head -c 800 /dev/zero | tr '\\0' '\\1'")
    assert ex["stdoutBytes"] == 800 and ex["stdoutTruncated"] is True
    assert ex["stdout"] == "\x01" * (1000 // 6)


def test_log_dir_cap_prunes_oldest(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(env={"SANDBOX_AGENT_MAX_LOG_DIR_BYTES": "300000"})
    first = sb.sh("head -c 200000 /dev/zero")
    second = sb.sh("head -c 200000 /dev/zero")
    assert second["logTruncated"] is False
    r = sb.client.get(f"/v1/executions/{first['id']}/output")
    assert sb.error(r, 410) == "log_pruned"
    total = sum(p.stat().st_size for p in sb.logs.glob("*.log"))
    assert total <= 300000


def test_record_retention(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(env={"SANDBOX_AGENT_MAX_RECORDS": "3"})
    ids = [sb.sh(f"echo {i}", idempotencyKey=f"k{i}")["id"] for i in range(5)]
    listed = [e["id"] for e in sb.client.get("/v1/executions").json()["executions"]]
    assert listed == ids[-3:]
    assert sb.client.get(f"/v1/executions/{ids[0]}").status_code == 404


def test_many_parallel_requests_do_not_break_agent(sandbox: Sandbox, wsdir: str) -> None:
    def work(i: int) -> int:
        sandbox.write(f"{wsdir}/p{i}", b"x" * i)
        ex = sandbox.sh(f"cat p{i} | wc -c", cwd=wsdir)
        return int(ex["stdout"])

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert list(pool.map(work, range(40))) == list(range(40))


def test_activity_and_info(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    info = sb.client.get("/v1/info").json()
    assert set(info) >= {
        "lastActivity",
        "activeExecutions",
        "version",
        "runnerVersion",
        "runnerConnected",
        "uptimeSeconds",
        "startedAt",
    }
    usage = info["workspaceUsage"]
    fs = os.statvfs(sb.workspace)
    assert usage["totalBytes"] == fs.f_blocks * fs.f_frsize > 0
    assert 0 < usage["availableBytes"] <= usage["totalBytes"] - usage["usedBytes"]
    before = info["lastActivity"]
    time.sleep(0.05)
    # info, health, readiness, metrics and openapi are not activity
    for path in ("/v1/info", "/healthz", "/readyz", "/metrics", "/openapi.json"):
        sb.client.get(path)
    assert sb.client.get("/v1/info").json()["lastActivity"] == before
    sb.client.get("/v1/files/list")
    after_file = sb.client.get("/v1/info").json()["lastActivity"]
    assert after_file > before
    time.sleep(0.05)
    ex = sb.run(expect=202, command="sleep 30", background=True)
    info = sb.client.get("/v1/info").json()
    assert info["activeExecutions"] == 1 and info["lastActivity"] > after_file
    sb.client.post(f"/v1/executions/{ex['id']}/cancel")
    wait_until(lambda: sb.client.get("/v1/info").json()["activeExecutions"] == 0)
    assert info["uptimeSeconds"] >= 0 and info["startedAt"].endswith("Z")


def test_metrics(sandbox: Sandbox) -> None:
    sandbox.sh("echo metrics")
    sandbox.write("metrics-probe.txt", b"x")
    sandbox.client.get("/v1/files/stat", params={"path": "."})
    text = sandbox.client.get("/metrics").text
    for name in (
        'sandbox_agent_executions_total{outcome="completed"}',
        "sandbox_agent_execution_duration_seconds_bucket",
        "sandbox_agent_active_executions",
        'sandbox_agent_file_operations_total{op="stat",result="ok"}',
        'sandbox_agent_file_bytes_total{direction="in"}',
        'sandbox_agent_exec_output_bytes_total{stream="stdout"}',
        "sandbox_agent_runner_connected 1.0",
    ):
        assert name in text, name
    assert sandbox.anon.get("/metrics").status_code == 401


def test_logs_spill_from_memory_to_disk(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(log_memory_bytes=10_000, log_memory_total_bytes=15_000)
    small = sb.sh("echo small")
    assert list(sb.logs.glob("*.log")) == []  # small logs never touch the disk
    big = sb.sh("head -c 50000 /dev/zero | tr '\\0' b")
    assert (sb.logs / f"{big['id']}.log").exists()  # over the per-execution threshold
    mids = [sb.sh("head -c 8000 /dev/zero | tr '\\0' m") for _ in range(3)]
    # together over the total budget: the oldest finished in-memory logs spilled
    wait_until(lambda: (sb.logs / f"{mids[0]['id']}.log").exists())  # written in a thread
    for ex, size in [(small, 6), (big, 50000), *((m, 8000) for m in mids)]:
        cursor, got = 0, 0
        while True:
            page = sb.client.get(
                f"/v1/executions/{ex['id']}/output", params={"cursor": cursor, "maxBytes": 3000}
            ).json()
            got += sum(len(c["data"]) for c in page["chunks"])
            cursor = page["cursor"]
            if page["finished"]:
                break
        assert got == size, ex["id"]


def test_abandoned_tar_download_stops_its_producer(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(runner=False)
    big = sb.workspace / "big"
    big.mkdir()
    for i in range(24):
        (big / f"f{i}").write_bytes(os.urandom(1 << 20))
    assert sb.agent is not None
    # A producer blocked on a client that went away would keep the file it is
    # archiving open: count the agent's descriptors (thread counts are blurred
    # by the worker pool growing lazily).
    fds = f"/proc/{sb.agent.pid}/fd"
    assert len(sb.client.get("/v1/files/archive", params={"path": "big"}).content) > 24 << 20
    sb.client.close()
    sb.client = httpx.Client(
        base_url=sb.base_url, headers={"Authorization": f"Bearer {sb.token}"}, timeout=60
    )
    time.sleep(0.5)
    baseline = len(os.listdir(fds))
    for _ in range(5):
        with (
            httpx.Client(base_url=sb.base_url, headers=sb.client.headers) as c,
            c.stream("GET", "/v1/files/archive", params={"path": "big"}) as r,
        ):
            next(r.iter_bytes())  # read a little, then hang up
    wait_until(lambda: len(os.listdir(fds)) <= baseline, 10)
    assert sb.anon.get("/healthz").status_code == 200


def test_finished_tails_are_bounded_in_memory(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(
        env={
            "SANDBOX_AGENT_LOG_MEMORY_BYTES": "1000",  # logs spill: tails become buffers
            "SANDBOX_AGENT_CAPTURE_MEMORY_TOTAL_BYTES": "50000",
        }
    )
    exs = [sb.sh(f"head -c 20000 /dev/zero | tr '\\0' {c}") for c in "abc"]
    assert all(e["stdout"] == c * 20000 for e, c in zip(exs, "abc", strict=True))
    oldest = sb.client.get(f"/v1/executions/{exs[0]['id']}").json()
    assert oldest["stdout"] == "" and oldest["stdoutTruncated"] is True
    assert oldest["tailsDropped"] is True
    assert oldest["stdoutBytes"] == 20000 and oldest["exitCode"] == 0
    newest = sb.client.get(f"/v1/executions/{exs[2]['id']}").json()
    assert newest["stdout"] == "c" * 20000
    # the full output of the oldest is still on disk, readable by cursor
    page = sb.client.get(
        f"/v1/executions/{exs[0]['id']}/output", params={"maxBytes": 1 << 20}
    ).json()
    assert "".join(c["data"] for c in page["chunks"]) == "a" * 20000


def test_concurrent_answers_never_lose_their_output(fresh: Callable[..., Sandbox]) -> None:
    """Commands ending together, whose tails together pass the budget for
    finished records, each answer with their whole output: the budget drops
    only tails no request is waiting for, and says so when it does."""
    sb = fresh(
        env={
            "SANDBOX_AGENT_LOG_MEMORY_BYTES": "1000",  # logs spill: tails become buffers
            "SANDBOX_AGENT_CAPTURE_MEMORY_TOTAL_BYTES": "100000",
        }
    )
    letters = "abcdefghijkl"
    # Started together, ended together (each waits for the same file).
    command = "while [ ! -e go ]; do sleep 0.05; done; head -c 30000 /dev/zero | tr '\\0' {}"
    with concurrent.futures.ThreadPoolExecutor(len(letters)) as pool:
        futures = [pool.submit(sb.sh, command.format(c)) for c in letters]
        wait_until(lambda: len(sb.client.get("/v1/executions").json()["executions"]) == 12)
        (sb.workspace / "go").touch()
        answers = [f.result() for f in futures]
    for answer, c in zip(answers, letters, strict=True):
        assert answer["stdout"] == c * 30000, (c, answer["stdout"][:20], answer["stdoutBytes"])
        assert answer["tailsDropped"] is False
    # Afterwards the budget holds: most of them kept no tails, and say so.
    later = [sb.client.get(f"/v1/executions/{a['id']}").json() for a in answers]
    dropped = [e for e in later if e["tailsDropped"]]
    assert len(dropped) >= len(letters) - 100000 // 30000
    assert all(e["stdout"] == "" and e["stdoutBytes"] == 30000 for e in dropped)


def test_info_reports_the_runners_cgroup_counters(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(runner=False)
    # A cgroup v1 layout as a container sees it: the pod's PID limit refused 7
    # forks, the CPU limit throttled 12 of 40 periods (1.5 s).
    cgroup = sb.root / "cgroup"
    (cgroup / "pids").mkdir(parents=True)
    (cgroup / "cpu,cpuacct").mkdir()
    (cgroup / "pids" / "pids.current").write_text("3\n")
    (cgroup / "pids" / "pids.max").write_text("max\n")
    (cgroup / "pids" / "pids.events").write_text("max 7\n")
    (cgroup / "cpu,cpuacct" / "cpu.stat").write_text(
        "nr_periods 40\nnr_throttled 12\nthrottled_time 1500000000\n"
    )
    sb.start_runner(extra_env={"SANDBOX_RUNNER_CGROUP_ROOT": str(cgroup)})
    limits = sb.client.get("/v1/info").json()["limits"]
    assert limits == {
        "pidsCurrent": 3,
        "pidsLimit": None,
        "pidsRefused": 7,
        "cpuPeriods": 40,
        "cpuThrottledPeriods": 12,
        "cpuThrottledSeconds": 1.5,
    }
    # Counters move: read on every call, not at the hello.
    (cgroup / "pids" / "pids.events").write_text("max 9\n")
    assert sb.client.get("/v1/info").json()["limits"]["pidsRefused"] == 9
    # No runner, no counters (and no wait for one).
    sb.runner.kill()
    sb.runner.wait()
    wait_until(lambda: not sb.client.get("/v1/info").json()["runnerConnected"], 10)
    assert sb.client.get("/v1/info").json()["limits"] is None


def test_info_reports_cgroup_v2_counters(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(runner=False)
    cgroup = sb.root / "cgroup2"
    cgroup.mkdir()
    (cgroup / "pids.current").write_text("5\n")
    (cgroup / "pids.max").write_text("2048\n")
    (cgroup / "pids.events").write_text("max 0\n")
    (cgroup / "cpu.stat").write_text(
        "usage_usec 100\nnr_periods 10\nnr_throttled 0\nthrottled_usec 0\n"
    )
    sb.start_runner(extra_env={"SANDBOX_RUNNER_CGROUP_ROOT": str(cgroup)})
    limits = sb.client.get("/v1/info").json()["limits"]
    assert limits == {
        "pidsCurrent": 5,
        "pidsLimit": 2048,
        "pidsRefused": 0,
        "cpuPeriods": 10,
        "cpuThrottledPeriods": 0,
        "cpuThrottledSeconds": 0.0,
    }
