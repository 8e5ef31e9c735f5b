"""E2B's filesystem through the adapter, with E2B's own Python SDK, unchanged.

Expects a fixture `e2b_sandbox`: an `e2b.Sandbox` (sync) connected through the
gateway's E2B listener to a running Sandbox, whose workspace is the E2B home
(any mount path: the tests ask the sandbox for it), with its own workspace
(the tests write and remove files in it). Its data-plane requests may go by
`E2B_SANDBOX_URL` (the E2b-Sandbox-Id / -Port headers) or by host
(`{port}-{id}.{domain}`): the signed-URL tests send the E2b-Sandbox-Id header
themselves, which a host-routed request does not need and does not mind.

What they cover: write and read (text, bytes, 10 MiB, gzip both ways),
write_files, list with depth (entries as envd orders them), exists, get_info,
make_dir, rename, remove, watch_dir (polled watcher: create, write, rename,
remove; recursive), signed download and upload URLs (and an expired one), and
the refusals: a path outside the workspace, '..', the root user, a missing file.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2b import FileNotFoundException, FilesystemEventType, FileType, Sandbox
from e2b.exceptions import InvalidArgumentException, SandboxException
from e2b.sandbox.filesystem.filesystem import WriteEntry

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def sbx(e2b_sandbox: Sandbox) -> Sandbox:
    return e2b_sandbox


@pytest.fixture
def home(sbx: Sandbox) -> str:
    """The E2B home: the workspace's mount path in the sandbox container."""
    path: str = sbx.files.get_info("").path
    assert path.startswith("/"), path
    return path


@pytest.fixture
def workdir(sbx: Sandbox) -> Iterator[str]:
    """A fresh directory (relative to the home) for one test, removed after it."""
    name = f"e2b-files-{uuid.uuid4().hex[:8]}"
    assert sbx.files.make_dir(name) is True
    yield name
    sbx.files.remove(name)


def test_write_and_read_text_bytes_and_large_files(sbx: Sandbox, home: str, workdir: str) -> None:
    info = sbx.files.write(f"{workdir}/hello.txt", "héllo wörld\n")
    assert (info.path, info.name, info.type) == (
        f"{home}/{workdir}/hello.txt",
        "hello.txt",
        FileType.FILE,
    )
    assert sbx.files.read(f"{workdir}/hello.txt") == "héllo wörld\n"
    assert sbx.files.read(f"{home}/{workdir}/hello.txt") == "héllo wörld\n"  # absolute
    assert sbx.files.read(f"~/{workdir}/hello.txt") == "héllo wörld\n"

    data = os.urandom(10 << 20)
    started = time.monotonic()
    sbx.files.write(f"{workdir}/big.bin", data)
    back = sbx.files.read(f"{workdir}/big.bin", format="bytes")
    print(f"\n10 MiB written and read back in {time.monotonic() - started:.2f} s")
    assert isinstance(back, bytearray)
    assert bytes(back) == data
    assert bytes(sbx.files.read(f"{workdir}/big.bin", format="bytes", gzip=True)) == data
    streamed = b"".join(sbx.files.read(f"{workdir}/big.bin", format="stream"))
    assert streamed == data

    sbx.files.write(f"{workdir}/empty", b"")
    assert sbx.files.read(f"{workdir}/empty") == ""
    # Overwriting replaces; missing parents are made.
    sbx.files.write(f"{workdir}/hello.txt", "second")
    sbx.files.write(f"{workdir}/a/b/c.txt", "deep")
    assert sbx.files.read(f"{workdir}/hello.txt") == "second"
    assert sbx.files.read(f"{workdir}/a/b/c.txt") == "deep"


def test_write_files(sbx: Sandbox, home: str, workdir: str) -> None:
    assert sbx.files.write_files([]) == []
    entries = [WriteEntry(path=f"{workdir}/m/{i}.txt", data=f"file {i}") for i in range(5)]
    written = sbx.files.write_files(entries)
    assert [w.path for w in written] == [f"{home}/{workdir}/m/{i}.txt" for i in range(5)]
    for i in range(5):
        assert sbx.files.read(f"{workdir}/m/{i}.txt") == f"file {i}"


def test_list_exists_info_make_dir_rename_remove(sbx: Sandbox, home: str, workdir: str) -> None:
    for sub in ("d1/d11", "d1/d12", "d2"):
        sbx.files.make_dir(f"{workdir}/{sub}")
    sbx.files.write(f"{workdir}/f.txt", "12345")
    top = [(e.name, e.type) for e in sbx.files.list(workdir)]
    assert top == [("d1", FileType.DIR), ("d2", FileType.DIR), ("f.txt", FileType.FILE)]
    deep = [e.path for e in sbx.files.list(workdir, depth=2)]
    base = f"{home}/{workdir}"
    assert deep == [f"{base}/d1", f"{base}/d1/d11", f"{base}/d1/d12", f"{base}/d2", f"{base}/f.txt"]
    with pytest.raises(InvalidArgumentException):
        sbx.files.list(workdir, depth=0)

    assert sbx.files.exists(f"{workdir}/f.txt")
    assert sbx.files.exists(f"{workdir}/d1")
    assert not sbx.files.exists(f"{workdir}/nothing")
    info = sbx.files.get_info(f"{workdir}/f.txt")
    assert (info.name, info.type, info.path, info.size) == (
        "f.txt",
        FileType.FILE,
        f"{base}/f.txt",
        5,
    )
    assert info.permissions[0] == "-"
    assert len(info.permissions) == 10
    assert info.modified_time.tzinfo is not None
    assert sbx.files.get_info(f"{workdir}/d1").type == FileType.DIR
    with pytest.raises(FileNotFoundException):
        sbx.files.get_info(f"{workdir}/nothing")

    assert sbx.files.make_dir(f"{workdir}/d2") is False  # already there
    moved = sbx.files.rename(f"{workdir}/f.txt", f"{workdir}/d2/moved/g.txt")
    assert (moved.path, moved.name) == (f"{base}/d2/moved/g.txt", "g.txt")
    assert not sbx.files.exists(f"{workdir}/f.txt")
    with pytest.raises(FileNotFoundException):
        sbx.files.rename(f"{workdir}/f.txt", f"{workdir}/again.txt")

    sbx.files.remove(f"{workdir}/d1")  # recursive, as E2B's
    sbx.files.remove(f"{workdir}/never-was")  # nothing there: no error
    assert [e.name for e in sbx.files.list(workdir)] == ["d2"]


def names(events: list[Any]) -> list[tuple[FilesystemEventType, str]]:
    return [(e.type, e.name) for e in events]


def test_watch_dir(sbx: Sandbox, workdir: str) -> None:
    sbx.files.write(f"{workdir}/old.txt", "x")
    handle = sbx.files.watch_dir(workdir)
    sbx.files.write(f"{workdir}/new.txt", "content")
    assert names(handle.get_new_events()) == [
        (FilesystemEventType.CREATE, "new.txt"),
        (FilesystemEventType.CHMOD, "new.txt"),
        (FilesystemEventType.WRITE, "new.txt"),
    ]
    sbx.files.write(f"{workdir}/old.txt", "changed")
    assert (FilesystemEventType.WRITE, "old.txt") in names(handle.get_new_events())
    sbx.files.rename(f"{workdir}/old.txt", f"{workdir}/renamed.txt")
    sbx.files.remove(f"{workdir}/new.txt")
    assert names(handle.get_new_events()) == [
        (FilesystemEventType.RENAME, "old.txt"),
        (FilesystemEventType.CREATE, "renamed.txt"),
        (FilesystemEventType.REMOVE, "new.txt"),
    ]
    handle.stop()
    with pytest.raises(SandboxException):
        handle.get_new_events()

    recursive = sbx.files.watch_dir(workdir, recursive=True)
    sbx.files.make_dir(f"{workdir}/sub")
    sbx.files.write(f"{workdir}/sub/inner.txt", "inner")
    seen = names(recursive.get_new_events())
    assert (FilesystemEventType.CREATE, "sub") in seen
    assert (FilesystemEventType.WRITE, "sub/inner.txt") in seen
    recursive.stop()

    with pytest.raises(FileNotFoundException):
        sbx.files.watch_dir(f"{workdir}/nothing")
    with pytest.raises(SandboxException):
        sbx.files.watch_dir(f"{workdir}/renamed.txt")  # a file


def fetch(sbx: Sandbox, url: str, **kwargs: Any) -> httpx.Response:
    """A request to a signed URL as a browser would make it (no access token),
    naming the sandbox as the SDK's own requests do when E2B_SANDBOX_URL is set."""
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
    return httpx.request(kwargs.pop("method", "GET"), url, headers=headers, timeout=60, **kwargs)


def test_signed_urls(sbx: Sandbox, workdir: str) -> None:
    sbx.files.write(f"{workdir}/signed.txt", "for a link")
    for url in (
        sbx.download_url(f"{workdir}/signed.txt"),
        sbx.download_url(f"{workdir}/signed.txt", "user"),
        sbx.download_url(f"{workdir}/signed.txt", use_signature_expiration=120),
    ):
        r = fetch(sbx, url)
        assert (r.status_code, r.text) == (200, "for a link")
    expired = fetch(sbx, sbx.download_url(f"{workdir}/signed.txt", use_signature_expiration=-120))
    assert expired.status_code == 401
    assert expired.json() == {"code": 401, "message": "signature is already expired"}
    other = sbx.download_url(f"{workdir}/signed.txt").replace("signed.txt", "other.txt", 1)
    assert fetch(sbx, other).json() == {"code": 401, "message": "invalid signature"}
    # A read URL does not write.
    read_url = sbx.download_url(f"{workdir}/up.txt")
    refused = fetch(sbx, read_url, method="POST", files={"file": ("up.txt", b"no")})
    assert refused.status_code == 401

    upload = sbx.upload_url(f"{workdir}/up.txt")
    r = fetch(sbx, upload, method="POST", files={"file": ("up.txt", b"uploaded by link")})
    assert r.status_code == 200, r.text
    assert r.json()[0]["path"].endswith(f"/{workdir}/up.txt")
    assert sbx.files.read(f"{workdir}/up.txt") == "uploaded by link"


def test_refusals(sbx: Sandbox, home: str, workdir: str) -> None:
    with pytest.raises(SandboxException, match="outside the sandbox's workspace"):
        sbx.files.read("/etc/passwd")
    with pytest.raises(SandboxException, match="outside the sandbox's workspace"):
        sbx.files.list("/")
    for bad in ("../x", f"{workdir}/../../x", f"{workdir}/%2e%2e/x"):
        with pytest.raises(InvalidArgumentException):
            sbx.files.get_info(bad)
        with pytest.raises(InvalidArgumentException):
            sbx.files.write(bad, "x")
    with pytest.raises(SandboxException, match="root"):
        sbx.files.read(f"{workdir}/x", user="root")
    with pytest.raises(SandboxException, match="root"):
        sbx.files.list(workdir, user="root")
    with pytest.raises(FileNotFoundException):
        sbx.files.read(f"{workdir}/missing.txt")
    with pytest.raises(InvalidArgumentException):
        sbx.files.read(workdir)  # a directory
    # A file URL without its signature, and no token: refused before anything.
    unsigned = sbx.download_url(f"{workdir}/x").split("&signature=")[0]
    assert fetch(sbx, unsigned).status_code == 401
    # With the token: a route is matched on the path as sent, never a decoded one.
    base = unsigned.split("/files?")[0]
    headers = {
        **sbx.connection_config.sandbox_headers,
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "E2b-Sandbox-Port": "49983",
    }
    sbx.files.write(f"{workdir}/plain.txt", "plain")
    plain = httpx.get(f"{base}/files", params={"path": f"{workdir}/plain.txt"}, headers=headers)
    assert (plain.status_code, plain.text) == (200, "plain")
    for raw in ("/%66iles", "/files%2F%2e%2e", "/%2e%2e/files"):
        r = httpx.get(f"{base}{raw}", params={"path": f"{workdir}/plain.txt"}, headers=headers)
        assert r.status_code == 400, (raw, r.status_code, r.text)
        assert "without percent-encoding" in r.json()["message"]
