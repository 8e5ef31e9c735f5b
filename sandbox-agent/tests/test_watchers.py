"""Polled watchers (POST /v1/files/watchers) and how watches report API writes,
against a real agent and real inotify (and the polling mode)."""

from __future__ import annotations

import os
import time
from typing import Any

from conftest import Sandbox, wait_until
from test_watch import Watch, inotify_fds

Event = dict[str, Any]


def create(sb: Sandbox, path: str, **body: Any) -> Event:
    r = sb.client.post("/v1/files/watchers", json={"path": path, **body})
    assert r.status_code == 201, r.text
    made: Event = r.json()
    return made


def fetch(sb: Sandbox, ident: str) -> Event:
    r = sb.client.get(f"/v1/files/watchers/{ident}/events")
    assert r.status_code == 200, r.text
    found: Event = r.json()
    return found


def changes(found: Event) -> list[tuple[str, str]]:
    return [(e["type"], e.get("path", "")) for e in found["events"]]


def test_a_watcher_keeps_changes_until_fetched(sandbox: Sandbox, wsdir: str) -> None:
    d = sandbox.workspace / wsdir
    made = create(sandbox, wsdir)
    assert (made["path"], made["recursive"], made["mode"]) == (wsdir, False, "inotify")
    assert made["id"].startswith("w") and made["idleTimeoutSeconds"] == 600
    assert fetch(sandbox, made["id"]) == {"path": wsdir, "events": [], "finished": False}
    # A change made before the fetch is in its answer, with no wait: the
    # kernel's queue is read first.
    (d / "a.txt").write_text("one")
    (d / "sub").mkdir()
    os.rename(d / "a.txt", d / "sub-a.txt")
    assert changes(fetch(sandbox, made["id"])) == [
        ("create", f"{wsdir}/a.txt"),
        ("write", f"{wsdir}/a.txt"),
        ("create", f"{wsdir}/sub"),
        ("rename", f"{wsdir}/sub-a.txt"),
    ]
    assert fetch(sandbox, made["id"])["events"] == []  # each change once
    (d / "sub-a.txt").unlink()
    assert changes(fetch(sandbox, made["id"])) == [("remove", f"{wsdir}/sub-a.txt")]
    r = sandbox.client.delete(f"/v1/files/watchers/{made['id']}")
    assert r.status_code == 204, r.text
    for call in (sandbox.client.get, sandbox.client.delete):
        url = f"/v1/files/watchers/{made['id']}" + ("/events" if call == sandbox.client.get else "")
        assert sandbox.error(call(url), 404) == "watcher_not_found"


def test_a_watcher_is_recursive_and_ends_with_its_directory(sandbox: Sandbox, wsdir: str) -> None:
    d = sandbox.workspace / wsdir
    (d / "w/deep").mkdir(parents=True)
    made = create(sandbox, f"{wsdir}/w", recursive=True)
    (d / "w/deep/f").write_text("x")
    (d / "w/deep/new").mkdir()
    (d / "w/deep/new/g").write_text("")
    found = changes(fetch(sandbox, made["id"]))
    assert ("create", f"{wsdir}/w/deep/f") in found
    assert ("create", f"{wsdir}/w/deep/new") in found
    wait_until(
        lambda: ("create", f"{wsdir}/w/deep/new/g") in found + changes(fetch(sandbox, made["id"]))
    )
    (d / "w/deep/new/g").unlink()
    (d / "w/deep/new").rmdir()
    (d / "w/deep/f").unlink()
    (d / "w/deep").rmdir()
    (d / "w").rmdir()
    found = fetch(sandbox, made["id"])
    assert found["finished"] is True
    assert found["events"][-1]["type"] == "finished" and found["events"][-1]["reason"] == "removed"
    again = fetch(sandbox, made["id"])  # ended, still there until removed: nothing more
    assert again == {"path": f"{wsdir}/w", "events": [], "finished": True}
    assert sandbox.client.delete(f"/v1/files/watchers/{made['id']}").status_code == 204


def test_watcher_paths_are_checked_like_every_file_call(sandbox: Sandbox, wsdir: str) -> None:
    (sandbox.workspace / wsdir / "file").write_text("x")
    for path, status, code in (
        ("../x", 400, "path_traversal"),
        ("/etc", 400, "path_traversal"),
        (f"{wsdir}/missing", 404, "not_found"),
        (f"{wsdir}/file", 400, "not_a_directory"),
    ):
        r = sandbox.client.post("/v1/files/watchers", json={"path": path})
        assert sandbox.error(r, status) == code, path
    r = sandbox.client.post("/v1/files/watchers", json={"path": wsdir, "other": 1})
    assert sandbox.error(r, 400) == "invalid_request"
    for ident in ("..", "a/b", "-x"):
        r = sandbox.client.get(f"/v1/files/watchers/{ident}/events")
        assert r.status_code in (400, 404), (ident, r.text)


def test_watchers_are_bounded_and_idle_ones_go(fresh: Any) -> None:
    sb: Sandbox = fresh(
        env={"SANDBOX_AGENT_MAX_WATCHERS": "2", "SANDBOX_AGENT_WATCHER_IDLE_TIMEOUT": "1"}
    )
    assert sb.agent is not None
    first, second = create(sb, "."), create(sb, ".")
    assert inotify_fds(sb.agent.pid) == 2
    assert sb.error(sb.client.post("/v1/files/watchers", json={"path": "."}), 429) == (
        "too_many_watchers"
    )
    # Fetching keeps one alive; the other one, untouched, is closed and forgotten.
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        fetch(sb, first["id"])
        time.sleep(0.2)
    assert sb.error(sb.client.get(f"/v1/files/watchers/{second['id']}/events"), 404) == (
        "watcher_not_found"
    )
    wait_until(lambda: inotify_fds(sb.agent.pid) == 1 if sb.agent else False)
    create(sb, ".")  # its place is free again


def test_a_watchers_queue_overflows_and_says_so(fresh: Any) -> None:
    sb: Sandbox = fresh(env={"SANDBOX_AGENT_WATCH_QUEUE": "8"})
    made = create(sb, ".")
    for i in range(40):
        (sb.workspace / f"f{i}").open("x").close()
    found = fetch(sb, made["id"])
    kinds = [e["type"] for e in found["events"]]
    assert kinds.count("create") <= 8 and kinds[-1] == "overflow", kinds
    assert found["events"][-1]["dropped"] >= 32 - 8


def api_write(sb: Sandbox, path: str, data: bytes) -> None:
    r = sb.client.put("/v1/files/content", params={"path": path}, content=data)
    assert r.status_code == 200, r.text


def test_a_write_through_the_api_reads_as_the_file_written(sandbox: Sandbox, wsdir: str) -> None:
    """Not as the temp file it goes through: a new file is made, its mode set and
    its content written; a replaced one has its mode set and content written."""
    made = create(sandbox, wsdir)
    api_write(sandbox, f"{wsdir}/new.txt", b"content")
    assert changes(fetch(sandbox, made["id"])) == [
        ("create", f"{wsdir}/new.txt"),
        ("chmod", f"{wsdir}/new.txt"),
        ("write", f"{wsdir}/new.txt"),
    ]
    api_write(sandbox, f"{wsdir}/new.txt", b"again")
    assert changes(fetch(sandbox, made["id"])) == [
        ("chmod", f"{wsdir}/new.txt"),
        ("write", f"{wsdir}/new.txt"),
    ]
    api_write(sandbox, f"{wsdir}/empty", b"")
    assert changes(fetch(sandbox, made["id"])) == [
        ("create", f"{wsdir}/empty"),
        ("chmod", f"{wsdir}/empty"),
    ]
    # A failed write leaves nothing to report (a directory in the way).
    (sandbox.workspace / wsdir / "dir").mkdir()
    fetch(sandbox, made["id"])
    r = sandbox.client.put("/v1/files/content", params={"path": f"{wsdir}/dir"}, content=b"x")
    assert r.status_code == 400
    assert fetch(sandbox, made["id"])["events"] == []
    # Someone else's file named like a temp file is reported as it is.
    other = f".x.{'ab' * 6}.tmp"
    (sandbox.workspace / wsdir / other).write_text("mine")
    assert changes(fetch(sandbox, made["id"])) == [
        ("create", f"{wsdir}/{other}"),
        ("write", f"{wsdir}/{other}"),
    ]
    sandbox.client.delete(f"/v1/files/watchers/{made['id']}")
    # The same on a stream.
    with Watch(sandbox, wsdir) as w:
        api_write(sandbox, f"{wsdir}/streamed.txt", b"x")
        assert w.changes(3) == [
            ("create", f"{wsdir}/streamed.txt"),
            ("chmod", f"{wsdir}/streamed.txt"),
            ("write", f"{wsdir}/streamed.txt"),
        ]
        w.quiet()


def test_a_polling_watcher_reports_api_writes_as_files_too(fresh: Any) -> None:
    sb: Sandbox = fresh(
        env={"SANDBOX_AGENT_WATCH_MODE": "poll", "SANDBOX_AGENT_WATCH_POLL_INTERVAL": "0.05"}
    )
    made = create(sb, ".")
    assert made["mode"] == "poll" and made["pollInterval"] == 0.05
    api_write(sb, "p.txt", b"data")
    seen: list[tuple[str, str]] = []
    wait_until(lambda: seen.extend(changes(fetch(sb, made["id"]))) or ("write", "p.txt") in seen)
    assert all(not path.startswith(".p.txt.") for _, path in seen), seen
    assert seen[0] == ("create", "p.txt"), seen


def test_the_temp_file_table_is_bounded() -> None:
    from sandbox_agent import tempfiles

    for i in range(tempfiles.MAX_NAMES + 10):
        tempfiles.register(f".n{i}.tmp", i % 2 == 0)
    assert len(tempfiles._names) == tempfiles.MAX_NAMES
    assert tempfiles.existed(".n0.tmp") is None  # the oldest went first
    assert tempfiles.existed(f".n{tempfiles.MAX_NAMES + 8}.tmp") is True
