"""Directory watches by polling, where inotify cannot see the sandbox's changes.

Why. Under gVisor every container of a pod mounts a pod volume as a
filesystem of its own in gVisor's kernel (a gofer mount, ``9p`` in
/proc/self/mountinfo, one device number per container). inotify events are
raised on the filesystem a change went through, so a file the sandbox
container writes through its mount raises nothing on the agent's mount of the
same volume: the agent's watch stays silent (gVisor issues 8089 and 11326).
The agent does read the change when it looks (those mounts revalidate against
the host file on each access, ``cache=remote_revalidating``), so comparing
scans finds it. gVisor's own remedy, mount hints
(``dev.gvisor.spec.mount.NAME.share: pod``), shares only tmpfs volumes between
containers (``ShouldShareMount`` in runsc/boot/mount_hints.go): a workspace in
the sandbox's memory instead of on its volume, which a Sandbox cannot be.

So ``choose_mode`` polls on such a filesystem (and where a setting says so),
and ``Poller`` is a watch stream (``watch.Stream``: the same queue, overflow
and end) fed by scans: every ``interval`` seconds it lists the tree by
descriptor (subdirectories opened with ``O_NOFOLLOW`` relative to their
parent, as the inotify side walks) and ``diff`` turns what changed since the
previous scan into the same events. What it cannot see, it does not claim:

- a change is the difference between two scans: what was made and removed
  between them is not reported, and several writes are one;
- ``write`` is a changed size or modification time (or a file replaced under
  its name), ``chmod`` a changed mode or owner; a file that appears with
  content is ``create`` then ``write``;
- ``rename`` is recognised by inode number within the watch (a directory's
  contents move with it, unreported); moved out reads as ``remove`` (each
  entry below it too), moved in as ``create``. A file removed and another
  made under a new name in the same interval may reuse the inode and read as
  a rename, with a ``write`` when its content differs;
- the watched directory gone from its path ends the stream as ``removed``
  (after a ``remove`` of each entry it held, and of itself) or ``moved``;
  where the link count cannot tell (gVisor), an empty directory moved away
  reads as removed.

Bounds: at most ``Limits.entries`` entries and ``Limits.directories``
directories per stream (over them at the start: 429; later: one ``overflow``
with reason ``watch_limit``, then nothing until the tree is back under, when
the next scan reports what changed meanwhile). A scan runs in a thread, one
at a time per stream, and the pause before the next grows with a large tree
so that scanning takes at most ``SCAN_SHARE`` of a core.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import posixpath
import re
import stat
import threading
import time
import weakref
from typing import NamedTuple

from .errors import Busy
from .paths import Workspace
from .watch import _OPEN_DIR, MAX_DEPTH, Change, Limits, Mode, Reason, Stream

# Filesystems on which the agent's inotify misses other containers' changes:
# gVisor's gofer mounts (named 9p in its mountinfo, as Linux's 9p client is,
# which has no change notification either).
INOTIFY_BLIND = frozenset({"9p"})
SCAN_SHARE = 0.1  # at most this share of a core spent scanning (a large tree waits longer)


class Entry(NamedTuple):
    """What one scan saw of a path (``os.lstat``)."""

    ino: int
    is_dir: bool
    content: tuple[int, int]  # (mtime_ns, size): changed, a write
    attrs: tuple[int, int, int]  # (permission bits, uid, gid): changed, a chmod


Snapshot = dict[str, Entry]  # path relative to the watched directory ('' itself) -> entry


def entry_of(st: os.stat_result) -> Entry:
    return Entry(
        st.st_ino,
        stat.S_ISDIR(st.st_mode),
        (st.st_mtime_ns, st.st_size),
        (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid),
    )


_ESCAPE = re.compile(r"\\([0-7]{3})")


def mount_type(mountinfo: str, path: str) -> str | None:
    """The filesystem type of the mount that holds ``path`` (absolute, resolved),
    from the text of /proc/self/mountinfo: the longest mount point containing
    it, the last one mounted where several share a point."""
    best, found = -1, None
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) <= sep + 1 or len(fields) < 5:
            continue
        point = _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:
            best, found = len(point), fields[sep + 1]
    return found


@functools.lru_cache(maxsize=8)
def choose_mode(setting: str, root: str) -> Mode:
    """How watches of the workspace at ``root`` find changes: the setting
    (SANDBOX_AGENT_WATCH_MODE) when it names one, else poll on a filesystem
    whose other writers inotify does not hear (see the module's docstring).
    Cached: a pod's mounts do not change under a running agent."""
    if setting in ("inotify", "poll"):
        return "poll" if setting == "poll" else "inotify"
    try:
        with open("/proc/self/mountinfo") as f:
            fstype = mount_type(f.read(), root)
    except OSError:
        return "inotify"
    return "poll" if fstype in INOTIFY_BLIND else "inotify"


def _depth(path: str) -> int:
    return path.count("/")


def _ident(e: Entry) -> tuple[int, bool]:
    return e.ino, e.is_dir


def diff(old: Snapshot, new: Snapshot, at: float) -> list[Change]:
    """The changes from scan ``old`` to scan ``new`` (see the module's
    docstring): removes deepest first, then renames and creates shallowest
    first (a directory before what it holds), then writes and chmods."""
    if old == new:
        return []  # the usual case, compared in C: an idle tree costs its scan only
    vanished = {p: e for p, e in old.items() if p and (p not in new or _ident(new[p]) != _ident(e))}
    appeared = sorted(
        (p for p, e in new.items() if p and (p not in old or _ident(old[p]) != _ident(e))),
        key=lambda p: (_depth(p), p),
    )
    by_id: dict[tuple[int, bool], str] = {}
    for p in sorted(vanished, key=lambda p: (_depth(p), p)):
        by_id.setdefault(_ident(vanished[p]), p)  # hard links: the first name stands

    moved: dict[str, str] = {}  # directory renamed in this interval: new path -> old path
    kept: set[str] = set()  # vanished paths accounted for (renamed, or replaced in place)
    renames: list[Change] = []
    creates: list[Change] = []
    updates: list[Change] = []

    def updated(path: str, before: Entry, after: Entry) -> None:
        if not after.is_dir and before.content != after.content:
            updates.append(Change("write", path, False, at))
        if before.attrs != after.attrs:
            updates.append(Change("chmod", path, after.is_dir, at))

    for p in appeared:
        e = new[p]
        src = by_id.pop(_ident(e), None)
        if src is not None:
            kept.add(src)
            parent, name = posixpath.split(p)
            if e.is_dir:
                moved[p] = src
            # Below a directory renamed in this interval, under the same name:
            # it moved with its directory, which is the one rename reported.
            if not (parent in moved and posixpath.join(moved[parent], name) == src):
                renames.append(Change("rename", p, e.is_dir, at, old=src, move="within"))
            updated(p, old[src], e)
            continue
        before = old.get(p)
        if before is not None and not before.is_dir and not e.is_dir:
            # Another file under the same name (written elsewhere, renamed over
            # it): for the client, its content changed.
            kept.add(p)
            updates.append(Change("write", p, False, at))
            if before.attrs != e.attrs:
                updates.append(Change("chmod", p, False, at))
            continue
        creates.append(Change("create", p, e.is_dir, at))
        if not e.is_dir and e.content[1] > 0:
            creates.append(Change("write", p, False, at))

    removes = [
        Change("remove", p, e.is_dir, at)
        for p, e in sorted(vanished.items(), key=lambda item: (-_depth(item[0]), item[0]))
        # Renamed, replaced, or written over by a rename (which removes nothing
        # the client knew under another name).
        if p not in kept and not (p in new and not e.is_dir and not new[p].is_dir)
    ]
    for p, e in new.items():
        before = old.get(p)
        if before is not None and _ident(before) == _ident(e):
            updated(p, before, e)  # '' (the watched directory): its own chmod only
    return removes + renames + creates + updates


class _TooMany(Exception):
    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class _Scan(NamedTuple):
    """What one poll found, applied on the loop: changes, lost to a limit, ended."""

    changes: list[Change]
    over_limit: bool = False
    ended: Reason | None = None
    cpu: float = 0.0  # CPU seconds the poll took (its thread's)


class Poller(Stream):
    """The polling side of one watch stream (see the module's docstring)."""

    mode: Mode = "poll"

    def __init__(
        self, ws: Workspace, rel: str, recursive: bool, limits: Limits, interval: float
    ) -> None:
        super().__init__(ws, rel, recursive, limits)
        self.interval = interval
        self.poll_interval = interval
        self.root_fd = -1
        self.root_id: tuple[int, int] = (-1, -1)  # (st_dev, st_ino) of the watched directory
        self.snapshot: Snapshot = {}
        self.dirs = 0
        self.over_limit = False
        # The root descriptor against close() while a scan runs in a thread:
        # a scan works on a duplicate taken under the lock, never on a number
        # that close() may have freed (and the process reused) meanwhile.
        self.lock = threading.Lock()
        self.task: asyncio.Task[None] | None = None
        # Closes the root descriptor also when the stream never started (its
        # client left first) and the object is simply dropped.
        self._finalizer: weakref.finalize[[int], Poller] | None = None

    @property
    def watched(self) -> int:
        return self.dirs

    # -- set-up (in a thread) -----------------------------------------------------

    def open(self) -> None:
        """Scan the directory once (the state later changes are measured from).
        NotFound / Invalid / Forbidden as the other file operations; Busy when a
        limit is reached."""
        fd, _resolved = self.ws.open_dir(self.requested)
        self.root_fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)
        try:
            st = os.fstat(fd)
            self.root_id = (st.st_dev, st.st_ino)
            try:
                self.snapshot, self.dirs = self._scan(fd)
            except _TooMany as exc:
                if exc.what == "directories":
                    raise Busy(
                        "too_many_watched_directories",
                        f"more than {self.limits.directories} directories to watch"
                        " (SANDBOX_AGENT_WATCH_MAX_DIRECTORIES): watch a smaller tree,"
                        " or without recursive",
                    ) from None
                raise Busy(
                    "too_many_watched_entries",
                    f"more than {self.limits.entries} entries to scan"
                    " (SANDBOX_AGENT_WATCH_POLL_MAX_ENTRIES): watch a smaller tree,"
                    " or without recursive",
                ) from None
        except BaseException:
            self.close()
            raise
        self.opened = True

    def _scan(self, root_fd: int) -> tuple[Snapshot, int]:
        """Every entry below the directory open as ``root_fd`` (itself as ''),
        and how many directories were listed. Depth first, one open
        descriptor per level; _TooMany past a limit."""
        snap: Snapshot = {"": entry_of(os.fstat(root_fd))}
        dirs = 1
        limits = self.limits

        def listing(fd: int, rel: str, depth: int) -> list[str]:
            """Note the entries of one directory; its subdirectories' names."""
            below: list[str] = []
            # From the start: a directory descriptor keeps its offset, and a
            # rewind is what makes gVisor list the directory afresh.
            os.lseek(fd, 0, os.SEEK_SET)
            with contextlib.suppress(OSError), os.scandir(fd) as entries:
                for entry in entries:
                    try:
                        found = entry_of(entry.stat(follow_symlinks=False))
                    except OSError:
                        continue  # gone meanwhile
                    if len(snap) > limits.entries:
                        raise _TooMany("entries")
                    # Not posixpath.join: a quarter of a scan's time went there.
                    path = f"{rel}/{entry.name}" if rel else entry.name
                    snap[path] = found
                    if found.is_dir and self.recursive and depth < MAX_DEPTH:
                        below.append(entry.name)
            return below

        stack: list[tuple[int, str, list[str]]] = []
        try:
            stack.append((root_fd, "", listing(root_fd, "", 0)))
            while stack:
                fd, rel, below = stack[-1]
                if not below:
                    stack.pop()
                    if fd != root_fd:
                        os.close(fd)
                    continue
                name = below.pop()
                try:
                    sub = os.open(name, _OPEN_DIR, dir_fd=fd)
                except OSError:
                    continue  # gone, swapped for a symlink or a file, unreadable
                path = f"{rel}/{name}" if rel else name
                stack.append((sub, path, []))  # on the stack first: closed however this ends
                dirs += 1
                if dirs > limits.directories:
                    raise _TooMany("directories")
                stack[-1] = (sub, path, listing(sub, path, len(stack) - 1))
        finally:
            for fd, _, _ in stack:
                if fd != root_fd:
                    os.close(fd)
        return snap, dirs

    # -- running (on the loop; scans in a thread) -----------------------------------

    def start(self) -> None:
        super().start()
        assert self.loop is not None
        self.task = self.loop.create_task(self._run())

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None
        with self.lock:
            if self._finalizer is not None:
                self._finalizer()  # os.close, once
            self.root_fd = -1
            super().close()
        self.snapshot = {}

    async def _run(self) -> None:
        pause = self.interval
        while not self.closed and self.ended is None:
            await asyncio.sleep(pause)
            try:
                found = await asyncio.to_thread(self._poll)
            except OSError:
                # The directory can no longer be read (its volume went away):
                # as the inotify side, the stream ends rather than going quiet.
                found = _Scan([], ended="unmounted")
            # By the scan's CPU time, not its wall time: on a busy machine a
            # scan waits for a core, which is no reason to look less often.
            pause = max(self.interval, found.cpu * (1 - SCAN_SHARE) / SCAN_SHARE)
            if self.closed:
                return
            for change in found.changes:
                self._push(change)
            if found.over_limit:
                self._lose("watch_limit")
            if found.ended is not None:
                self._end(found.ended)
            assert self.wake is not None
            self.wake.set()

    def _poll(self) -> _Scan:
        """One scan compared with the previous one (in a thread), with the CPU
        time it took."""
        began = time.thread_time()
        found = self._compare()
        return found._replace(cpu=time.thread_time() - began)

    def _compare(self) -> _Scan:
        with self.lock:
            if self.closed:
                return _Scan([])
            fd = os.dup(self.root_fd)
        try:
            at = time.time()
            gone = self._root_gone(fd)
            if gone == "removed":
                # As inotify reports a tree removed: what was in it, then itself.
                known = sorted((p for p in self.snapshot if p), key=lambda p: (-_depth(p), p))
                changes = [Change("remove", p, self.snapshot[p].is_dir, at) for p in known]
                changes.append(Change("remove", "", True, at))
                return _Scan(changes, ended="removed")
            if gone == "moved":
                return _Scan([], ended="moved")
            try:
                new, dirs = self._scan(fd)
            except _TooMany:
                lost, self.over_limit = not self.over_limit, True
                return _Scan([], over_limit=lost)  # one overflow; the last scan stands
            self.over_limit = False
            changes = diff(self.snapshot, new, at)
            self.snapshot, self.dirs = new, dirs
            return _Scan(changes)
        finally:
            os.close(fd)

    def _root_gone(self, fd: int) -> Reason | None:
        """Whether the watched directory was removed, or moved away from its path
        (the scans would go on following it, as an inotify watch does, but the
        inotify side ends the stream then, and so does this one)."""
        try:
            again, _ = self.ws.open_dir(self.requested)
        except Exception:  # not found, or no longer a directory there
            again = -1
        if again >= 0:
            try:
                st = os.fstat(again)
            finally:
                os.close(again)
            if (st.st_dev, st.st_ino) == self.root_id:
                return None
        # Gone from its path. Removed, when its link count says so, or when it
        # holds nothing (only an empty directory can be removed): under gVisor
        # a directory removed by the other container keeps its link count in
        # this one's view, but lists empty. So an empty directory moved away
        # reads as removed there.
        if os.fstat(fd).st_nlink == 0:
            return "removed"
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            with os.scandir(fd) as entries:
                empty = next(entries, None) is None
        except OSError:
            empty = True
        return "removed" if empty else "moved"
