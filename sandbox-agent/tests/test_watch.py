"""Directory watches (GET /v1/files/watch) against a real agent and real inotify."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from conftest import Sandbox, wait_until

Event = dict[str, Any]


class Watch:
    """One watch stream. Events are read by a thread into a queue (``next``),
    unless ``reader=False``: then the test reads (or does not read) itself."""

    def __init__(
        self,
        sb: Sandbox,
        path: str,
        *,
        recursive: bool = False,
        reader: bool = True,
        rcvbuf: int | None = None,
        **params: str,
    ) -> None:
        options = [] if rcvbuf is None else [(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)]
        self.http = httpx.Client(
            base_url=sb.base_url,
            headers={"Authorization": f"Bearer {sb.token}"},
            timeout=60.0,
            transport=httpx.HTTPTransport(socket_options=options),
        )
        query = {"path": path, "recursive": str(recursive).lower(), **params}
        self._cm = self.http.stream("GET", "/v1/files/watch", params=query)
        self.response = self._cm.__enter__()
        self.status = self.response.status_code
        self.events: queue.Queue[Event | None] = queue.Queue()
        self.lines: Iterator[str] = self.response.iter_lines()
        if self.status != 200:
            self.response.read()
            return
        self.started = self.read_one()
        if reader:
            threading.Thread(target=self._read, daemon=True).start()

    def read_one(self) -> Event:
        for line in self.lines:
            if line:
                event: Event = json.loads(line)
                return event
        raise AssertionError("the stream ended")

    def _read(self) -> None:
        try:
            for line in self.lines:
                if line:
                    self.events.put(json.loads(line))
        except Exception:  # closed under us: the test is done with it
            pass
        self.events.put(None)

    def next(self, timeout: float = 10.0, keepalives: bool = False) -> Event | None:
        """The next event (None: the stream ended); keepalives skipped unless asked."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no event within {timeout} s") from None
            if event is None or keepalives or event["type"] != "keepalive":
                return event

    def changes(self, count: int, timeout: float = 10.0) -> list[tuple[str, str]]:
        """The next ``count`` events as (type, path)."""
        out = []
        for _ in range(count):
            event = self.next(timeout)
            assert event is not None, out
            out.append((event["type"], event.get("path", "")))
        return out

    def drain(self, seconds: float = 0.5) -> list[tuple[str, str]]:
        """What arrives until ``seconds`` pass without an event, as (type, path)."""
        out = []
        while True:
            try:
                event = self.events.get(timeout=seconds)
            except queue.Empty:
                return out
            assert event is not None
            if event["type"] != "keepalive":
                out.append((event["type"], event.get("path", "")))

    def quiet(self, seconds: float = 0.3) -> None:
        """Nothing more arrives for a while (keepalives aside)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = self.events.get(timeout=left)
            except queue.Empty:
                return
            assert event is not None and event["type"] == "keepalive", event

    @property
    def socket(self) -> socket.socket:
        sock: socket.socket = self.response.extensions["network_stream"].get_extra_info("socket")
        return sock

    def close(self) -> None:
        # Shut the socket down first: closing it alone does not end a recv()
        # the reader thread is blocked in, and the agent would see no FIN until then.
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_RDWR)
        self.response.close()
        self._cm.__exit__(None, None, None)
        self.http.close()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def inotify_fds(pid: int) -> int:
    """The inotify descriptors process ``pid`` holds."""
    count = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}") == "anon_inode:inotify":
                count += 1
        except OSError:
            continue  # closed meanwhile
    return count


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def test_every_kind_of_change_is_one_event(sandbox: Sandbox, wsdir: str) -> None:
    d = sandbox.workspace / wsdir
    (d / "w").mkdir()
    (d / "elsewhere").mkdir()
    with Watch(sandbox, f"{wsdir}/w") as w:
        assert w.started["type"] == "started"
        assert (w.started["path"], w.started["recursive"], w.started["watches"]) == (
            f"{wsdir}/w",
            False,
            1,
        )
        p = f"{wsdir}/w"
        before, t0 = time.time(), time.monotonic()
        (d / "w/a.txt").open("x").close()
        created = w.next()
        print(f"\nfirst event {1000 * (time.monotonic() - t0):.1f} ms after the change")
        assert created is not None
        assert (created["type"], created["path"], created["fileType"]) == (
            "create",
            f"{p}/a.txt",
            "file",
        )
        at = datetime.strptime(created["time"], "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()
        assert before - 1 <= at <= time.time() + 1
        with (d / "w/a.txt").open("a") as f:
            f.write("one line\n")
        assert w.changes(1) == [("write", f"{p}/a.txt")]  # and none for the close
        os.chmod(d / "w/a.txt", 0o600)
        assert w.changes(1) == [("chmod", f"{p}/a.txt")]
        os.rename(d / "w/a.txt", d / "w/b.txt")
        renamed = w.next()
        assert renamed is not None
        assert (renamed["type"], renamed["path"], renamed["oldPath"], renamed["move"]) == (
            "rename",
            f"{p}/b.txt",
            f"{p}/a.txt",
            "within",
        )
        # A change through a shared mapping has no IN_MODIFY: its close says it.
        with (d / "w/b.txt").open("r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            m[0:3] = b"ONE"
        assert w.changes(1) == [("write", f"{p}/b.txt")]
        os.rename(d / "w/b.txt", d / "elsewhere/b.txt")
        out = w.next()
        assert out is not None
        assert (out["type"], out["path"], out["move"]) == ("rename", f"{p}/b.txt", "out")
        assert "oldPath" not in out
        os.rename(d / "elsewhere/b.txt", d / "w/c.txt")
        moved_in = w.next()
        assert moved_in is not None
        assert (moved_in["type"], moved_in["path"], moved_in["move"]) == (
            "rename",
            f"{p}/c.txt",
            "in",
        )
        (d / "w/c.txt").unlink()
        assert w.changes(1) == [("remove", f"{p}/c.txt")]
        (d / "w/sub").mkdir()
        made = w.next()
        assert made is not None and (made["type"], made["fileType"]) == ("create", "directory")
        (d / "w/sub").rmdir()
        gone = w.next()
        assert gone is not None
        assert (gone["type"], gone["path"], gone["fileType"]) == (
            "remove",
            f"{p}/sub",
            "directory",
        )
        w.quiet()


def test_recursive_watches_subdirectories_and_follows_new_ones(
    sandbox: Sandbox, wsdir: str
) -> None:
    d = sandbox.workspace / wsdir
    (d / "sub").mkdir()
    with Watch(sandbox, wsdir) as flat:
        (d / "sub/deep.txt").write_text("x")
        (d / "top.txt").write_text("x")
        # The file in the subdirectory is not seen: the next event is the top one.
        assert flat.changes(2) == [("create", f"{wsdir}/top.txt"), ("write", f"{wsdir}/top.txt")]
        flat.quiet()
    with Watch(sandbox, wsdir, recursive=True) as w:
        assert w.started["watches"] == 2
        (d / "sub/deep2.txt").open("x").close()
        assert w.changes(1) == [("create", f"{wsdir}/sub/deep2.txt")]
        # A directory made after the start is followed; what it held before its
        # watch was added is reported from a scan.
        (d / "new/a/b").mkdir(parents=True)
        (d / "new/a/b/f.txt").write_text("x")
        seen: set[tuple[str, str]] = set()
        wait_until(
            lambda: seen.update(w.changes(1)) or ("create", f"{wsdir}/new/a/b/f.txt") in seen
        )
        assert {("create", f"{wsdir}/new"), ("create", f"{wsdir}/new/a")} <= seen
        # Depending on when each watch came, f.txt's write (and a second create
        # from the scan) may follow: nothing else does.
        seen.update(w.drain())
        assert seen <= {
            ("create", f"{wsdir}/new"),
            ("create", f"{wsdir}/new/a"),
            ("create", f"{wsdir}/new/a/b"),
            ("create", f"{wsdir}/new/a/b/f.txt"),
            ("write", f"{wsdir}/new/a/b/f.txt"),
        }, seen
        (d / "new/a/b/g.txt").open("x").close()
        assert w.changes(1) == [("create", f"{wsdir}/new/a/b/g.txt")]
        # A directory renamed inside the watch keeps its watches, under the new name.
        os.rename(d / "new", d / "renamed")
        event = w.next()
        assert event is not None
        assert (event["path"], event["oldPath"]) == (f"{wsdir}/renamed", f"{wsdir}/new")
        (d / "renamed/a/b/h.txt").open("x").close()
        assert w.changes(1) == [("create", f"{wsdir}/renamed/a/b/h.txt")]


def test_the_stream_ends_with_the_directory_and_after_its_timeout(
    sandbox: Sandbox, wsdir: str
) -> None:
    d = sandbox.workspace / wsdir
    (d / "doomed").mkdir()
    with Watch(sandbox, f"{wsdir}/doomed") as w:
        (d / "doomed").rmdir()
        assert w.changes(2) == [("remove", f"{wsdir}/doomed"), ("finished", "")]
        assert w.next() is None  # and the stream is over
    with Watch(sandbox, wsdir, timeoutSeconds="0.5") as w:
        end = w.next(5)
        assert end is not None and (end["type"], end["reason"]) == ("finished", "timeout")
        assert w.next() is None
    # The same as server-sent events.
    sse = sandbox.client.get(
        "/v1/files/watch",
        params={"path": wsdir, "timeoutSeconds": "0.3"},
        headers={"Accept": "text/event-stream"},
    )
    assert sse.headers["content-type"].startswith("text/event-stream")
    blocks = sse.text.strip().split("\n\n")
    assert blocks[0].startswith("event: started\ndata: {")
    assert blocks[-1].startswith("event: finished\ndata: {")


def test_paths_that_leave_the_workspace_are_refused(sandbox: Sandbox, wsdir: str) -> None:
    outside = Path(tempfile.mkdtemp(prefix="watch-outside-"))
    try:
        (sandbox.workspace / wsdir / "out").symlink_to(outside)
        (sandbox.workspace / wsdir / "file").write_text("x")
        for path, status, code in (
            ("..", 400, "path_traversal"),
            (f"{wsdir}/../..", 400, "path_traversal"),
            ("/etc", 400, "path_traversal"),
            (str(outside), 400, "path_traversal"),
            (f"{wsdir}/out", 403, "path_escape"),
            (f"{wsdir}/missing", 404, "not_found"),
            (f"{wsdir}/missing/below", 404, "not_found"),  # a missing parent too
            (f"{wsdir}/file", 400, "not_a_directory"),
        ):
            r = sandbox.client.get("/v1/files/watch", params={"path": path})
            assert sandbox.error(r, status) == code, path
        # Inside a watched tree the symlink is an entry, never followed.
        with Watch(sandbox, wsdir, recursive=True) as w:
            assert w.started["watches"] == 1
            (outside / "secret").write_text("x")
            (sandbox.workspace / wsdir / "link2").symlink_to(outside)
            event = w.next()
            assert event is not None
            assert (event["type"], event["path"], event["fileType"]) == (
                "create",
                f"{wsdir}/link2",
                "file",
            )
            (outside / "secret2").write_text("x")
            w.quiet()
    finally:
        shutil.rmtree(outside)


def no_watches_open(sandbox: Sandbox) -> bool:
    return "sandbox_agent_watches 0.0" in sandbox.client.get("/metrics").text


def test_the_watch_ends_when_its_client_leaves(sandbox: Sandbox, wsdir: str) -> None:
    assert sandbox.agent is not None
    pid = sandbox.agent.pid
    (sandbox.workspace / wsdir / "a/b").mkdir(parents=True)
    # The agent is shared: a watch an earlier test left ends when the agent
    # notices its client gone, which may be now. Counting from then on only.
    wait_until(lambda: no_watches_open(sandbox), 10)
    before = inotify_fds(pid)
    watches = [Watch(sandbox, wsdir, recursive=True) for _ in range(3)]
    assert inotify_fds(pid) == before + 3
    for w in watches:
        w.close()
    wait_until(lambda: inotify_fds(pid) == before, 10)
    assert no_watches_open(sandbox)


def test_a_client_that_leaves_while_changes_stream_ends_its_watch(
    sandbox: Sandbox, wsdir: str
) -> None:
    """The agent may be sending an event at the instant its client leaves: the
    watch ends then too, not when the garbage collector next runs."""
    assert sandbox.agent is not None
    pid = sandbox.agent.pid
    root = sandbox.workspace / wsdir
    wait_until(lambda: no_watches_open(sandbox), 10)
    before = inotify_fds(pid)
    stop = threading.Event()

    def churn() -> None:
        n = 0
        while not stop.is_set():
            (root / f"f{n % 50}").write_bytes(b"x")
            n += 1

    writer = threading.Thread(target=churn, daemon=True)
    writer.start()
    try:
        for _ in range(20):
            with Watch(sandbox, wsdir, reader=False) as w:
                for _ in range(3):
                    w.read_one()
            wait_until(lambda: inotify_fds(pid) == before, 10)
    finally:
        stop.set()
        writer.join()
    assert no_watches_open(sandbox)


def test_a_watch_is_not_activity(sandbox: Sandbox, wsdir: str) -> None:
    """Opening a watch counts like any file call; what it streams does not, so a
    forgotten watch does not keep a sandbox from its idle timeout."""
    with Watch(sandbox, wsdir) as w:
        opened = sandbox.client.get("/v1/info").json()["lastActivity"]
        time.sleep(0.01)
        for i in range(3):
            (sandbox.workspace / wsdir / f"f{i}").open("x").close()
        assert len(w.changes(3)) == 3
        assert sandbox.client.get("/v1/info").json()["lastActivity"] == opened


def test_limits_answer_429_and_keepalives_fill_the_quiet(
    fresh: Callable[..., Sandbox], tmp_path: Path
) -> None:
    sb = fresh(runner=False, max_watches=2, watch_max_directories=3, watch_keepalive=0.3)
    (sb.workspace / "big/a").mkdir(parents=True)
    (sb.workspace / "big/b").mkdir()
    (sb.workspace / "big/c").mkdir()
    r = sb.client.get("/v1/files/watch", params={"path": "big", "recursive": "true"})
    assert sb.error(r, 429) == "too_many_watched_directories"
    (sb.workspace / "small/a").mkdir(parents=True)
    with Watch(sb, "small", recursive=True) as one, Watch(sb, "big") as two:
        r = sb.client.get("/v1/files/watch", params={"path": "."})
        assert sb.error(r, 429) == "too_many_watches"
        keepalive = two.next(5, keepalives=True)
        assert keepalive is not None and keepalive["type"] == "keepalive"
        # A new directory past the cap is reported (its creation), then the one
        # that could not be watched as an overflow: its changes may be missed.
        (sb.workspace / "small/b").mkdir()
        (sb.workspace / "small/c").mkdir()
        events = [one.next(), one.next(), one.next()]
        assert [(e or {}).get("type") for e in events] == ["create", "create", "overflow"]
        assert events[2] is not None and events[2]["reason"] == "watch_limit"

    def reopened() -> bool:
        with Watch(sb, ".") as again:  # the slots come back once the agent saw them go
            return again.status == 200

    wait_until(reopened)


def test_a_burst_of_changes_overflows_and_memory_stays_bounded(
    fresh: Callable[..., Sandbox],
) -> None:
    """100,000 files made while the client reads nothing: the agent keeps at most
    its queue (4096 changes), then one overflow event says how many it dropped."""
    sb = fresh(runner=False, watch_keepalive=1)
    assert sb.agent is not None
    pid = sb.agent.pid
    burst = sb.workspace / "burst"
    burst.mkdir()
    # A bounded receive buffer (64 KiB, not the tens of MiB autotuning may
    # reach): the sockets hold a few MiB in flight at most, so most of the
    # changes pile up at the agent, where the bound is to be seen.
    w = Watch(sb, "burst", reader=False, rcvbuf=64 << 10)
    try:
        rss_before = status_kib(pid, "VmRSS")
        peak = [rss_before]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], status_kib(pid, "VmRSS"))
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        for i in range(100_000):
            os.close(os.open(burst / f"f{i}", os.O_CREAT | os.O_WRONLY, 0o644))
        made = time.monotonic() - started
        seen = creates = 0
        overflow: Event | None = None
        for line in w.lines:
            if not line:
                continue
            event = json.loads(line)
            if event["type"] == "keepalive":
                break  # everything queued was sent
            seen += 1
            if event["type"] == "overflow":
                overflow = overflow or event
            elif event["type"] == "create":
                creates += 1
        done.set()
        sampler.join()
        grown_mib = (peak[0] - rss_before) / 1024
        print(
            f"\n100,000 files in {made:.1f} s; agent RSS {rss_before / 1024:.1f} MiB before,"
            f" peak {peak[0] / 1024:.1f} MiB (+{grown_mib:.1f}); {creates} creates sent,"
            f" overflow {overflow}"
        )
        assert overflow is not None, seen
        assert overflow["reason"] in ("queue", "kernel")
        assert creates < 100_000
        # Unbounded, the 55,000-odd changes dropped would have cost over 10 MiB.
        assert grown_mib < 8, f"the agent grew by {grown_mib:.1f} MiB"
        # The stream goes on after an overflow.
        (burst / "after").open("x").close()
        event = w.read_one()
        while event["type"] == "keepalive":
            event = w.read_one()
        assert (event["type"], event["path"]) == ("create", "burst/after")
    finally:
        w.close()
