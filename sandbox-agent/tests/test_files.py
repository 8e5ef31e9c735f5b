"""Files API against a real agent."""

from __future__ import annotations

import concurrent.futures
import os
import stat
import time
from collections.abc import Callable

import pytest
from conftest import Sandbox, rss_kib


def test_write_read_roundtrip_binary(sandbox: Sandbox, wsdir: str) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    info = sandbox.write(f"{wsdir}/a/b/blob.bin", data)
    assert info["type"] == "file" and info["size"] == len(data)
    assert info["path"] == f"{wsdir}/a/b/blob.bin" and info["name"] == "blob.bin"
    r = sandbox.client.get("/v1/files/content", params={"path": f"{wsdir}/a/b/blob.bin"})
    assert r.content == data
    assert r.headers["x-file-size"] == str(len(data))
    assert (sandbox.workspace / wsdir / "a/b/blob.bin").read_bytes() == data


def test_a_small_file_rewritten_while_read_gives_whole_answers(
    sandbox: Sandbox, wsdir: str
) -> None:
    """A shell's `echo 1 > f` truncates, then writes: a read between the two
    finds the file shorter than its fstat said. The answer is what was read,
    with a length to match, never a length promised and a body cut short
    (the client's "peer closed connection without sending complete message
    body" in an e2e run that read a counter a loop kept rewriting)."""
    path = sandbox.workspace / wsdir / "count.txt"
    path.write_bytes(b"12")
    stop = time.monotonic() + 60

    def rewrite() -> None:
        while time.monotonic() < stop:
            with path.open("wb") as f:
                time.sleep(0.001)  # empty for a moment, as between a truncate and its write
                f.write(b"12")

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        writer = pool.submit(rewrite)
        try:
            bodies = set()
            for _ in range(300):
                r = sandbox.client.get("/v1/files/content", params={"path": f"{wsdir}/count.txt"})
                assert r.status_code == 200
                assert r.headers["content-length"] == str(len(r.content))
                bodies.add(r.content)
        finally:
            stop = time.monotonic()
            writer.result()
    assert bodies <= {b"", b"12"}


def test_written_files_are_group_writable(sandbox: Sandbox, wsdir: str) -> None:
    info = sandbox.write(f"{wsdir}/new/file.txt", b"x")
    assert info["mode"] == "0664"  # umask 002: the sandbox user shares our group
    assert stat.S_IMODE((sandbox.workspace / wsdir / "new").stat().st_mode) == 0o775


def test_write_with_mode_and_mode_is_kept_on_overwrite(sandbox: Sandbox, wsdir: str) -> None:
    r = sandbox.client.put(
        "/v1/files/content",
        params={"path": f"{wsdir}/run.sh", "mode": "0750"},
        content=b"#!/bin/sh\n",
    )
    assert r.json()["mode"] == "0750"
    info = sandbox.write(f"{wsdir}/run.sh", b"#!/bin/sh\necho hi\n")
    assert info["mode"] == "0750"
    r = sandbox.client.put(
        "/v1/files/content", params={"path": f"{wsdir}/x", "mode": "999"}, content=b""
    )
    assert sandbox.error(r, 400) == "invalid_request"


def test_writes_never_leave_set_id_bits(sandbox: Sandbox, wsdir: str) -> None:
    """Files the agent writes are the agent's: a set-id bit would let code in the
    sandbox run as the agent's user."""
    for mode in ("4755", "2755", "6777", "7777"):
        r = sandbox.client.put(
            "/v1/files/content", params={"path": f"{wsdir}/s", "mode": mode}, content=b"x"
        )
        assert sandbox.error(r, 400) == "invalid_mode", mode
        r = sandbox.client.post("/v1/files/write", json={"path": f"{wsdir}/s", "mode": mode})
        assert sandbox.error(r, 400) == "invalid_mode", mode
        r = sandbox.client.post("/v1/files/mkdir", json={"path": f"{wsdir}/sd", "mode": mode})
        assert sandbox.error(r, 400) == "invalid_mode", mode
    assert not (sandbox.workspace / wsdir / "s").exists()
    assert not (sandbox.workspace / wsdir / "sd").exists()
    # A planted set-id file that is overwritten, or edited in place, loses the bits.
    planted = sandbox.workspace / wsdir / "planted"
    for edit in ("write", "replace"):
        planted.write_bytes(b"old\n")
        planted.chmod(0o6755)
        if edit == "write":
            info = sandbox.write(f"{wsdir}/planted", b"new\n")
        else:
            r = sandbox.client.post(
                "/v1/files/replace",
                json={"path": f"{wsdir}/planted", "find": "old", "replace": "new"},
            )
            assert r.status_code == 200, r.text
            info = sandbox.client.get("/v1/files/stat", params={"path": f"{wsdir}/planted"}).json()
        assert int(info["mode"], 8) & 0o7000 == 0, (edit, info)
        assert stat.S_IMODE(planted.stat().st_mode) & 0o7755 == 0o755, edit
        assert planted.read_bytes() == b"new\n"


def test_write_without_parents_fails_cleanly(sandbox: Sandbox, wsdir: str) -> None:
    r = sandbox.client.put(
        "/v1/files/content", params={"path": f"{wsdir}/no/such/f", "parents": "false"}, content=b"x"
    )
    assert sandbox.error(r, 404) == "not_found"


def test_write_is_atomic_no_temp_files_left(sandbox: Sandbox, wsdir: str) -> None:
    for i in range(5):
        sandbox.write(f"{wsdir}/f.txt", f"v{i}".encode())
    assert sorted(p.name for p in (sandbox.workspace / wsdir).iterdir()) == ["f.txt"]
    assert sandbox.read(f"{wsdir}/f.txt") == b"v4"


def test_write_over_directory_refused(sandbox: Sandbox, wsdir: str) -> None:
    (sandbox.workspace / wsdir / "d").mkdir()
    r = sandbox.client.put("/v1/files/content", params={"path": f"{wsdir}/d"}, content=b"x")
    assert sandbox.error(r, 400) == "is_a_directory"
    r = sandbox.client.put("/v1/files/content", params={"path": "."}, content=b"x")
    assert sandbox.error(r, 400) == "invalid_path"


def test_json_write(sandbox: Sandbox, wsdir: str) -> None:
    r = sandbox.client.post(
        "/v1/files/write", json={"path": f"{wsdir}/j.txt", "content": "héllo", "mode": "0600"}
    )
    assert r.status_code == 200 and r.json()["mode"] == "0600"
    assert sandbox.read(f"{wsdir}/j.txt") == "héllo".encode()
    r = sandbox.client.post(
        "/v1/files/write", json={"path": f"{wsdir}/b.bin", "contentBase64": "AAEC/w=="}
    )
    assert sandbox.read(f"{wsdir}/b.bin") == b"\x00\x01\x02\xff"
    r = sandbox.client.post(
        "/v1/files/write", json={"path": f"{wsdir}/c", "content": "a", "contentBase64": "YQ=="}
    )
    assert sandbox.error(r, 400) == "invalid_request"


def test_byte_range_and_line_range(sandbox: Sandbox, wsdir: str) -> None:
    sandbox.write(f"{wsdir}/lines.txt", b"".join(b"line %d\n" % i for i in range(1, 101)))
    p = f"{wsdir}/lines.txt"
    assert sandbox.read(p, offset=5, length=3) == b"1\nl"
    assert sandbox.read(p, offset=10_000) == b""
    assert sandbox.read(p, startLine=10, lineCount=2) == b"line 10\nline 11\n"
    assert sandbox.read(p, startLine=99) == b"line 99\nline 100\n"
    assert sandbox.read(p, lineCount=1) == b"line 1\n"
    r = sandbox.client.get("/v1/files/content", params={"path": p, "offset": 1, "startLine": 2})
    assert sandbox.error(r, 400) == "invalid_request"
    r = sandbox.client.get("/v1/files/content", params={"path": p, "startLine": 0})
    assert sandbox.error(r, 400) == "invalid_request"
    r = sandbox.client.get("/v1/files/content", params={"path": p, "offset": -3})
    assert sandbox.error(r, 400) == "invalid_request"


def test_read_errors(sandbox: Sandbox, wsdir: str) -> None:
    r = sandbox.client.get("/v1/files/content", params={"path": f"{wsdir}/missing"})
    assert sandbox.error(r, 404) == "not_found"
    r = sandbox.client.get("/v1/files/content", params={"path": wsdir})
    assert sandbox.error(r, 400) == "is_a_directory"
    os.mkfifo(sandbox.workspace / wsdir / "fifo")
    r = sandbox.client.get("/v1/files/content", params={"path": f"{wsdir}/fifo"})
    assert sandbox.error(r, 400) == "not_a_file"
    r = sandbox.client.get("/v1/files/content")
    assert sandbox.error(r, 400) == "invalid_request"


def test_stat_and_symlink_stat(sandbox: Sandbox, wsdir: str) -> None:
    sandbox.write(f"{wsdir}/f", b"12345")
    os.symlink("f", sandbox.workspace / wsdir / "link")
    st = sandbox.client.get("/v1/files/stat", params={"path": f"{wsdir}/f"}).json()
    assert st["type"] == "file" and st["size"] == 5 and st["modifiedAt"].endswith("Z")
    ln = sandbox.client.get("/v1/files/stat", params={"path": f"{wsdir}/link"}).json()
    assert ln["type"] == "symlink" and ln["symlinkTarget"] == "f"
    root = sandbox.client.get("/v1/files/stat", params={"path": "."}).json()
    assert root["type"] == "directory" and root["path"] == "."
    r = sandbox.client.get("/v1/files/stat", params={"path": f"{wsdir}/nope"})
    assert sandbox.error(r, 404) == "not_found"


def test_list_with_depth_and_hidden(sandbox: Sandbox, wsdir: str) -> None:
    for p in ("a/b/c/deep.txt", "a/top.txt", ".hidden/x", "z.txt"):
        sandbox.write(f"{wsdir}/{p}", b"x")
    one = sandbox.client.get("/v1/files/list", params={"path": wsdir}).json()
    assert [e["name"] for e in one["entries"]] == [".hidden", "a", "z.txt"]
    assert one["truncated"] is False
    two = sandbox.client.get("/v1/files/list", params={"path": wsdir, "depth": 2}).json()
    assert f"{wsdir}/a/top.txt" in [e["path"] for e in two["entries"]]
    assert f"{wsdir}/a/b/c/deep.txt" not in [e["path"] for e in two["entries"]]
    deep = sandbox.client.get(
        "/v1/files/list", params={"path": wsdir, "depth": 10, "hidden": "false"}
    ).json()
    paths = [e["path"] for e in deep["entries"]]
    assert f"{wsdir}/a/b/c/deep.txt" in paths and not any(".hidden" in p for p in paths)
    r = sandbox.client.get("/v1/files/list", params={"path": f"{wsdir}/z.txt"})
    assert sandbox.error(r, 400) == "not_a_directory"
    r = sandbox.client.get("/v1/files/list", params={"path": wsdir, "depth": 0})
    assert sandbox.error(r, 400) == "invalid_request"


def test_mkdir(sandbox: Sandbox, wsdir: str) -> None:
    r = sandbox.client.post("/v1/files/mkdir", json={"path": f"{wsdir}/x/y", "mode": "0700"})
    assert r.json()["type"] == "directory" and r.json()["mode"] == "0700"
    r = sandbox.client.post("/v1/files/mkdir", json={"path": f"{wsdir}/x/y", "existOk": False})
    assert sandbox.error(r, 409) == "already_exists"
    r = sandbox.client.post("/v1/files/mkdir", json={"path": f"{wsdir}/p/q", "parents": False})
    assert sandbox.error(r, 404) == "not_found"
    sandbox.write(f"{wsdir}/file", b"")
    r = sandbox.client.post("/v1/files/mkdir", json={"path": f"{wsdir}/file/sub"})
    assert 400 <= r.status_code < 500


def test_remove(sandbox: Sandbox, wsdir: str) -> None:
    sandbox.write(f"{wsdir}/d/e/f", b"x")
    r = sandbox.client.post("/v1/files/remove", json={"path": f"{wsdir}/d"})
    assert sandbox.error(r, 409) == "directory_not_empty"
    r = sandbox.client.post("/v1/files/remove", json={"path": f"{wsdir}/d", "recursive": True})
    assert r.json() == {"path": f"{wsdir}/d", "removed": True}
    assert not (sandbox.workspace / wsdir / "d").exists()
    r = sandbox.client.post("/v1/files/remove", json={"path": f"{wsdir}/d"})
    assert sandbox.error(r, 404) == "not_found"
    r = sandbox.client.post("/v1/files/remove", json={"path": f"{wsdir}/d", "missingOk": True})
    assert r.json()["removed"] is False
    r = sandbox.client.post("/v1/files/remove", json={"path": ".", "recursive": True})
    assert sandbox.error(r, 400) == "invalid_path"


def test_remove_symlink_removes_link_not_target(sandbox: Sandbox, wsdir: str) -> None:
    sandbox.write(f"{wsdir}/target/keep", b"x")
    os.symlink("target", sandbox.workspace / wsdir / "ln")
    r = sandbox.client.post("/v1/files/remove", json={"path": f"{wsdir}/ln", "recursive": True})
    assert r.status_code == 200
    assert (sandbox.workspace / wsdir / "target/keep").exists()


def test_move(sandbox: Sandbox, wsdir: str) -> None:
    sandbox.write(f"{wsdir}/a.txt", b"A")
    sandbox.write(f"{wsdir}/b.txt", b"B")
    r = sandbox.client.post(
        "/v1/files/move", json={"source": f"{wsdir}/a.txt", "destination": f"{wsdir}/b.txt"}
    )
    assert sandbox.error(r, 409) == "already_exists"
    r = sandbox.client.post(
        "/v1/files/move",
        json={"source": f"{wsdir}/a.txt", "destination": f"{wsdir}/b.txt", "overwrite": True},
    )
    assert r.status_code == 200 and sandbox.read(f"{wsdir}/b.txt") == b"A"
    r = sandbox.client.post(
        "/v1/files/move", json={"source": f"{wsdir}/b.txt", "destination": f"{wsdir}/n/e/w.txt"}
    )
    assert r.json()["path"] == f"{wsdir}/n/e/w.txt"
    r = sandbox.client.post(
        "/v1/files/move", json={"source": f"{wsdir}/nope", "destination": f"{wsdir}/x"}
    )
    assert sandbox.error(r, 404) == "not_found"
    r = sandbox.client.post(
        "/v1/files/move", json={"source": f"{wsdir}/n", "destination": f"{wsdir}/n/inside"}
    )
    assert sandbox.error(r, 400) == "invalid_operation"
    r = sandbox.client.post("/v1/files/move", json={"source": ".", "destination": "x"})
    assert sandbox.error(r, 400) == "invalid_path"


def test_search(sandbox: Sandbox, wsdir: str) -> None:
    sandbox.write(f"{wsdir}/src/a.py", b"import os\ndef Foo():\n    return 'foo'\n")
    sandbox.write(f"{wsdir}/src/b.txt", b"nothing\nfoo bar\n")
    sandbox.write(f"{wsdir}/src/bin.dat", b"foo\x00\x01\x02")
    sandbox.write(f"{wsdir}/.git/config", b"foo")
    body = {"pattern": "foo", "path": wsdir, "ignoreCase": True}
    res = sandbox.client.post("/v1/files/search", json=body).json()
    found = {(m["path"].split("/", 1)[1], m["line"]) for m in res["matches"]}
    assert found == {("src/a.py", 2), ("src/a.py", 3), ("src/b.txt", 2)}
    assert res["filesSkipped"] == 1  # the binary file
    assert res["truncated"] is False
    res = sandbox.client.post("/v1/files/search", json={**body, "includeHidden": True}).json()
    assert any(".git/config" in m["path"] for m in res["matches"])
    res = sandbox.client.post("/v1/files/search", json={**body, "glob": "*.py"}).json()
    assert {m["path"].rsplit("/", 1)[1] for m in res["matches"]} == {"a.py"}
    res = sandbox.client.post("/v1/files/search", json={**body, "maxResults": 1}).json()
    assert len(res["matches"]) == 1 and res["truncated"] is True
    m = sandbox.client.post(
        "/v1/files/search", json={"pattern": r"def \w+\(", "path": f"{wsdir}/src/a.py"}
    ).json()["matches"][0]
    assert (m["line"], m["column"], m["text"]) == (2, 1, "def Foo():")
    res = sandbox.client.post(
        "/v1/files/search", json={"pattern": "((", "path": wsdir, "fixedString": True}
    ).json()
    assert res["matches"] == []
    r = sandbox.client.post("/v1/files/search", json={"pattern": "(", "path": wsdir})
    assert sandbox.error(r, 400) == "invalid_regex"


def test_search_is_per_line_without_a_copy_per_line(fresh: Callable[..., Sandbox]) -> None:
    """Lines as before (`^`, `$`, CRLF, nothing across a newline), but a file
    of millions of short lines costs no object per line, and line ranges are
    found without walking lines one by one."""
    sb = fresh()
    sb.write("crlf.txt", b"one x\r\ntwo\r\nx\r\n")
    found = sb.client.post("/v1/files/search", json={"pattern": "x$"}).json()["matches"]
    assert [(m["path"], m["line"], m["column"], m["text"]) for m in found] == [
        ("crlf.txt", 1, 5, "one x"),
        ("crlf.txt", 3, 1, "x"),
    ]
    sb.write("lines.txt", b"ab\ncd\nab cd\n")
    found = sb.client.post(
        "/v1/files/search", json={"pattern": r"b\s*c", "path": "lines.txt"}
    ).json()["matches"]
    assert [(m["line"], m["column"]) for m in found] == [(3, 2)]  # not across lines 1-2
    found = sb.client.post("/v1/files/search", json={"pattern": "^cd", "path": "lines.txt"}).json()[
        "matches"
    ]
    assert [m["line"] for m in found] == [2]
    lines = (4 << 20) - 8  # 8 MiB in all, the largest file search reads
    (sb.workspace / "short.txt").write_bytes(b"a\n" * lines + b"needle\n")
    assert sb.agent is not None
    before = rss_kib(sb.agent.pid)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(
            pool.map(
                lambda _: sb.client.post(
                    "/v1/files/search", json={"pattern": "needle", "path": "short.txt"}
                ).json(),
                range(2),
            )
        )
    for res in answers:
        assert [m["line"] for m in res["matches"]] == [lines + 1], res
    assert rss_kib(sb.agent.pid) - before < 64 * 1024  # was +166 MiB per search
    some = sb.client.post(
        "/v1/files/search", json={"pattern": "^a$", "path": "short.txt", "maxResults": 3}
    ).json()
    assert [m["line"] for m in some["matches"]] == [1, 2, 3] and some["truncated"] is True
    (sb.workspace / "newlines.txt").write_bytes(b"\n" * (32 << 20))
    t = time.monotonic()
    r = sb.client.get(
        "/v1/files/content", params={"path": "newlines.txt", "startLine": (32 << 20) + 5}
    )
    assert r.status_code == 200 and r.content == b""
    r = sb.client.get(
        "/v1/files/content",
        params={"path": "newlines.txt", "startLine": (32 << 20) - 1, "lineCount": 5},
    )
    assert r.content == b"\n\n"
    assert time.monotonic() - t < 15  # ~0.1 s; line by line, these two took ~20 s


def test_search_skips_oversized_files(fresh: object) -> None:
    sb = fresh(env={"SANDBOX_AGENT_SEARCH_MAX_FILE_BYTES": "100"})  # type: ignore[operator]
    sb.write("small.txt", b"needle\n")
    sb.write("big.txt", b"needle\n" * 100)
    res = sb.client.post("/v1/files/search", json={"pattern": "needle"}).json()
    assert [m["path"] for m in res["matches"]] == ["small.txt"]
    assert res["filesSkipped"] == 1


def test_find(sandbox: Sandbox, wsdir: str) -> None:
    for p in ("a.py", "pkg/b.py", "pkg/sub/c.py", "pkg/readme.md"):
        sandbox.write(f"{wsdir}/{p}", b"")
    res = sandbox.client.post("/v1/files/find", json={"pattern": "*.py", "path": wsdir}).json()
    assert sorted(p.split("/", 1)[1] for p in res["paths"]) == ["a.py", "pkg/b.py", "pkg/sub/c.py"]
    res = sandbox.client.post(
        "/v1/files/find", json={"pattern": "*.py", "path": wsdir, "maxDepth": 2}
    ).json()
    assert sorted(p.split("/", 1)[1] for p in res["paths"]) == ["a.py", "pkg/b.py"]
    res = sandbox.client.post("/v1/files/find", json={"pattern": "pkg/*.md", "path": wsdir}).json()
    assert [p.split("/", 1)[1] for p in res["paths"]] == ["pkg/readme.md"]
    res = sandbox.client.post(
        "/v1/files/find", json={"pattern": "*", "path": wsdir, "type": "directory"}
    ).json()
    assert sorted(p.split("/", 1)[1] for p in res["paths"]) == ["pkg", "pkg/sub"]
    res = sandbox.client.post(
        "/v1/files/find", json={"pattern": "*", "path": wsdir, "maxResults": 2}
    ).json()
    assert len(res["paths"]) == 2 and res["truncated"] is True
    r = sandbox.client.post("/v1/files/find", json={"pattern": "*", "path": f"{wsdir}/a.py"})
    assert sandbox.error(r, 400) == "not_a_directory"


def test_replace(sandbox: Sandbox, wsdir: str) -> None:
    p = f"{wsdir}/code.py"
    sandbox.write(p, b"x = 1\ny = 1\nz = 2\n")
    r = sandbox.client.post("/v1/files/replace", json={"path": p, "find": "= 1", "replace": "= 9"})
    assert sandbox.error(r, 409) == "ambiguous_match"
    assert r.json()["error"]["details"]["found"] == 2
    r = sandbox.client.post("/v1/files/replace", json={"path": p, "find": "nope", "replace": ""})
    assert sandbox.error(r, 409) == "no_match"
    r = sandbox.client.post(
        "/v1/files/replace", json={"path": p, "find": "= 1", "replace": "= 9", "expectedCount": 3}
    )
    assert sandbox.error(r, 409) == "match_count_mismatch"
    r = sandbox.client.post(
        "/v1/files/replace", json={"path": p, "find": "= 1", "replace": "= 9", "all": True}
    )
    assert r.json() == {"path": p, "replacements": 2}
    r = sandbox.client.post(
        "/v1/files/replace", json={"path": p, "find": "z = 2", "replace": "z=3"}
    )
    assert r.json()["replacements"] == 1
    r = sandbox.client.post(
        "/v1/files/replace",
        json={"path": p, "find": r"^(\w) = 9$", "replace": r"\1 = 0", "regex": True, "all": True},
    )
    assert r.json()["replacements"] == 2
    assert sandbox.read(p) == b"x = 0\ny = 0\nz=3\n"
    sandbox.write(f"{wsdir}/bin", b"\xff\xfe")
    r = sandbox.client.post(
        "/v1/files/replace", json={"path": f"{wsdir}/bin", "find": "a", "replace": "b"}
    )
    assert sandbox.error(r, 400) == "not_text"


PATCH = """\
diff --git a/{d}/hello.py b/{d}/hello.py
index 1111111..2222222 100644
--- a/{d}/hello.py
+++ b/{d}/hello.py
@@ -1,4 +1,4 @@
 import sys
-print("hello")
+print("hello, world")
 x = 1
 y = 2
@@ -8,3 +8,4 @@ def f():
 a
 b
 c
+d
--- /dev/null
+++ b/{d}/new.txt
@@ -0,0 +1,2 @@
+fresh
+file
"""


def test_patch_apply_create_and_dry_run(sandbox: Sandbox, wsdir: str) -> None:
    original = b'import sys\nprint("hello")\nx = 1\ny = 2\n\ndef f():\n    pass\na\nb\nc\n'
    sandbox.write(f"{wsdir}/hello.py", original)
    patch = PATCH.format(d=wsdir)
    r = sandbox.client.post("/v1/files/patch", json={"patch": patch, "dryRun": True})
    assert r.status_code == 200, r.text
    assert r.json()["dryRun"] is True
    assert sandbox.read(f"{wsdir}/hello.py") == original
    r = sandbox.client.post("/v1/files/patch", json={"patch": patch})
    files = {f["path"]: (f["status"], f["hunks"]) for f in r.json()["files"]}
    assert files == {f"{wsdir}/hello.py": ("modified", 2), f"{wsdir}/new.txt": ("created", 1)}
    assert (
        sandbox.read(f"{wsdir}/hello.py")
        == original.replace(b'"hello"', b'"hello, world"') + b"d\n"
    )
    assert sandbox.read(f"{wsdir}/new.txt") == b"fresh\nfile\n"
    # applying again: the context no longer matches, nothing is written
    r = sandbox.client.post("/v1/files/patch", json={"patch": patch})
    assert sandbox.error(r, 409) == "patch_conflict"


def test_patch_conflict_is_all_or_nothing(sandbox: Sandbox, wsdir: str) -> None:
    sandbox.write(f"{wsdir}/one.txt", b"a\nb\nc\n")
    sandbox.write(f"{wsdir}/two.txt", b"x\ny\nz\n")
    patch = (
        f"--- a/{wsdir}/one.txt\n+++ b/{wsdir}/one.txt\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n"
        f"--- a/{wsdir}/two.txt\n+++ b/{wsdir}/two.txt\n@@ -1,3 +1,3 @@\n x\n-NOT THERE\n+Y\n z\n"
    )
    r = sandbox.client.post("/v1/files/patch", json={"patch": patch})
    assert sandbox.error(r, 409) == "patch_conflict"
    details = r.json()["error"]["details"]
    assert details["path"] == f"{wsdir}/two.txt" and details["hunk"] == 1
    assert sandbox.read(f"{wsdir}/one.txt") == b"a\nb\nc\n"


def test_patch_with_drift_and_no_newline_and_delete(sandbox: Sandbox, wsdir: str) -> None:
    sandbox.write(f"{wsdir}/f.txt", b"new first line\n1\n2\n3")
    patch = (
        f"--- {wsdir}/f.txt\n+++ {wsdir}/f.txt\n@@ -1,3 +1,3 @@\n 1\n 2\n-3\n"
        "\\ No newline at end of file\n+three\n"
    )
    r = sandbox.client.post("/v1/files/patch", json={"patch": patch})
    assert r.status_code == 200, r.text
    assert sandbox.read(f"{wsdir}/f.txt") == b"new first line\n1\n2\nthree\n"
    sandbox.write(f"{wsdir}/gone.txt", b"bye\n")
    patch = f"--- a/{wsdir}/gone.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-bye\n"
    r = sandbox.client.post("/v1/files/patch", json={"patch": patch})
    assert r.json()["files"][0]["status"] == "deleted"
    assert not (sandbox.workspace / wsdir / "gone.txt").exists()


@pytest.mark.parametrize(
    "patch",
    [
        "not a patch at all",
        "@@ -1 +1 @@\n-a\n+b\n",
        "--- a/x\n+++ b/x\n@@ -1,5 +1,5 @@\n-a\n+b\n",
        "--- a/x\n+++ b/x\n@@ -1 +1 @@\n?weird\n",
    ],
)
def test_patch_invalid(sandbox: Sandbox, patch: str) -> None:
    r = sandbox.client.post("/v1/files/patch", json={"patch": patch})
    assert sandbox.error(r, 400) == "invalid_patch"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("@@ -x +y @@\n-a\n+A\n", "malformed hunk header at line 3"),
        ("@@ -1,2 +1,2 @@\n-a\n+A\n b\n@@ broken\n-c\n+C\n", "line 7"),
        ("@@ -1 +1 @@\n-a\n+A\n-b\n+B\n", "line 6"),
        ("", "has no hunks"),
    ],
)
def test_a_malformed_patch_writes_nothing_and_names_the_line(
    sandbox: Sandbox, wsdir: str, body: str, says: str
) -> None:
    original = b"a\nb\nc\n"
    sandbox.write(f"{wsdir}/m.txt", original)
    before = (sandbox.workspace / wsdir / "m.txt").stat().st_mtime_ns
    patch = f"--- a/{wsdir}/m.txt\n+++ b/{wsdir}/m.txt\n{body}"
    r = sandbox.client.post("/v1/files/patch", json={"patch": patch})
    assert sandbox.error(r, 400) == "invalid_patch"
    assert says in r.json()["error"]["message"], r.text
    assert sandbox.read(f"{wsdir}/m.txt") == original
    assert (sandbox.workspace / wsdir / "m.txt").stat().st_mtime_ns == before


def test_a_format_patch_mail_applies(sandbox: Sandbox, wsdir: str) -> None:
    """`git format-patch` output: prose with dashes before, a signature after."""
    sandbox.write(f"{wsdir}/mail.txt", b"a\nb\n")
    patch = (
        "Subject: [PATCH] b\n\n- fixes b\n---\n mail.txt | 2 +-\n\n"
        f"diff --git a/{wsdir}/mail.txt b/{wsdir}/mail.txt\n"
        f"--- a/{wsdir}/mail.txt\n+++ b/{wsdir}/mail.txt\n@@ -1,2 +1,2 @@\n a\n-b\n+B\n"
        "-- \n2.39.5\n"
    )
    r = sandbox.client.post("/v1/files/patch", json={"patch": patch})
    assert r.status_code == 200, r.text
    assert sandbox.read(f"{wsdir}/mail.txt") == b"a\nB\n"


def test_patch_paths_are_confined(sandbox: Sandbox) -> None:
    patch = "--- a/../../etc/passwd\n+++ b/../../etc/passwd\n@@ -1 +1 @@\n-root\n+evil\n"
    r = sandbox.client.post("/v1/files/patch", json={"patch": patch})
    assert sandbox.error(r, 400) == "path_traversal"
    patch = "--- /dev/null\n+++ /etc/evil\n@@ -0,0 +1 @@\n+x\n"
    r = sandbox.client.post("/v1/files/patch", json={"patch": patch, "strip": 0})
    assert sandbox.error(r, 400) == "path_traversal"


def test_large_file_streams(sandbox: Sandbox, wsdir: str) -> None:
    data = os.urandom(64 * 1024 * 1024)
    sandbox.write(f"{wsdir}/big", data)
    with sandbox.client.stream("GET", "/v1/files/content", params={"path": f"{wsdir}/big"}) as r:
        assert r.headers["content-length"] == str(len(data))
        got = b"".join(r.iter_bytes())
    assert got == data
    part = sandbox.read(f"{wsdir}/big", offset=10 << 20, length=5 << 20)
    assert part == data[10 << 20 : 15 << 20]


def test_workspace_sync(sandbox: Sandbox) -> None:
    r = sandbox.client.post("/v1/workspace/sync")
    assert r.status_code == 200 and r.json()["synced"] is True
