"""Memory and disk budgets follow the container's limits."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
from collections.abc import Callable
from pathlib import Path

from conftest import Sandbox, rss_kib

from sandbox_agent.config import MiB, Settings, derive_budgets, load


def test_budgets_derive_from_the_memory_limit_unless_set() -> None:
    s = load({"SANDBOX_AGENT_MEMORY_LIMIT_BYTES": str(256 * MiB)})
    assert s.memory_limit_bytes == 256 * MiB
    assert s.max_concurrent_executions == 16
    assert MiB <= s.max_capture_bytes < 2 * MiB  # a 1 MiB output still fits whole
    assert s.log_memory_total_bytes == s.capture_memory_total_bytes == 16 * MiB
    assert s.malloc_keep_bytes == 32 * MiB
    explicit = load(
        {
            "SANDBOX_AGENT_MEMORY_LIMIT_BYTES": str(256 * MiB),
            "SANDBOX_AGENT_MAX_CAPTURE_BYTES": str(4 * MiB),
        }
    )
    assert explicit.max_capture_bytes == 4 * MiB
    # a large limit keeps the plain defaults
    big = derive_budgets(64 << 30)
    d = Settings()
    assert big["max_capture_bytes"] == d.max_capture_bytes
    assert big["max_concurrent_executions"] == d.max_concurrent_executions


def test_output_floods_stay_inside_a_256mib_budget(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(memory_limit_bytes=256 * MiB, max_log_dir_bytes=96 * MiB)
    assert sb.agent is not None
    before = rss_kib(sb.agent.pid)
    peak = before

    def flood(_: int) -> str:
        r = sb.client.post(
            "/v1/executions",
            json={"command": "yes AAAAAAAAAAAAAAAAAAAAAAAAAAAAAA | head -c 67108864"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return str(r.json()["status"])

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(flood, i) for i in range(16)]
        while not all(f.done() for f in futures):
            peak = max(peak, rss_kib(sb.agent.pid))
            concurrent.futures.wait(futures, timeout=0.02)
        assert [f.result() for f in futures] == ["completed"] * 16
    assert (peak - before) < 96 * 1024, (before, peak)
    du = sum(p.stat().st_blocks * 512 for p in sb.logs.rglob("*") if p.is_file())
    # the logs' budget, plus the journal and block rounding
    assert du <= 97 * MiB, du


def test_archive_uploads_are_spooled_in_the_workspace(fresh: Callable[..., Sandbox]) -> None:
    """Not in the agent's /tmp, a small volume in a pod (filling it evicts the pod)."""
    import io
    import os
    import tarfile
    import time
    from collections.abc import Iterator

    sb = fresh(runner=False)
    assert sb.agent is not None
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        ti = tarfile.TarInfo("big.bin")
        ti.size = 8 * MiB
        tar.addfile(ti, io.BytesIO(b"z" * ti.size))
    data = buf.getvalue()
    seen: list[str] = []

    def body() -> Iterator[bytes]:
        yield data[: len(data) // 2]
        time.sleep(0.5)  # the first half is spooled by now
        fds = Path(f"/proc/{sb.agent.pid}/fd")  # type: ignore[union-attr]
        for fd in fds.iterdir():
            with contextlib.suppress(OSError):
                seen.append(os.readlink(fd))
        yield data[len(data) // 2 :]

    r = sb.client.put("/v1/files/archive", params={"path": "up"}, content=body())
    assert r.status_code == 200, r.text
    spools = [t for t in seen if t.endswith("(deleted)")]
    assert spools and all(t.startswith(str(sb.workspace)) for t in spools), seen


def test_tiny_output_records_page_in_bounded_chunks(fresh: Callable[..., Sandbox]) -> None:
    """A command alternating 1-byte writes to stdout and stderr (its runner not
    coalescing them: the image sets that) makes one record per write; a page
    holds at most 4,096 chunks whatever its bytes, every byte is read back by
    cursor, and writes to one stream become few records."""
    sb = fresh(runner=False)
    sb.start_runner(extra_env={"SANDBOX_RUNNER_LINGER_MS": "0"})
    pairs, single = 20_000, 5_000
    # Slow enough that the runner reads (nearly) every write on its own.
    script = (
        "import os, time\n"
        f"for i in range({pairs}):\n"
        "    os.write(1, b'o'); os.write(2, b'e'); time.sleep(0.0002)\n"
        f"for i in range({single}):\n"
        "    os.write(1, b'x'); time.sleep(0.0002)\n"
    )
    done = sb.run(command=f'python3 -c "{script}"', timeoutSeconds=120)
    assert done["exitCode"] == 0 and done["stdoutBytes"] == pairs + single, done
    out, err, cursor, chunks = bytearray(), bytearray(), 0, 0
    while True:
        page = sb.client.get(
            f"/v1/executions/{done['id']}/output",
            params={"cursor": cursor, "maxBytes": 1 << 20, "encoding": "base64"},
        ).json()
        assert len(page["chunks"]) <= 4096
        chunks += len(page["chunks"])
        for c in page["chunks"]:
            (out if c["stream"] == "stdout" else err).extend(base64.b64decode(c["dataBase64"]))
        cursor = page["cursor"]
        if page["finished"]:
            break
    assert chunks > 4096  # the premise: many more records than one page holds
    assert bytes(out) == b"o" * pairs + b"x" * single
    assert bytes(err) == b"e" * pairs
    # The stdout-only writes were merged into records as they came: the log
    # holds far fewer than one 6-byte header per byte of them.
    assert done["outputCursor"] < 2 * pairs * 7 + 2 * single, done["outputCursor"]


def test_edits_work_on_bytes_within_the_memory_budget(fresh: Callable[..., Sandbox]) -> None:
    """replace and patch hold a file as bytes, never as one str (four bytes a
    character once it holds one astral character) or one object per line,
    and refuse what the budget cannot hold with 413 naming the limit."""
    sb = fresh(memory_limit_bytes=256 * MiB)
    limit = 16 * MiB  # a sixteenth of the memory limit
    big = sb.workspace / "big.txt"
    with big.open("wb") as f:
        f.truncate(15 * MiB)  # zeros: valid UTF-8, nothing to read from disk
        f.seek(15 * MiB)
        f.write("\N{GRINNING FACE} X\n".encode())
    assert sb.agent is not None
    before = rss_kib(sb.agent.pid)
    r = sb.client.post("/v1/files/replace", json={"path": "big.txt", "find": "X", "replace": "Y"})
    assert r.status_code == 200, r.text
    assert rss_kib(sb.agent.pid) - before < 64 * 1024  # was ~4 copies of 60 MiB
    assert big.read_bytes()[-3:] == b" Y\n"
    with big.open("ab") as f:
        f.truncate(limit + 1)
    r = sb.client.post("/v1/files/replace", json={"path": "big.txt", "find": "Y", "replace": "Z"})
    assert sb.error(r, 413) == "file_too_large" and str(limit) in r.json()["error"]["message"]
    # Short lines: a one-line patch of a file of millions of lines is refused
    # by its number of lines, not OOM-killed building a list of them.
    (sb.workspace / "short.txt").write_bytes(b"a\n" * (4 << 20))
    diff = "--- a/short.txt\n+++ b/short.txt\n@@ -1,1 +1,1 @@\n-a\n+b\n"
    r = sb.client.post("/v1/files/patch", json={"patch": diff})
    assert sb.error(r, 413) == "patch_too_large", r.text
    assert str(limit // 64) in r.json()["error"]["message"]
    (sb.workspace / "ok.txt").write_bytes("é\n".encode() * 1000)
    diff = "--- a/ok.txt\n+++ b/ok.txt\n@@ -2,1 +2,1 @@\n-é\n+\N{GRINNING FACE}\n"
    r = sb.client.post("/v1/files/patch", json={"patch": diff})
    assert r.status_code == 200, r.text
    assert (sb.workspace / "ok.txt").read_text().splitlines()[:3] == ["é", "\N{GRINNING FACE}", "é"]
