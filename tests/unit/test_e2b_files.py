"""The E2B adapter's filesystem parts that need no sandbox: E2B paths onto the
workspace (and never out of it), users, EntryInfo in proto3 JSON, watch events,
request fields, signed URLs and download encodings."""

from __future__ import annotations

import base64
import hashlib

import pytest

from sandbox_operator.gateway.e2b import paths
from sandbox_operator.gateway.e2b.connect import ConnectError
from sandbox_operator.gateway.e2b.entries import entry_info, field, go_permissions, tree_order
from sandbox_operator.gateway.e2b.files import disposition, media_type, signature, wants_gzip
from sandbox_operator.gateway.e2b.watch import translate

HOME = "/home/user"


# -- paths ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "rel"),
    [
        ("", "."),
        (".", "."),
        ("~", "."),
        ("~/", "."),
        ("~/a/b.txt", "a/b.txt"),
        ("/home/user", "."),
        ("/home/user/", "."),
        ("/home/user/a.txt", "a.txt"),
        ("/home/user//a/./b/", "a/b"),
        ("a.txt", "a.txt"),
        ("a/b/c.txt", "a/b/c.txt"),
        ("./a//b/", "a/b"),
        ("100%.txt", "100%.txt"),  # not an escape: a literal name
        ("a%2Fb", "a%2Fb"),  # decodes to a/b, inside the workspace: the agent's name
        ("dir with spaces/ü.txt", "dir with spaces/ü.txt"),
    ],
)
def test_paths_map_onto_the_workspace(given: str, rel: str) -> None:
    assert paths.agent_path(given, HOME) == rel


@pytest.mark.parametrize(
    ("given", "code", "says"),
    [
        ("/etc/passwd", "permission_denied", "outside the sandbox's workspace /home/user"),
        ("/home/username/x", "permission_denied", "outside"),  # a prefix is not a parent
        ("/home", "permission_denied", "outside"),
        ("/", "permission_denied", "outside"),
        ("..", "invalid_argument", "'..'"),
        ("../x", "invalid_argument", "'..'"),
        ("a/../../x", "invalid_argument", "'..'"),
        ("/home/user/../user/x", "invalid_argument", "'..'"),
        ("~/../x", "invalid_argument", "'..'"),
        ("a/%2e%2e/b", "invalid_argument", "encoded"),
        ("a/%252e%252e/b", "invalid_argument", "encoded"),  # two layers
        ("%2Fetc/passwd", "invalid_argument", "encoded"),
        ("a/%5c..", "invalid_argument", "encoded"),
        ("a/%00", "invalid_argument", "encoded"),
        ("%25252525252e", "invalid_argument", "layers"),
        ("a\\..\\b", "invalid_argument", "backslash"),
        ("a\x00b", "invalid_argument", "control"),
        ("a\nb", "invalid_argument", "control"),
        ("\ud800", "invalid_argument", "control"),
        ("~root/x", "invalid_argument", "'~'"),
        ("x" * 5000, "invalid_argument", "at most 4096"),
    ],
)
def test_paths_that_leave_the_workspace_or_hide_something_are_refused(
    given: str, code: str, says: str
) -> None:
    with pytest.raises(paths.Refused) as refused:
        paths.agent_path(given, HOME)
    assert refused.value.code == code
    assert says in refused.value.message
    assert refused.value.status == {"permission_denied": 403, "invalid_argument": 400}[code]


def test_another_mount_and_the_root_as_home() -> None:
    assert paths.agent_path("/workspace/src/x.py", "/workspace") == "src/x.py"
    assert paths.agent_path("/workspace", "/workspace/") == "."
    with pytest.raises(paths.Refused):
        paths.agent_path("/home/user/x", "/workspace")
    # A workspace mounted at / takes every absolute path.
    assert paths.agent_path("/etc/x", "/") == "etc/x"
    assert paths.e2b_path("etc/x", "/") == "/etc/x"


def test_answers_name_absolute_paths_again() -> None:
    assert paths.e2b_path(".", HOME) == HOME
    assert paths.e2b_path("a/b.txt", HOME) == "/home/user/a/b.txt"
    assert paths.e2b_path("a", "/workspace/") == "/workspace/a"
    for given in ("a/b", "/home/user/a/b", "~/a/b"):
        assert paths.e2b_path(paths.agent_path(given, HOME), HOME) == "/home/user/a/b"


def test_below() -> None:
    assert paths.below("d/a/b", "d") == "a/b"
    assert paths.below("a", ".") == "a"
    assert paths.below("dd/a", "d") is None
    assert paths.below("d", "d") is None


def test_users() -> None:
    for name in (None, "", "user"):
        paths.check_user(name)
    with pytest.raises(paths.Refused) as root:
        paths.check_user("root")
    assert (root.value.code, root.value.status) == ("permission_denied", 403)
    assert "no root" in root.value.message
    with pytest.raises(paths.Refused) as other:
        paths.check_user("alice")
    assert (other.value.code, other.value.status) == ("unauthenticated", 401)


def test_the_user_of_a_connect_call() -> None:
    def basic(value: str) -> str:
        return "Basic " + base64.b64encode(value.encode()).decode()

    assert paths.basic_user(None) is None
    assert paths.basic_user("Bearer x") is None
    assert paths.basic_user(basic("user:")) == "user"
    assert paths.basic_user(basic("root:")) == "root"
    with pytest.raises(paths.Refused):
        paths.basic_user("Basic !!!")
    with pytest.raises(paths.Refused):
        paths.basic_user("Basic " + base64.b64encode(b"\xff:").decode())


# -- entries ----------------------------------------------------------------------------


def test_permissions_as_envd_shows_them() -> None:
    assert go_permissions("file", 0o644) == "-rw-r--r--"
    assert go_permissions("directory", 0o755) == "drwxr-xr-x"
    assert go_permissions("symlink", 0o777) == "Lrwxrwxrwx"
    assert go_permissions("directory", 0o1777) == "dtrwxrwxrwx"
    assert go_permissions("file", 0o4755) == "urwxr-xr-x"
    assert go_permissions("other", 0o600) == "?rw-------"


def info(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "path": "a/b.txt",
        "name": "b.txt",
        "type": "file",
        "size": 12,
        "mode": "0644",
        "modifiedAt": "2026-11-29T05:00:00.123Z",
        "uid": 1000,
        "gid": 1000,
    }
    return {**base, **over}


def test_an_entry_in_proto3_json() -> None:
    assert entry_info(info(), "/home/user/a/b.txt", HOME) == {
        "name": "b.txt",
        "type": "FILE_TYPE_FILE",
        "path": "/home/user/a/b.txt",
        "size": "12",  # int64: a string
        "mode": 0o644,  # uint32: a number
        "permissions": "-rw-r--r--",
        "owner": "user",
        "group": "user",
        "modifiedTime": "2026-11-29T05:00:00.123Z",
    }
    other = entry_info(info(type="directory", mode="2775", uid=1001, gid=0), "/home/user/a", HOME)
    assert (other["type"], other["mode"], other["permissions"]) == (
        "FILE_TYPE_DIRECTORY",
        0o775,
        "dgrwxrwxr-x",
    )
    assert (other["owner"], other["group"]) == ("1001", "root")
    assert entry_info(info(type="other"), "/home/user/p", HOME)["type"] == "FILE_TYPE_UNSPECIFIED"


def test_a_symlink_shows_what_it_points_to() -> None:
    link = info(type="symlink", mode="0777", size=5, symlinkTarget="b.txt")
    resolved = entry_info(link, "/home/user/a/l", HOME, info(mode="0600"))
    assert resolved["isSymlink"] is True
    assert (resolved["type"], resolved["mode"], resolved["permissions"]) == (
        "FILE_TYPE_FILE",
        0o600,
        "Lrwxrwxrwx",
    )
    assert resolved["symlinkTarget"] == "/home/user/a/b.txt"
    assert resolved["size"] == "5"
    dangling = entry_info(link, "/home/user/a/l", HOME)
    assert (dangling["type"], dangling["symlinkTarget"]) == (
        "FILE_TYPE_SYMLINK",
        "/home/user/a/b.txt",
    )
    out = entry_info(info(type="symlink", symlinkTarget="/etc/passwd"), "/home/user/l", HOME)
    assert out["symlinkTarget"] == "/etc/passwd"


def test_entries_sort_as_a_tree_walk() -> None:
    names = ["/h/a-c", "/h/a/b", "/h/a", "/h/b"]
    ordered = sorted(({"path": n} for n in names), key=tree_order)
    assert [e["path"] for e in ordered] == ["/h/a", "/h/a/b", "/h/a-c", "/h/b"]


def test_fields_are_typed_and_bounded() -> None:
    assert field({"depth": 2}, "depth", int, 0) == 2
    assert field({"depth": "7"}, "depth", int, 0) == 7  # proto3 JSON: uint32 as a string
    assert field({}, "depth", int, 0) == 0
    assert field({"watcher_id": "w1"}, "watcherId", str, "") == "w1"  # the proto's own name
    assert field({"includeEntry": True}, "includeEntry", bool, False) is True
    wrong: tuple[object, ...] = (-1, 1 << 32, True, 1.5, "x", "99999999999", [], {})
    for bad in wrong:
        with pytest.raises(ConnectError) as refused:
            field({"depth": bad}, "depth", int, 0)
        assert refused.value.code == "invalid_argument"
    for message in ({"path": 3}, {"path": ["a"]}, {"path": {"a": 1}}):
        with pytest.raises(ConnectError):
            field(message, "path", str, "")
    with pytest.raises(ConnectError):
        field({"recursive": "true"}, "recursive", bool, False)


# -- watch events -----------------------------------------------------------------------


def test_watch_events_as_e2b_names_them() -> None:
    def one(**event: object) -> list[dict[str, str]]:
        return translate(event, "d")

    assert one(type="create", path="d/a.txt") == [{"name": "a.txt", "type": "EVENT_TYPE_CREATE"}]
    assert one(type="write", path="d/sub/a") == [{"name": "sub/a", "type": "EVENT_TYPE_WRITE"}]
    assert one(type="chmod", path="d") == [{"name": ".", "type": "EVENT_TYPE_CHMOD"}]
    assert one(type="remove", path="d/x") == [{"name": "x", "type": "EVENT_TYPE_REMOVE"}]
    # A rename is the old name's RENAME and the new name's CREATE (fsnotify's way).
    assert one(type="rename", path="d/new", oldPath="d/old", move="within") == [
        {"name": "old", "type": "EVENT_TYPE_RENAME"},
        {"name": "new", "type": "EVENT_TYPE_CREATE"},
    ]
    assert one(type="rename", path="d/in", move="in") == [
        {"name": "in", "type": "EVENT_TYPE_CREATE"}
    ]
    assert one(type="rename", path="d/out", move="out") == [
        {"name": "out", "type": "EVENT_TYPE_RENAME"}
    ]
    for nothing in (
        {"type": "overflow", "dropped": 3},
        {"type": "keepalive"},
        {"type": "started", "path": "d"},
        {"type": "create", "path": "elsewhere/x"},
        {"type": "create"},
        {"type": "create", "path": 3},
        {"type": "bogus", "path": "d/x"},
    ):
        assert translate(nothing, "d") == [], nothing
    assert translate({"type": "create", "path": "x"}, ".") == [
        {"name": "x", "type": "EVENT_TYPE_CREATE"}
    ]


# -- /files -----------------------------------------------------------------------------


def test_signatures_are_e2bs() -> None:
    """v1_ + unpadded base64 of sha256("path:operation:user:token[:expiration]"),
    as E2B's SDKs compute it (e2b.sandbox.signature)."""
    digest = hashlib.sha256(b"a.txt:read::tok").digest()
    assert signature("a.txt", "read", "", "tok", None) == (
        "v1_" + base64.b64encode(digest).decode().rstrip("=")
    )
    digest = hashlib.sha256(b"a.txt:write:user:tok:1700000000").digest()
    assert signature("a.txt", "write", "user", "tok", 1700000000) == (
        "v1_" + base64.b64encode(digest).decode().rstrip("=")
    )


@pytest.mark.parametrize(
    ("accept", "gzip"),
    [
        ("", False),
        ("gzip", True),
        ("gzip, deflate, br", True),
        ("identity", False),
        ("br", False),
        ("gzip;q=0", False),
        ("gzip;q=0.5, identity", False),
        ("*", True),
        ("identity;q=0, gzip", True),
        ("identity;q=0", None),
        ("*;q=0", None),
        ("gzip;q=x", False),
    ],
)
def test_download_encodings(accept: str, gzip: bool | None) -> None:
    assert wants_gzip(accept) is gzip


def test_disposition_names_the_file_safely() -> None:
    assert disposition("a.txt") == 'inline; filename="a.txt"'
    assert disposition('a"b.txt') == "inline; filename*=utf-8''a%22b.txt"
    assert disposition("ü.txt") == "inline; filename*=utf-8''%C3%BC.txt"
    assert disposition("a\r\nb") == "inline; filename*=utf-8''a%0D%0Ab"


@pytest.mark.parametrize(
    ("header", "kind"),
    [
        (None, "application/octet-stream"),
        ("application/octet-stream", "application/octet-stream"),
        ("multipart/form-data; boundary=4c3e0b6ad1c4f0e1", "multipart/form-data"),
        ('Multipart/Form-Data;boundary="a;b"', "multipart/form-data"),
        (" application/octet-stream ; charset=utf-8", "application/octet-stream"),
        ("text/plain", "text/plain"),
        ("text", "text"),  # not a media type: refused as one that is not served
        ("", ""),
    ],
)
def test_upload_media_types(header: str | None, kind: str) -> None:
    assert media_type(header) == kind


def test_an_upload_that_stops_arriving_is_a_408() -> None:
    import asyncio
    from collections.abc import AsyncIterator

    from sandbox_operator.gateway.e2b import files
    from sandbox_operator.gateway.e2b.core import E2BError

    async def stalls() -> AsyncIterator[bytes]:
        yield b"first"
        await asyncio.Event().wait()  # and nothing more, ever
        yield b"never"

    async def scenario() -> None:
        body = files._Body(stalls(), 0.1)
        got: list[bytes] = []

        async def read() -> None:
            async for chunk in body:
                got.append(chunk)

        with pytest.raises(TimeoutError):
            await read()
        assert got == [b"first"]
        assert isinstance(body.error, TimeoutError)
        with pytest.raises(E2BError) as refused:
            await files._unbroken(asyncio.Event().wait(), 0.1)
        assert refused.value.status == 408

        async def ends() -> AsyncIterator[bytes]:
            yield b"a"
            yield b"b"

        assert [c async for c in files._Body(ends(), 0.1)] == [b"a", b"b"]

    asyncio.run(scenario())
