"""Tar download and upload of workspace directories.

Upload is validated before anything is written: every entry's name, type and
size is checked in one pass over the headers (so a member claiming a huge
size is refused before its data is decompressed), then extraction runs with
tarfile's "data" filter as a second line of defence against escapes.
"""

from __future__ import annotations

import contextlib
import copy
import os
import queue
import stat as st
import tarfile
import threading
from typing import IO, Any

from . import models
from .config import Settings
from .errors import Invalid, TooLarge
from .files import os_errors
from .paths import Workspace

CHUNK = 1 << 20


def _refuse(name: str, why: str) -> Invalid:
    return Invalid(
        "archive_entry_refused", f"archive entry {name[:200]!r}: {why}", entry=name[:300]
    )


def _group_like_owner(mode: int) -> int:
    """Give the group the owner's bits: the sandbox user shares our group, not our UID."""
    mode &= 0o777
    return mode | ((mode & 0o700) >> 3)


def _check_member(m: tarfile.TarInfo, names: set[str]) -> None:
    name = m.name
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or "\\" in name:
        raise _refuse(name, "absolute path")
    if ".." in parts:
        raise _refuse(name, "'..' component")
    if "\0" in name:
        raise _refuse(name, "NUL in name")
    if (
        m.ischr()
        or m.isblk()
        or m.isfifo()
        or not (m.isreg() or m.isdir() or m.issym() or m.islnk())
    ):
        raise _refuse(name, "device files, FIFOs and other special files are not allowed")
    if m.issym():
        target = m.linkname
        if target.startswith("/"):
            raise _refuse(name, "absolute symlink target")
        base = os.path.dirname("/".join(parts))
        resolved = os.path.normpath(os.path.join("/root", base, target))
        if not resolved.startswith("/root/") and resolved != "/root":
            raise _refuse(name, "symlink points outside the extraction directory")
    if m.islnk():
        target = os.path.normpath(m.linkname.lstrip("./") or ".")
        if m.linkname.startswith("/") or ".." in target.split("/") or target not in names:
            raise _refuse(name, "hard link to a file outside the archive")
    names.add(os.path.normpath("/".join(parts) or "."))


def scan(tar: tarfile.TarFile, s: Settings) -> list[tarfile.TarInfo]:
    members: list[tarfile.TarInfo] = []
    names: set[str] = set()
    total = 0
    while True:
        try:
            m = tar.next()
        except tarfile.TarError as exc:
            raise Invalid("invalid_archive", f"not a valid tar archive: {exc}") from None
        except (EOFError, OSError, ValueError) as exc:
            raise Invalid("invalid_archive", f"archive is truncated or corrupt: {exc}") from None
        if m is None:
            break
        if len(members) >= s.max_archive_entries:
            raise TooLarge(
                "archive_too_large", f"archive has more than {s.max_archive_entries} entries"
            )
        _check_member(m, names)
        total += max(m.size, 0)
        if total > s.max_extract_bytes:
            raise TooLarge(
                "archive_too_large",
                f"archive unpacks to more than {s.max_extract_bytes} bytes",
            )
        members.append(m)
    return members


def _filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    try:
        new = tarfile.data_filter(member, dest)
    except tarfile.FilterError as exc:
        raise _refuse(member.name, str(exc)) from None
    if new is None:
        return None
    if member.isreg() or member.isdir():
        base = 0o700 if member.isdir() else 0o600
        return new.replace(mode=_group_like_owner(member.mode | base), deep=False)
    return new


# Debian bookworm's python3 (3.11.2, the agent image's) predates tarfile's
# extraction filters (3.11.4): `extract(filter=...)` is a TypeError there.
_HAS_FILTERS = hasattr(tarfile, "data_filter")


def _normalized(member: tarfile.TarInfo) -> tarfile.TarInfo:
    """What `_filter` does, where tarfile has no filters: scan() has already
    refused every name, type and link that could leave the directory; here the
    modes lose setuid/setgid/sticky bits and the ownership is our own."""
    new = copy.copy(member)
    if member.isreg() or member.isdir():
        base = 0o700 if member.isdir() else 0o600
        new.mode = _group_like_owner(member.mode | base)
    new.uid, new.gid, new.uname, new.gname = os.getuid(), os.getgid(), "", ""
    return new


def extract(ws: Workspace, rel: str, spool: IO[bytes], s: Settings) -> models.ArchiveResult:
    dest = ws.resolve(rel)
    with os_errors(rel):
        os.makedirs(dest, exist_ok=True)
    ws.confine(os.path.realpath(dest), rel)
    try:
        tar = tarfile.open(fileobj=spool, mode="r:*")  # noqa: SIM115 - closed by the with below
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise Invalid("invalid_archive", f"not a valid tar archive: {exc}") from None
    with tar:
        members = scan(tar, s)
        total = 0
        for m in members:
            # Re-check against the live filesystem right before writing: user
            # code may have planted a symlink in the destination.
            target_rel = os.path.normpath(os.path.join(rel, m.name))
            ws.resolve(target_rel, follow=False)
            with os_errors(target_rel):
                if m.isreg() or m.issym():
                    # tarfile does not replace an existing symlink atomically;
                    # remove what is there so we never write through it.
                    existing = os.path.join(dest, m.name)
                    if os.path.islink(existing):
                        os.unlink(existing)
                try:
                    if _HAS_FILTERS:
                        tar.extract(m, dest, filter=_filter)
                    else:
                        tar.extract(_normalized(m), dest)
                except (tarfile.TarError, EOFError) as exc:
                    raise Invalid("invalid_archive", f"cannot extract {m.name!r}: {exc}") from None
            total += max(m.size, 0)
    return models.ArchiveResult(path=ws.relative(dest), entries=len(members), bytes=total)


class _Stopped(Exception):
    """The consumer went away (client disconnected): stop producing."""


class _QueueWriter:
    """File-like sink for tarfile that hands ~1 MiB chunks to the consumer."""

    def __init__(self, q: queue.Queue[bytes | BaseException | None], stop: threading.Event):
        self.q = q
        self.stop = stop
        self.buf = bytearray()

    def put(self, item: bytes | BaseException | None) -> None:
        while True:
            if self.stop.is_set():
                raise _Stopped()
            try:
                self.q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def write(self, data: bytes) -> int:
        self.buf += data
        if len(self.buf) >= CHUNK:
            self.put(bytes(self.buf))
            self.buf.clear()
        return len(data)

    def flush(self) -> None:
        if self.buf:
            self.put(bytes(self.buf))
            self.buf.clear()


def _add_tree(ws: Workspace, tar: tarfile.TarFile, root: str, arc_root: str) -> None:
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in [".", *sorted(filenames), *dirnames]:
            path = dirpath if name == "." else os.path.join(dirpath, name)
            if name != "." and os.path.isdir(path) and not os.path.islink(path):
                continue  # directories are added when os.walk enters them
            rel = os.path.relpath(path, root)
            arcname = arc_root if rel == "." else f"{arc_root}/{rel}" if arc_root else rel
            try:
                s = os.lstat(path)
            except OSError:
                continue
            if st.S_ISREG(s.st_mode):
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
                except OSError:
                    continue
                with os.fdopen(fd, "rb") as f:
                    ws.check_fd(fd, rel)
                    ti = tar.gettarinfo(arcname=arcname or ".", fileobj=f)
                    tar.addfile(ti, f)
            elif (st.S_ISDIR(s.st_mode) or st.S_ISLNK(s.st_mode)) and arcname:
                tar.add(path, arcname=arcname, recursive=False)
            # sockets, FIFOs and devices are left out


class TarStream:
    """A directory as tar bytes, produced by a thread; ``close()`` stops it early."""

    def __init__(self, ws: Workspace, rel: str, gzip: bool) -> None:
        root = ws.resolve(rel)
        if not os.path.isdir(root):
            with os_errors(rel):
                os.stat(root)
            raise Invalid("not_a_directory", f"not a directory: {rel}")
        self.q: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=8)
        self.stop = threading.Event()
        writer = _QueueWriter(self.q, self.stop)

        def produce() -> None:
            try:
                sink: Any = writer
                fmt = tarfile.PAX_FORMAT
                with (
                    tarfile.open(fileobj=sink, mode="w|gz", format=fmt)
                    if gzip
                    else tarfile.open(fileobj=sink, mode="w|", format=fmt)
                ) as tar:
                    _add_tree(ws, tar, root, "")
                writer.flush()
                writer.put(None)
            except _Stopped:
                pass
            except BaseException as exc:
                with contextlib.suppress(_Stopped):
                    writer.put(exc)

        threading.Thread(target=produce, daemon=True, name="tar-producer").start()

    def next_chunk(self) -> bytes | None:
        """Blocking: the next chunk, or None at the end (or after close())."""
        while not self.stop.is_set():
            try:
                item = self.q.get(timeout=0.5)
            except queue.Empty:
                continue
            if isinstance(item, BaseException):
                raise item
            return item
        return None

    def close(self) -> None:
        self.stop.set()
