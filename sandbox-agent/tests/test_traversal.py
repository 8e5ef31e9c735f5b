"""Hostile paths, symlink escapes and hostile tar entries: all refused, nothing escapes."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import Sandbox

REFUSED = {"path_traversal", "invalid_path", "path_escape"}

HOSTILE_PATHS = [
    "../etc/passwd",
    "../../../../../../etc/passwd",
    "/etc/passwd",
    "//etc/passwd",
    "/",
    "..",
    "../",
    "./../outside",
    "a/../../outside",
    "a/b/../../../outside",
    "x/..",  # stays inside, but '..' is refused outright
    "%2e%2e/etc/passwd",  # arrives as literal %2e after the one decode
    "%2e%2e%2fetc%2fpasswd",
    "..%2fetc%2fpasswd",
    "%252e%252e%252fetc%252fpasswd",  # double encoded
    "%2fetc%2fpasswd",
    "..\\..\\etc\\passwd",
    "a\\..\\..\\b",
    "foo/\x00/bar",
    "a\x00b",
    "/proc/self/environ",
    "~/../../etc/passwd",
    "a/" * 3000 + "x",  # over the length limit
]

# (method, path, how the hostile path is passed)
OPS: list[tuple[str, str, str]] = [
    ("GET", "/v1/files/content", "query"),
    ("GET", "/v1/files/stat", "query"),
    ("GET", "/v1/files/list", "query"),
    ("GET", "/v1/files/archive", "query"),
    ("PUT", "/v1/files/content", "query"),
    ("POST", "/v1/files/write", "json:path"),
    ("POST", "/v1/files/mkdir", "json:path"),
    ("POST", "/v1/files/remove", "json:path"),
    ("POST", "/v1/files/move", "json:source"),
    ("POST", "/v1/files/move", "json:destination"),
    ("POST", "/v1/files/search", "json:path"),
    ("POST", "/v1/files/find", "json:path"),
    ("POST", "/v1/files/replace", "json:path"),
    ("POST", "/v1/executions", "json:cwd"),
]


def _call(sb: Sandbox, method: str, url: str, how: str, path: str) -> httpx.Response:
    if how == "query":
        return sb.client.request(method, url, params={"path": path}, content=b"pwned")
    field = how.split(":", 1)[1]
    bodies: dict[str, dict[str, Any]] = {
        "/v1/files/write": {"path": "ok.txt", "content": "pwned"},
        "/v1/files/mkdir": {"path": "ok"},
        "/v1/files/remove": {"path": "ok", "recursive": True},
        "/v1/files/move": {"source": "ok-src", "destination": "ok-dst"},
        "/v1/files/search": {"pattern": "root"},
        "/v1/files/find": {"pattern": "*"},
        "/v1/files/replace": {"path": "ok.txt", "find": "a", "replace": "b"},
        "/v1/executions": {"command": "echo pwned > pwned.txt"},
    }
    body = bodies[url]
    return sb.client.request(method, url, json={**body, field: path})


@pytest.mark.parametrize("path", HOSTILE_PATHS, ids=lambda p: repr(p[:40]))
@pytest.mark.parametrize(("method", "url", "how"), OPS, ids=lambda x: str(x))
def test_hostile_paths_refused(
    sandbox: Sandbox, method: str, url: str, how: str, path: str
) -> None:
    r = _call(sandbox, method, url, how, path)
    assert 400 <= r.status_code < 500, r.text
    body = r.json()
    allowed = set(REFUSED)
    if len(path) > 4096 and how != "query":
        allowed.add("invalid_request")  # the JSON schema's maxLength catches it first
    assert body["error"]["code"] in allowed, body


@pytest.mark.parametrize(
    "raw_query",
    [
        "path=..%2F..%2Fetc%2Fpasswd",
        "path=%2Fetc%2Fpasswd",
        "path=..%252F..%252Fetc%252Fpasswd",
        "path=%2E%2E/%2E%2E/etc/passwd",
        "path=a%00b",
        "path=..%5C..%5Cetc",
    ],
)
def test_raw_percent_encoded_queries_refused(sandbox: Sandbox, raw_query: str) -> None:
    for url in ("/v1/files/content", "/v1/files/stat", "/v1/files/list"):
        r = sandbox.client.get(f"{url}?{raw_query}")
        assert 400 <= r.status_code < 500, (url, raw_query, r.text)
        assert r.json()["error"]["code"] in REFUSED


@pytest.fixture
def escapes(sandbox: Sandbox, wsdir: str) -> tuple[Sandbox, str, Path]:
    """Symlinks inside the workspace that point outside it."""
    outside = sandbox.root / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "secret.txt").write_text("TOP SECRET")
    d = sandbox.workspace / wsdir
    os.symlink(outside, d / "abs_escape")
    os.symlink(os.path.relpath(outside, d), d / "rel_escape")
    os.symlink(outside / "secret.txt", d / "file_escape")
    os.symlink("../../..", d / "up_escape")
    return sandbox, wsdir, outside


def test_symlink_escapes_refused(escapes: tuple[Sandbox, str, Path]) -> None:
    sb, w, outside = escapes
    before = sorted(p.name for p in outside.iterdir())
    cases: list[tuple[str, str, dict[str, Any]]] = []
    for ln in ("abs_escape", "rel_escape", "up_escape"):
        cases += [
            ("GET", "/v1/files/content", {"params": {"path": f"{w}/{ln}/secret.txt"}}),
            ("GET", "/v1/files/list", {"params": {"path": f"{w}/{ln}"}}),
            ("GET", "/v1/files/stat", {"params": {"path": f"{w}/{ln}/secret.txt"}}),
            ("GET", "/v1/files/archive", {"params": {"path": f"{w}/{ln}"}}),
            (
                "PUT",
                "/v1/files/content",
                {"params": {"path": f"{w}/{ln}/new.txt"}, "content": b"x"},
            ),
            ("POST", "/v1/files/mkdir", {"json": {"path": f"{w}/{ln}/newdir"}}),
            ("POST", "/v1/files/remove", {"json": {"path": f"{w}/{ln}/secret.txt"}}),
            (
                "POST",
                "/v1/files/move",
                {"json": {"source": f"{w}/{ln}/secret.txt", "destination": f"{w}/stolen"}},
            ),
            ("POST", "/v1/files/search", {"json": {"pattern": "SECRET", "path": f"{w}/{ln}"}}),
            ("POST", "/v1/files/find", {"json": {"pattern": "*", "path": f"{w}/{ln}"}}),
            ("POST", "/v1/executions", {"json": {"command": "cat secret.txt", "cwd": f"{w}/{ln}"}}),
            (
                "PUT",
                "/v1/files/archive",
                {"params": {"path": f"{w}/{ln}"}, "content": _tar({"a": b"x"})},
            ),
        ]
    cases += [
        ("GET", "/v1/files/content", {"params": {"path": f"{w}/file_escape"}}),
        (
            "POST",
            "/v1/files/replace",
            {"json": {"path": f"{w}/file_escape", "find": "TOP", "replace": "X"}},
        ),
        ("POST", "/v1/files/search", {"json": {"pattern": "SECRET", "path": f"{w}/file_escape"}}),
    ]
    for method, url, kw in cases:
        r = sb.client.request(method, url, **kw)
        assert r.status_code in (400, 403), (method, url, kw, r.text)
        assert r.json()["error"]["code"] in REFUSED, (url, r.text)
    assert (outside / "secret.txt").read_text() == "TOP SECRET"
    assert sorted(p.name for p in outside.iterdir()) == before


def test_links_themselves_are_handled_not_followed(escapes: tuple[Sandbox, str, Path]) -> None:
    sb, w, outside = escapes
    # stat shows the link; remove removes only the link; listing does not descend
    st = sb.client.get("/v1/files/stat", params={"path": f"{w}/abs_escape"}).json()
    assert st["type"] == "symlink"
    listing = sb.client.get("/v1/files/list", params={"path": w, "depth": 5}).json()
    assert not any("secret" in e["path"] for e in listing["entries"])
    found = sb.client.post("/v1/files/find", json={"pattern": "secret*", "path": w}).json()
    assert found["paths"] == []
    hits = sb.client.post("/v1/files/search", json={"pattern": "SECRET", "path": w}).json()
    assert hits["matches"] == []
    # writing onto a link replaces the link, never the file it points to
    sb.write(f"{w}/file_escape", b"replaced")
    assert (outside / "secret.txt").read_text() == "TOP SECRET"
    r = sb.client.post("/v1/files/remove", json={"path": f"{w}/abs_escape", "recursive": True})
    assert r.status_code == 200
    assert (outside / "secret.txt").exists()
    # a directory download stores links as links, never their targets' content
    tar_bytes = sb.client.get("/v1/files/archive", params={"path": w}).content
    assert b"TOP SECRET" not in tar_bytes


def _tar(files: dict[str, bytes], extra: Callable[[tarfile.TarFile], None] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
        if extra:
            extra(tar)
    return buf.getvalue()


def _entry(
    name: str, kind: bytes, link: str = "", data: bytes = b""
) -> Callable[[tarfile.TarFile], None]:
    def add(tar: tarfile.TarFile) -> None:
        ti = tarfile.TarInfo(name)
        ti.type = kind
        ti.linkname = link
        ti.size = len(data)
        if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
            ti.devmajor, ti.devminor = 1, 3
        tar.addfile(ti, io.BytesIO(data) if data else None)

    return add


def _pax_path_entry(tar: tarfile.TarFile) -> None:
    """An innocent ustar name overridden by a PAX 'path' record that escapes."""
    ti = tarfile.TarInfo("innocent.txt")
    ti.size = 1
    ti.pax_headers = {"path": "../pax-evil"}
    tar.addfile(ti, io.BytesIO(b"x"))


HOSTILE_TAR_ENTRIES: list[tuple[str, Callable[[tarfile.TarFile], None]]] = [
    ("dotdot", _entry("../evil", tarfile.REGTYPE, data=b"x")),
    ("deep-dotdot", _entry("../../../../tmp/evil", tarfile.REGTYPE, data=b"x")),
    ("absolute", _entry("/tmp/evil-abs", tarfile.REGTYPE, data=b"x")),
    ("inner-dotdot", _entry("a/../../evil", tarfile.REGTYPE, data=b"x")),
    ("dot-slash-dotdot", _entry("./../evil", tarfile.REGTYPE, data=b"x")),
    ("nested-dotdot", _entry("a/b/../../../evil", tarfile.REGTYPE, data=b"x")),
    ("bare-dotdot-dir", _entry("..", tarfile.DIRTYPE)),
    ("dotdot-dir", _entry("../evildir", tarfile.DIRTYPE)),
    ("backslash", _entry("..\\..\\evil", tarfile.REGTYPE, data=b"x")),
    ("symlink-absolute", _entry("ln", tarfile.SYMTYPE, link="/etc/passwd")),
    ("symlink-up", _entry("ln", tarfile.SYMTYPE, link="../../outside")),
    ("symlink-nested-up", _entry("a/b/ln", tarfile.SYMTYPE, link="../../../..")),
    ("symlink-dotdot-name", _entry("../ln", tarfile.SYMTYPE, link="x")),
    ("hardlink-absolute", _entry("hl", tarfile.LNKTYPE, link="/etc/passwd")),
    ("hardlink-up", _entry("hl", tarfile.LNKTYPE, link="../outside/secret.txt")),
    ("hardlink-not-in-archive", _entry("hl", tarfile.LNKTYPE, link="somewhere/else")),
    ("char-device", _entry("null2", tarfile.CHRTYPE)),
    ("block-device", _entry("sda2", tarfile.BLKTYPE)),
    ("fifo", _entry("pipe", tarfile.FIFOTYPE)),
    ("pax-path-override", _pax_path_entry),
]


@pytest.mark.parametrize(
    ("label", "entry"), HOSTILE_TAR_ENTRIES, ids=[e[0] for e in HOSTILE_TAR_ENTRIES]
)
def test_hostile_tar_entries_refused(
    sandbox: Sandbox, wsdir: str, label: str, entry: Callable[[tarfile.TarFile], None]
) -> None:
    data = _tar({"first.txt": b"ok"}, entry)
    r = sandbox.client.put("/v1/files/archive", params={"path": f"{wsdir}/dest"}, content=data)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "archive_entry_refused"
    # validated before anything is written
    assert not (sandbox.workspace / wsdir / "dest" / "first.txt").exists()
    assert not (sandbox.workspace / wsdir / "evil").exists()
    assert not Path("/tmp/evil-abs").exists()


def test_tar_through_planted_symlink_refused(escapes: tuple[Sandbox, str, Path]) -> None:
    sb, w, outside = escapes
    data = _tar({"abs_escape/pwned.txt": b"x", "rel_escape/pwned.txt": b"x"})
    r = sb.client.put("/v1/files/archive", params={"path": w}, content=data)
    assert r.status_code in (400, 403) and r.json()["error"]["code"] in REFUSED | {
        "archive_entry_refused"
    }
    assert not (outside / "pwned.txt").exists()
