"""Directory watches: inotify events of a workspace directory, bounded, as a stream.

One ``Watcher`` per stream: its own inotify descriptor, read from the event
loop (``add_reader``: no thread, no polling), a queue of at most
``queue`` changes and at most ``directories`` inotify watches. The queue,
its overflow and the end of a stream are ``Stream``'s, which the polling
side (watchpoll.py: where inotify cannot see the sandbox container's
changes, as under gVisor) shares.

Bounds. Code in the sandbox decides how fast files change, and a client may
read slowly or not at all, so nothing here grows with either: past the
queue's size changes are dropped and counted, and once the queue has drained
to half one ``overflow`` change says how many were lost (as it does when the
kernel's own queue overflowed, IN_Q_OVERFLOW). A new directory's entries are
scanned at most ``queue`` at a time. Writes and attribute changes of one
file collapse while one for it still waits in the queue: the client reads
the file after the event arrives, so it sees the later changes too.

Confinement. The watched directory is walked to by descriptor
(``Workspace.open_dir``: symlinks inside the workspace followed, escapes
refused); subdirectories are opened relative to their parent's descriptor
with ``O_NOFOLLOW`` and watched through that descriptor, so a symlink (or a
directory swapped for one) is never followed: a symlink is reported as a
file, and what it points to is not watched.

Policy for writes: IN_MODIFY gives ``write``. IN_CLOSE_WRITE gives one only
for a file that neither IN_CREATE nor IN_MODIFY reported since its previous
close: a change made through a shared memory mapping shows no IN_MODIFY, and
without this rule ``echo x > f`` would read as two writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import posixpath
import time
import weakref
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Literal, NamedTuple

from . import inotify, metrics, models, tempfiles
from .errors import Busy
from .paths import Workspace, display

MASK = (
    inotify.IN_CREATE
    | inotify.IN_DELETE
    | inotify.IN_DELETE_SELF
    | inotify.IN_MODIFY
    | inotify.IN_CLOSE_WRITE
    | inotify.IN_ATTRIB
    | inotify.IN_MOVED_FROM
    | inotify.IN_MOVED_TO
    | inotify.IN_MOVE_SELF
    | inotify.IN_EXCL_UNLINK
)
READ_BYTES = 64 << 10  # one read per wake-up: ~2,000 events, then the loop runs others
MAX_DEPTH = 128  # as the other tree walks of the files API
# How long a MOVED_FROM waits for its MOVED_TO. The kernel queues both in the
# same rename(2), so the pair is split only by the end of a read (or, rarely,
# another event queued between them by another CPU).
MOVE_WAIT = 0.01
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK

Kind = Literal["create", "write", "remove", "rename", "chmod", "overflow", "finished", "keepalive"]
Reason = Literal["queue", "kernel", "watch_limit", "removed", "moved", "unmounted", "timeout"]


Mode = Literal["inotify", "poll"]
# A file written through the API, as reported (Stream._push): made if it was not
# there, its mode set, its content written.
_AS_WRITTEN: tuple[Kind, ...] = ("create", "chmod", "write")


@dataclass(frozen=True)
class Limits:
    queue: int  # changes held for the client
    directories: int  # inotify watches (directories) of one stream; scanned ones when polling
    entries: int = 20_000  # polling: entries remembered between scans (watchpoll.py)


class Change(NamedTuple):
    """One queued change. ``path`` is relative to the watched directory ('' is it)."""

    kind: Kind
    path: str
    is_dir: bool
    at: float
    old: str | None = None  # rename within the watch: where it was
    move: Literal["within", "in", "out"] | None = None
    dropped: int = 0  # overflow
    reason: Reason | None = None  # overflow, finished


class Stream:
    """What every watch stream shares, whatever finds its changes: the bounded
    queue of changes for the client (with the overflow marker and the collapsing
    of waiting writes and chmods), ``next``, and how it ends. ``open`` (blocking:
    run it in a thread) puts the watch in place; ``start`` attaches it to the
    running loop; ``close`` ends it all."""

    mode: Mode
    poll_interval: float | None = None  # polling: seconds between two scans

    def __init__(self, ws: Workspace, rel: str, recursive: bool, limits: Limits) -> None:
        self.ws = ws
        self.requested = rel
        self.shown = ws.clean(rel)  # the prefix of every path sent: as the client named it
        self.recursive = recursive
        self.limits = limits
        self.queue: deque[Change] = deque()
        # (kind, path) of writes and chmods waiting in the queue: later ones of
        # the same file add nothing (see the module's docstring).
        self.waiting: set[tuple[str, str]] = set()
        self.dropped = 0
        self.drop_reason: Reason | None = None
        self.ended: Reason | None = None
        self.end_told = False  # drain(): `finished` handed out once
        # The agent's own temp files seen in this watch (path -> kinds of change),
        # reported as the file they become (see tempfiles.py): bounded.
        self.temps: dict[str, set[Kind]] = {}
        self.opened = False  # past open(): a limit hit now is an overflow, not a refusal
        self.closed = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wake: asyncio.Event | None = None

    @property
    def watched(self) -> int:
        """Directories watched (inotify) or scanned (polling), for ``started``."""
        raise NotImplementedError

    def open(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.wake = asyncio.Event()

    def close(self) -> None:
        self.closed = True
        self.queue.clear()

    def read_pending(self) -> None:
        """Take in the changes already found but not yet read (inotify: those the
        kernel has queued), so a poll right after a change sees it."""

    async def next(self, wait: float) -> Change | None:
        """The next change (``finished`` last), or None when ``wait`` seconds
        passed without one."""
        assert self.wake is not None
        while True:
            if self.queue:
                change = self.queue.popleft()
                if change.kind in ("write", "chmod"):
                    self.waiting.discard((change.kind, change.path))
                return change
            if self.dropped:
                return self._marker(time.time())
            if self.ended is not None:
                return Change("finished", "", True, time.time(), reason=self.ended)
            self.wake.clear()
            try:
                async with asyncio.timeout(wait):
                    await self.wake.wait()
            except TimeoutError:
                return None

    def drain(self, limit: int) -> list[Change]:
        """What waits, up to ``limit`` changes, without waiting: for a client that
        polls (watchers.py). The overflow marker and ``finished`` (once) included."""
        out: list[Change] = []
        while len(out) < limit:
            if self.queue:
                change = self.queue.popleft()
                if change.kind in ("write", "chmod"):
                    self.waiting.discard((change.kind, change.path))
                out.append(change)
            elif self.dropped:
                out.append(self._marker(time.time()))
            elif self.ended is not None and not self.end_told:
                self.end_told = True
                out.append(Change("finished", "", True, time.time(), reason=self.ended))
            else:
                break
        return out

    def _end(self, reason: Reason) -> None:
        if self.ended is None:
            self.ended = reason

    # -- the bounded queue -------------------------------------------------------------

    def _lose(self, reason: Reason) -> None:
        if not self.dropped:
            self.drop_reason = reason
        self.dropped += 1

    def _marker(self, at: float) -> Change:
        change = Change(
            "overflow", "", True, at, dropped=self.dropped, reason=self.drop_reason or "queue"
        )
        self.dropped, self.drop_reason = 0, None
        return change

    def _push(self, change: Change) -> None:
        """Queue a change; the agent's own temp files as the files they become:
        their changes are held until the rename into place, then reported as
        `create` (a file that did not exist), `chmod` and `write` of the file."""
        name = change.path.rsplit("/", 1)[-1]
        if (
            change.kind in ("create", "write", "chmod", "remove")
            and tempfiles.existed(name) is not None
        ):
            if change.kind == "remove":  # a write that failed: nothing to report
                self.temps.pop(change.path, None)
            elif change.path in self.temps or len(self.temps) < self.limits.queue:
                self.temps.setdefault(change.path, set()).add(change.kind)
            return
        if change.kind == "rename" and change.old is not None:
            existed = tempfiles.existed(change.old.rsplit("/", 1)[-1])
            if existed is not None:
                kinds = self.temps.pop(change.old, set())
                for kind in _AS_WRITTEN:
                    if (kind == "create" and not existed) or (kind != "create" and kind in kinds):
                        self._queue(change._replace(kind=kind, old=None, move=None))
                return
        self._queue(change)

    def _queue(self, change: Change) -> None:
        q = self.queue
        if self.dropped:
            if len(q) > self.limits.queue // 2:
                self.dropped += 1  # still draining: one overflow for the whole burst
                return
            q.append(self._marker(change.at))
        if len(q) >= self.limits.queue:
            self._lose("queue")
            return
        if change.kind in ("write", "chmod"):
            key = (change.kind, change.path)
            if key in self.waiting:
                return
            self.waiting.add(key)
        q.append(change)
        if self.wake is not None:
            self.wake.set()


class Watcher(Stream):
    """The inotify side of one watch stream. ``open`` adds the watches;
    ``start`` attaches the descriptor to the running loop; ``close`` ends it
    all (also done when the object is dropped unclosed, so a stream that never
    started leaks nothing)."""

    mode: Mode = "inotify"

    def __init__(self, ws: Workspace, rel: str, recursive: bool, limits: Limits) -> None:
        super().__init__(ws, rel, recursive, limits)
        self.fd = -1
        self.root_wd = -1
        self.dirs: dict[int, str] = {}  # watch descriptor -> directory, relative ('' root)
        # Files created or modified since their last close (the IN_CLOSE_WRITE rule).
        self.changed: set[str] = set()
        self.moves: dict[int, tuple[str, bool, float]] = {}  # cookie -> MOVED_FROM
        self.move_timer: asyncio.TimerHandle | None = None
        self.rescan_pending = False
        self._finalizer: weakref.finalize[[int], Watcher] | None = None

    @property
    def watched(self) -> int:
        return len(self.dirs)

    # -- set-up (in a thread) -----------------------------------------------------

    def open(self) -> None:
        """Watch the directory (and, recursive, every directory below it).
        NotFound / Invalid / Forbidden as the other file operations; Busy when a
        limit (ours or the kernel's) is reached."""
        dir_fd, _resolved = self.ws.open_dir(self.requested)
        try:
            try:
                self.fd = inotify.init()
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                    raise Busy(
                        "inotify_limit",
                        "the kernel refuses another inotify instance"
                        " (fs.inotify.max_user_instances): retry later",
                    ) from None
                raise
            self._finalizer = weakref.finalize(self, os.close, self.fd)
            self.root_wd = self._add(dir_fd, "")
            if self.recursive:
                self._walk(dir_fd, "", report=False, budget=None)
        except BaseException:
            self.close()
            raise
        finally:
            os.close(dir_fd)
        self.opened = True

    def _add(self, dir_fd: int, rel: str) -> int:
        """Watch the directory open as ``dir_fd``; -1 (after noting the loss) when
        a limit stops it once the stream runs."""
        if len(self.dirs) >= self.limits.directories:
            if not self.opened:
                raise Busy(
                    "too_many_watched_directories",
                    f"more than {self.limits.directories} directories to watch"
                    " (SANDBOX_AGENT_WATCH_MAX_DIRECTORIES): watch a smaller tree,"
                    " or without recursive",
                )
            self._lose("watch_limit")
            return -1
        try:
            wd = inotify.add_watch(self.fd, dir_fd, MASK)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                if self.opened or rel:
                    return -1  # gone meanwhile, or not readable: nothing to watch
                raise
            if not self.opened:
                raise Busy(
                    "inotify_limit",
                    "the kernel refuses more inotify watches (fs.inotify.max_user_watches)",
                ) from None
            self._lose("watch_limit")
            return -1
        self.dirs[wd] = rel  # the same wd again: a directory seen under a new name
        return wd

    def _walk(self, dir_fd: int, rel: str, *, report: bool, budget: list[int] | None) -> None:
        """Watch the directories below ``dir_fd`` (depth first, by descriptor);
        ``report``: queue a ``create`` for each entry found (a directory that
        appeared with contents). ``budget``: entries left to look at."""
        stack: list[tuple[int, str, int]] = []  # (fd we opened, rel, depth)
        current, current_rel, depth = dir_fd, rel, 0
        try:
            while True:
                # Entries one at a time (a directory may hold millions); what is
                # kept is a descriptor per watched subdirectory, as many as watches.
                with contextlib.suppress(OSError), os.scandir(current) as entries:
                    for entry in entries:
                        if budget is not None:
                            if budget[0] <= 0:
                                self._lose("queue")
                                return
                            budget[0] -= 1
                        sub = self._entry(current, current_rel, entry, report, depth)
                        if sub is not None:
                            stack.append(sub)
                if current != dir_fd:
                    os.close(current)
                if not stack:
                    current = dir_fd
                    return
                current, current_rel, depth = stack.pop()
        finally:
            if current != dir_fd:
                os.close(current)
            for fd, _, _ in stack:
                os.close(fd)

    def _entry(
        self, parent: int, parent_rel: str, entry: os.DirEntry[str], report: bool, depth: int
    ) -> tuple[int, str, int] | None:
        """Report one entry of a walk; a subdirectory is opened and watched, and
        returned (descriptor, path, depth) for the walk to go into."""
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            return None
        child = posixpath.join(parent_rel, entry.name) if parent_rel else entry.name
        if report:
            self._push(Change("create", child, is_dir, time.time()))
        if not is_dir or depth >= MAX_DEPTH:
            return None
        try:
            sub = os.open(entry.name, _OPEN_DIR, dir_fd=parent)
        except OSError:
            return None  # gone, swapped for a symlink or a file, unreadable
        if self._add(sub, child) < 0:
            os.close(sub)
            return None
        return sub, child, depth + 1

    # -- running (on the loop) ------------------------------------------------------

    def start(self) -> None:
        super().start()
        assert self.loop is not None
        self.loop.add_reader(self.fd, self._readable)

    def close(self) -> None:
        """Closing the inotify descriptor removes every watch it holds."""
        if self.loop is not None and self.fd >= 0:
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self.fd)
        if self.move_timer is not None:
            self.move_timer.cancel()
            self.move_timer = None
        if self._finalizer is not None:
            self._finalizer()  # os.close, once
        self.fd = -1
        self.dirs.clear()
        super().close()

    def read_pending(self) -> None:
        if self.fd >= 0 and self.ended is None and self.wake is not None:
            self._readable()

    def _readable(self) -> None:
        try:
            buf = os.read(self.fd, READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            self._end("unmounted")
            buf = b""
        now = time.time()
        for event in inotify.parse(buf):
            self._event(event, now)
            if self.ended is not None:
                break
        if self.ended is not None and self.loop is not None:
            self.loop.remove_reader(self.fd)
        if self.moves and self.move_timer is None and self.loop is not None:
            self.move_timer = self.loop.call_later(MOVE_WAIT, self._moved_out)
        assert self.wake is not None
        self.wake.set()

    def _event(self, ev: inotify.Event, now: float) -> None:
        mask = ev.mask
        if mask & inotify.IN_Q_OVERFLOW:
            self._lose("kernel")
            if self.recursive and self.loop is not None and not self.rescan_pending:
                # Directories made while the kernel dropped events have no watch
                # yet: walk the tree again (a watched one costs a system call).
                self.rescan_pending = True
                self.loop.call_soon(self._rescan)
            return
        base = self.dirs.get(ev.wd)
        if base is None:
            return  # a watch already given up (its directory moved out or removed)
        is_root = ev.wd == self.root_wd
        if mask & inotify.IN_IGNORED:
            self.dirs.pop(ev.wd, None)
            if is_root:
                self._end("removed")
            return
        if mask & inotify.IN_UNMOUNT:
            self._end("unmounted")
            return
        is_dir = bool(mask & inotify.IN_ISDIR)
        if not ev.name:
            # About the watched directory itself. Below the root its parent's
            # watch reports the same change by name: only the root's count.
            if is_root:
                if mask & inotify.IN_ATTRIB:
                    self._push(Change("chmod", "", True, now))
                if mask & inotify.IN_DELETE_SELF:
                    self._push(Change("remove", "", True, now))
                    self._end("removed")
                elif mask & inotify.IN_MOVE_SELF:
                    self._end("moved")
            return
        name = os.fsdecode(ev.name)
        rel = posixpath.join(base, name) if base else name
        if mask & inotify.IN_CREATE:
            self._push(Change("create", rel, is_dir, now))
            if is_dir and self.recursive:
                self._subtree(rel)
            elif not is_dir:
                self._changed(rel)
        if mask & inotify.IN_MODIFY:
            self._changed(rel)
            self._push(Change("write", rel, False, now))
        if mask & inotify.IN_ATTRIB:
            self._push(Change("chmod", rel, is_dir, now))
        if mask & inotify.IN_CLOSE_WRITE:
            if rel in self.changed:
                self.changed.discard(rel)
            else:
                self._push(Change("write", rel, False, now))
        if mask & inotify.IN_MOVED_FROM:
            self.changed.discard(rel)
            self.moves[ev.cookie] = (rel, is_dir, now)
        if mask & inotify.IN_MOVED_TO:
            self._moved_in(ev.cookie, rel, is_dir, now)
        if mask & inotify.IN_DELETE:
            self.changed.discard(rel)
            self._push(Change("remove", rel, is_dir, now))

    def _rescan(self) -> None:
        self.rescan_pending = False
        if self.closed or self.ended is not None:
            return
        try:
            dir_fd, _ = self.ws.open_dir(self.shown)
        except Exception:  # gone meanwhile: its own events end the stream
            return
        try:
            self._walk(dir_fd, "", report=False, budget=None)
        finally:
            os.close(dir_fd)

    def _changed(self, rel: str) -> None:
        if len(self.changed) >= self.limits.queue:
            self.changed.clear()  # bounded: at worst a close gives one more write
        self.changed.add(rel)

    def _moved_in(self, cookie: int, rel: str, is_dir: bool, now: float) -> None:
        source = self.moves.pop(cookie, None)
        if source is None:
            self._push(Change("rename", rel, is_dir, now, move="in"))
            if is_dir and self.recursive:
                self._subtree(rel)
            return
        old = source[0]
        self._push(Change("rename", rel, is_dir, now, old=old, move="within"))
        if is_dir and self.recursive:
            # Its watches follow the directory: only their names change.
            prefix = old + "/"
            for wd, path in list(self.dirs.items()):
                if path == old:
                    self.dirs[wd] = rel
                elif path.startswith(prefix):
                    self.dirs[wd] = rel + path[len(old) :]

    def _moved_out(self) -> None:
        """MOVED_FROMs whose MOVED_TO did not come: moved out of the watch."""
        self.move_timer = None
        moves, self.moves = self.moves, {}
        for rel, is_dir, at in moves.values():
            self._push(Change("rename", rel, is_dir, at, move="out"))
            if is_dir and self.recursive:
                self._unwatch(rel)
        if self.wake is not None:
            self.wake.set()

    def _unwatch(self, rel: str) -> None:
        prefix = rel + "/"
        for wd, path in list(self.dirs.items()):
            if path == rel or path.startswith(prefix):
                del self.dirs[wd]
                with contextlib.suppress(OSError):
                    inotify.rm_watch(self.fd, wd)

    def _subtree(self, rel: str) -> None:
        """A directory appeared (made, or moved in): watch it and what is below,
        and report what it already holds (made before its watch was added)."""
        try:
            with self.ws.locate(posixpath.join(self.shown, rel), follow=False) as loc:
                fd = os.open(loc.name, _OPEN_DIR, dir_fd=loc.dir_fd)
        except Exception:  # gone already, swapped for a symlink, or out of reach
            return
        try:
            if self._add(fd, rel) >= 0:
                self._walk(fd, rel, report=True, budget=[self.limits.queue])
        finally:
            os.close(fd)


async def events(
    w: Stream, keepalive: float, seconds: float
) -> AsyncGenerator[models.WatchEvent, None]:
    """The stream of an opened watcher: ``started``, changes, ``keepalive`` while
    idle, and ``finished`` when the directory went away or ``seconds`` (0:
    no limit) passed. Closes the watcher however it ends (a client that leaves
    cancels it)."""
    deadline = time.monotonic() + seconds if seconds else None
    metrics.WATCHES.inc()
    try:
        # Attached to the loop only now: until the stream runs, nothing but the
        # stream refers to the watcher, so one whose client left before its
        # first event is dropped, and closed, with it.
        w.start()
        yield models.WatchEvent(
            type="started",
            time=models.rfc3339(time.time()),
            path=display(w.shown),
            recursive=w.recursive,
            watches=w.watched,
            mode=w.mode,
            poll_interval=w.poll_interval,
        )
        while True:
            wait = keepalive
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    yield models.WatchEvent(
                        type="finished", time=models.rfc3339(time.time()), reason="timeout"
                    )
                    return
            change = await w.next(wait)
            if change is None:
                if deadline is None or time.monotonic() < deadline:
                    yield models.WatchEvent(type="keepalive", time=models.rfc3339(time.time()))
                continue
            metrics.WATCH_EVENTS.labels(change.kind).inc()
            yield event_of(w, change)
            if change.kind == "finished":
                return
    finally:
        metrics.WATCHES.dec()
        w.close()


def event_of(w: Stream, c: Change) -> models.WatchEvent:
    def shown(rel: str) -> str:
        if not rel:
            return display(w.shown)
        return display(rel if w.shown == "." else f"{w.shown}/{rel}")

    stamp = models.rfc3339(c.at)
    if c.kind == "overflow":
        return models.WatchEvent(type="overflow", time=stamp, dropped=c.dropped, reason=c.reason)
    if c.kind == "finished":
        return models.WatchEvent(type="finished", time=stamp, reason=c.reason)
    return models.WatchEvent(
        type=c.kind,
        time=stamp,
        path=shown(c.path),
        file_type="directory" if c.is_dir else "file",
        old_path=None if c.old is None else shown(c.old),
        move=c.move,
    )
