"""Code in the sandbox rewrites the workspace while the agent works on it.

Races are run as a real command through the agent and the runner (a loop
that swaps a directory for a symlink, or a file for a FIFO), against a
bounded number of API calls; every call must hold: zero leaks, not "rarely".
"""

from __future__ import annotations

import io
import os
import socket
import stat
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import Sandbox, rss_kib

SWAP_DIR = """
import os, shutil, sys, time
os.chdir(sys.argv[1])
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    try:
        os.mkdir("d.new")
        with open("d.new/f.txt", "w") as f:
            f.write("INSIDE\\n")
        os.rename("d.new", "d.tmp")
        if os.path.islink("d"):
            os.unlink("d")
        os.rename("d.tmp", "d")
        os.symlink(sys.argv[2], "l.tmp")
        shutil.rmtree("d")
        os.rename("l.tmp", "d")
    except OSError:
        for junk in ("d.new", "d.tmp", "l.tmp"):
            if os.path.islink(junk):
                os.unlink(junk)
            elif os.path.isdir(junk):
                shutil.rmtree(junk, ignore_errors=True)
"""

SWAP_FIFO = """
import os, sys, time
os.chdir(sys.argv[1])
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    try:
        with open("f.tmp", "w") as f:
            f.write("plain NEEDLE\\n")
        os.rename("f.tmp", "f.txt")
        os.mkfifo("p.tmp")
        os.rename("p.tmp", "f.txt")
    except OSError:
        pass
"""


def _swapper(sb: Sandbox, wsdir: str, script: str, *args: str) -> str:
    (sb.workspace / wsdir / "swap.py").write_text(script)
    ex = sb.run(
        expect=202,
        command=f"exec python3 swap.py . {' '.join(args)}",
        cwd=wsdir,
        background=True,
    )
    return str(ex["id"])


@pytest.fixture
def outside(sandbox: Sandbox) -> Path:
    d = sandbox.root / f"outside-{os.urandom(4).hex()}"
    d.mkdir()
    (d / "f.txt").write_text("OUTSIDE SECRET\n")
    (d / "only-outside.txt").write_text("OUTSIDE SECRET\n")
    return d


def test_search_list_find_never_follow_a_swapped_symlink(
    sandbox: Sandbox, wsdir: str, outside: Path
) -> None:
    ex = _swapper(sandbox, wsdir, SWAP_DIR, str(outside), "60")
    leaks: list[str] = []
    try:
        time.sleep(0.3)
        for _ in range(150):
            r = sandbox.client.post("/v1/files/search", json={"pattern": "SECRET", "path": wsdir})
            assert r.status_code == 200, r.text
            if r.json()["matches"]:
                leaks.append(f"search: {r.json()['matches']}")
            r = sandbox.client.get("/v1/files/list", params={"path": wsdir, "depth": 3})
            assert r.status_code == 200, r.text
            names = [e["name"] for e in r.json()["entries"]]
            if "only-outside.txt" in names:
                leaks.append(f"list: {names}")
            r = sandbox.client.post("/v1/files/find", json={"pattern": "*.txt", "path": wsdir})
            assert r.status_code == 200, r.text
            if any("only-outside" in p for p in r.json()["paths"]):
                leaks.append(f"find: {r.json()['paths']}")
            r = sandbox.client.get("/v1/files/archive", params={"path": wsdir})
            assert r.status_code == 200
            with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
                if any("only-outside" in m.name for m in tar.getmembers()):
                    leaks.append("archive")
    finally:
        sandbox.client.post(f"/v1/executions/{ex}/cancel")
    assert leaks == []


def test_tar_upload_never_writes_through_a_swapped_parent(
    sandbox: Sandbox, wsdir: str, outside: Path
) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("d/", "d/deep/"):
            ti = tarfile.TarInfo(name)
            ti.type = tarfile.DIRTYPE
            tar.addfile(ti)
        for name in ("d/planted.txt", "d/deep/planted.txt"):
            ti = tarfile.TarInfo(name)
            ti.size = 3
            tar.addfile(ti, io.BytesIO(b"pwn"))
    data = buf.getvalue()
    before = sorted(p.name for p in outside.iterdir())
    ex = _swapper(sandbox, wsdir, SWAP_DIR, str(outside), "60")
    try:
        time.sleep(0.3)
        for _ in range(200):
            r = sandbox.client.put("/v1/files/archive", params={"path": wsdir}, content=data)
            assert r.status_code in (200, 400, 404, 409), r.text  # lost races are errors
    finally:
        sandbox.client.post(f"/v1/executions/{ex}/cancel")
    assert sorted(p.name for p in outside.iterdir()) == before
    staged = [p for p in (sandbox.workspace / wsdir).iterdir() if "extract" in p.name]
    assert staged == []


def test_search_skips_a_fifo_swapped_in(sandbox: Sandbox, wsdir: str) -> None:
    ex = _swapper(sandbox, wsdir, SWAP_FIFO, "60")
    try:
        time.sleep(0.3)
        for _ in range(100):
            r = sandbox.client.post(
                "/v1/files/search", json={"pattern": "NEEDLE", "path": wsdir}, timeout=5
            )
            assert r.status_code == 200, r.text
            r = sandbox.client.get(
                "/v1/files/content", params={"path": f"{wsdir}/f.txt"}, timeout=5
            )
            assert r.status_code in (200, 400, 404), r.text
    finally:
        sandbox.client.post(f"/v1/executions/{ex}/cancel")
    # a FIFO that stays put: refused at once, and the files API still answers
    os.mkfifo(sandbox.workspace / wsdir / "fifo")
    for _ in range(10):
        r = sandbox.client.get("/v1/files/content", params={"path": f"{wsdir}/fifo"}, timeout=5)
        assert sandbox.error(r, 400) == "not_a_file"
        r = sandbox.client.post("/v1/files/search", json={"pattern": "x", "path": wsdir}, timeout=5)
        assert r.status_code == 200
    assert sandbox.client.get("/v1/files/stat", params={"path": wsdir}).status_code == 200


def test_hard_link_to_an_outside_inode_is_not_read(
    sandbox: Sandbox, wsdir: str, outside: Path
) -> None:
    os.link(outside / "f.txt", sandbox.workspace / wsdir / "hard.txt")
    r = sandbox.client.get("/v1/files/content", params={"path": f"{wsdir}/hard.txt"})
    assert sandbox.error(r, 403) == "path_escape"
    r = sandbox.client.post("/v1/files/search", json={"pattern": "SECRET", "path": wsdir})
    assert r.json()["matches"] == []
    r = sandbox.client.get("/v1/files/archive", params={"path": wsdir})
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        assert "hard.txt" not in tar.getnames()


def test_catastrophic_regex_cannot_block_the_agent(sandbox: Sandbox, wsdir: str) -> None:
    (sandbox.workspace / wsdir / "a.txt").write_text(("a" * 25 + "b\n") * 20000)
    worst = 0.0
    stop = threading.Event()

    def probe() -> None:
        nonlocal worst
        with httpx.Client(base_url=sandbox.base_url) as c:
            while not stop.is_set():
                t = time.monotonic()
                assert c.get("/healthz").status_code == 200
                worst = max(worst, time.monotonic() - t)
                time.sleep(0.01)

    t = threading.Thread(target=probe)
    t.start()
    try:
        for pattern in ("(a+)+$", "(a|aa)+$", "(.*a){20}$"):
            r = sandbox.client.post(
                "/v1/files/search", json={"pattern": pattern, "path": wsdir}, timeout=20
            )
            assert r.status_code == 200, r.text
        r = sandbox.client.post(
            "/v1/files/replace",
            json={
                "path": f"{wsdir}/a.txt",
                "find": "(a+)+b$",
                "replace": "x",
                "regex": True,
                "all": True,
            },
            timeout=20,
        )
        assert r.status_code == 200, r.text
    finally:
        stop.set()
        t.join()
    assert worst < 0.5, worst
    # what a linear-time engine cannot do is a clear 400, not a hang
    r = sandbox.client.post("/v1/files/search", json={"pattern": "(a)\\1", "path": wsdir})
    assert sandbox.error(r, 400) == "invalid_regex"


def test_names_that_are_not_utf8(sandbox: Sandbox, wsdir: str) -> None:
    d = os.fsencode(sandbox.workspace / wsdir)
    with open(d + b"/caf\xe9.txt", "wb") as f:
        f.write(b"hello\n")
    os.mkdir(d + b"/dir\xff")
    r = sandbox.client.get("/v1/files/list", params={"path": wsdir})
    assert r.status_code == 200, r.text
    names = {e["name"] for e in r.json()["entries"]}
    assert {"caf\ufffd.txt", "dir\ufffd"} <= names
    r = sandbox.client.get("/v1/files/list", params={"path": wsdir, "depth": 2})
    assert r.status_code == 200, r.text
    r = sandbox.client.post("/v1/files/find", json={"pattern": "caf*", "path": wsdir})
    assert r.status_code == 200 and r.json()["paths"] == [f"{wsdir}/caf\ufffd.txt"]
    r = sandbox.client.post("/v1/files/search", json={"pattern": "hello", "path": wsdir})
    assert r.status_code == 200 and r.json()["matches"][0]["path"] == f"{wsdir}/caf\ufffd.txt"
    r = sandbox.client.get("/v1/files/archive", params={"path": wsdir})
    assert r.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:  # complete, names kept as bytes
        names = {os.fsencode(n) for n in tar.getnames()}
    assert {b"caf\xe9.txt", b"dir\xff"} <= names, names


def test_special_files_and_odd_paths_get_clear_answers(sandbox: Sandbox, wsdir: str) -> None:
    d = sandbox.workspace / wsdir
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(d / "sock"))
    os.symlink("/proc/1/root", d / "proc_root")
    deep = d
    for _ in range(150):
        deep = deep / "dddddddddd"
    os.makedirs(deep)
    (deep / "bottom.txt").write_text("bottom\n")
    # deeper than PATH_MAX in all (made by descriptor: no path that long exists)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(450):
        os.mkdir("eeeeeeeeee", dir_fd=fd)
        nxt = os.open("eeeeeeeeee", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(os.open("abyss.txt", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
    os.close(fd)
    try:
        r = sandbox.client.get("/v1/files/stat", params={"path": f"{wsdir}/sock"})
        assert r.status_code == 200 and r.json()["type"] == "other"
        r = sandbox.client.get("/v1/files/content", params={"path": f"{wsdir}/sock"})
        assert sandbox.error(r, 400) == "not_a_file"
        r = sandbox.client.get(
            "/v1/files/content", params={"path": f"{wsdir}/proc_root/etc/passwd"}
        )
        assert sandbox.error(r, 403) == "path_escape"
        r = sandbox.client.get("/v1/files/stat", params={"path": f"{wsdir}/proc_root"})
        assert r.status_code == 200 and r.json()["type"] == "symlink"
        answers = [
            sandbox.client.get("/v1/files/list", params={"path": wsdir, "depth": 64}),
            sandbox.client.post("/v1/files/find", json={"pattern": "*", "path": wsdir}),
            sandbox.client.post("/v1/files/search", json={"pattern": "x", "path": wsdir}),
            sandbox.client.get("/v1/files/archive", params={"path": wsdir}),
        ]
        for r in answers:
            assert r.status_code == 200, r.text
        rel = os.path.relpath(deep / "bottom.txt", sandbox.workspace)
        assert sandbox.read(rel) == b"bottom\n"
        too_deep = "/".join(["x"] * 2000)
        r = sandbox.client.get("/v1/files/stat", params={"path": too_deep})
        assert r.status_code in (400, 404), r.text
    finally:
        sock.close()


def test_api_edit_keeps_the_users_file_writable(sandbox: Sandbox, wsdir: str) -> None:
    p = sandbox.workspace / wsdir / "mine.txt"
    p.write_text("a\n")
    os.chown(p, 1000, 1000)
    os.chmod(p, 0o644)
    sandbox.write(f"{wsdir}/mine.txt", b"b\n")
    s = p.stat()
    assert stat.S_IMODE(s.st_mode) == 0o664 and s.st_gid == 1000, oct(s.st_mode)


def test_line_range_of_an_endless_line_is_bounded(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(runner=False)
    assert sb.agent is not None
    with open(sb.workspace / "sparse", "wb") as f:
        f.truncate(1 << 30)  # a GiB of zeros without a newline, for free
    before = rss_kib(sb.agent.pid)
    r = sb.client.get("/v1/files/content", params={"path": "sparse", "startLine": 2})
    assert r.status_code == 200 and r.content == b""
    r = sb.client.get("/v1/files/content", params={"path": "sparse", "lineCount": 1})
    assert sb.error(r, 413) == "read_too_large"
    assert rss_kib(sb.agent.pid) - before < 48 * 1024


def test_listing_a_huge_directory_stops_at_the_cap(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(runner=False, list_max_entries=100)
    d = sb.workspace / "many"
    d.mkdir()
    for i in range(20000):
        os.close(os.open(d / f"f{i}", os.O_CREAT | os.O_WRONLY, 0o644))
    r = sb.client.get("/v1/files/list", params={"path": "many"})
    assert r.status_code == 200
    body = r.json()
    assert body["truncated"] is True and len(body["entries"]) == 100


def _pax_tar(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for ti, data in members:
            tar.addfile(ti, io.BytesIO(data) if ti.isreg() else None)
    return buf.getvalue()


def _file(
    name: str, data: bytes = b"x", mode: int = 0o644, **pax: str
) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    ti.mode = mode
    ti.pax_headers = dict(pax)
    return ti, data


def test_tar_headers_are_bounded_before_they_are_read(fresh: Callable[..., Sandbox]) -> None:
    import gzip

    sb = fresh(runner=False)
    assert sb.agent is not None
    before = rss_kib(sb.agent.pid)
    # A 300 MiB PAX header that compresses to almost nothing.
    record = b"%d comment=%s\n"
    body = b"x" * (300 << 20)
    rec = record % (len(body) + 20, body)
    head = tarfile.TarInfo("././@PaxHeader")
    head.type = tarfile.XHDTYPE
    head.size = len(rec)
    raw = head.tobuf(tarfile.USTAR_FORMAT) + rec + b"\0" * (-len(rec) % 512)
    raw += _pax_tar([_file("after.txt")])
    del rec, body
    bomb = gzip.compress(raw, 1)
    del raw
    r = sb.client.put("/v1/files/archive", params={"path": "up"}, content=bomb)
    assert sb.error(r, 413) == "archive_too_large"
    # long names (PAX), many of them, each under the bound
    deep = "/".join(["n" * 200] * 19)
    many = [(tarfile.TarInfo(f"{deep}/{i:05d}"), b"") for i in range(2000)]
    r = sb.client.put("/v1/files/archive", params={"path": "up2"}, content=_pax_tar(many))
    assert r.status_code == 200, r.text
    assert rss_kib(sb.agent.pid) - before < 64 * 1024


def test_tar_modes_times_and_the_root(sandbox: Sandbox, wsdir: str) -> None:
    root = sandbox.workspace / wsdir
    os.chmod(root, 0o750)
    dot = tarfile.TarInfo(".")
    dot.type = tarfile.DIRTYPE
    dot.mode = 0o777
    data = _pax_tar(
        [
            (dot, b""),
            _file("suid", mode=0o4777),
            _file("sgid", mode=0o2775),
            _file("sticky-ww", mode=0o1666),
            _file("far-future", mtime="1e300"),
            _file("not-a-number", mtime="nan"),
            _file("negative", mtime="-5"),
        ]
    )
    r = sandbox.client.put("/v1/files/archive", params={"path": wsdir}, content=data)
    assert r.status_code == 200, r.text
    assert stat.S_IMODE(root.stat().st_mode) == 0o750
    for name in ("suid", "sgid", "sticky-ww"):
        mode = stat.S_IMODE((root / name).stat().st_mode)
        assert mode & 0o7002 == 0, (name, oct(mode))
    for name in ("far-future", "not-a-number", "negative"):
        assert 0 < (root / name).stat().st_mtime < time.time() + 60
        assert sandbox.client.get("/v1/files/stat", params={"path": f"{wsdir}/{name}"}).is_success


def test_rejected_archive_writes_nothing(sandbox: Sandbox, wsdir: str) -> None:
    fifo = tarfile.TarInfo("z-fifo")
    fifo.type = tarfile.FIFOTYPE
    data = _pax_tar([_file("first.txt"), _file("sub/second.txt"), (fifo, b"")])
    r = sandbox.client.put("/v1/files/archive", params={"path": wsdir}, content=data)
    assert sandbox.error(r, 400) == "archive_entry_refused"
    # truncated in the middle of a member's data
    good = _pax_tar([_file("first.txt"), _file("big.bin", b"y" * 100_000)])
    r = sandbox.client.put("/v1/files/archive", params={"path": wsdir}, content=good[:60_000])
    assert r.status_code == 400, r.text
    assert sorted(os.listdir(sandbox.workspace / wsdir)) == []


def test_stdin_for_a_runner_that_stops_reading_is_bounded(fresh: Callable[..., Sandbox]) -> None:
    import signal

    sb = fresh()
    assert sb.agent is not None and sb.runner is not None
    ex = sb.run(expect=202, command="sleep 30", stdinOpen=True, background=True)
    before = rss_kib(sb.agent.pid)
    sb.runner.send_signal(signal.SIGSTOP)  # a runner (user code) that reads nothing
    try:
        chunk = "x" * (4 << 20)
        statuses = []
        for _ in range(16):  # 64 MiB offered
            r = sb.client.post(f"/v1/executions/{ex['id']}/stdin", json={"data": chunk})
            statuses.append(r.status_code)
        assert 429 in statuses, statuses
        assert sb.error(r, 429) == "stdin_backlogged"
        assert rss_kib(sb.agent.pid) - before < 48 * 1024
    finally:
        sb.runner.send_signal(signal.SIGCONT)
    sb.client.post(f"/v1/executions/{ex['id']}/cancel")


def test_scripts_for_a_runner_that_stops_reading_are_bounded(
    fresh: Callable[..., Sandbox],
) -> None:
    """Commands sent while the runner reads nothing wait in a bounded queue:
    past it, 429 runner_backlogged, not an agent growing by each script."""
    import signal

    sb = fresh()
    assert sb.agent is not None and sb.runner is not None
    before = rss_kib(sb.agent.pid)
    sb.runner.send_signal(signal.SIGSTOP)
    script = "true\n# " + "x" * (4 << 20) + "\n"  # 4 MiB, sent to the runner whole
    try:
        statuses = []
        for _ in range(12):  # 48 MiB offered
            r = sb.client.post("/v1/executions", json={"command": script, "background": True})
            statuses.append(r.status_code)
        assert 429 in statuses, statuses
        assert sb.error(r, 429) == "runner_backlogged"
        assert rss_kib(sb.agent.pid) - before < 64 * 1024
    finally:
        sb.runner.send_signal(signal.SIGCONT)


def test_a_replacement_cannot_multiply_a_file_without_bound(fresh: Callable[..., Sandbox]) -> None:
    """Each of 32 Ki "x" replaced by 1 KiB would be 32 MiB: refused while it
    grows, past the 64 KiB a replaced file may have here."""
    sb = fresh(runner=False, search_max_file_bytes=8 << 10)  # files up to 64 KiB
    (sb.workspace / "x.txt").write_text("x" * (32 << 10))
    for regex, replace in ((False, "y" * 1024), (True, "y" * 1024), (True, "\\1" * 1024)):
        r = sb.client.post(
            "/v1/files/replace",
            json={
                "path": "x.txt",
                "find": "(x)" if regex else "x",
                "replace": replace,
                "all": True,
                "regex": regex,
            },
        )
        assert sb.error(r, 413) == "replace_too_large"
    assert (sb.workspace / "x.txt").read_text() == "x" * (32 << 10)
    r = sb.client.post(
        "/v1/files/replace",
        json={"path": "x.txt", "find": "(x)", "replace": "\\1\\1", "all": True, "regex": True},
    )
    assert r.status_code == 200, r.text
    assert (sb.workspace / "x.txt").read_text() == "x" * (64 << 10)
