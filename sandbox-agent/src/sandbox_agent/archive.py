"""Tar download and upload of workspace directories.

Upload is all or nothing: the archive is unpacked into a private staging
directory inside the destination (mode 0700, every step relative to its
descriptor, with O_NOFOLLOW and O_EXCL), each entry checked before it is
written (name, type, size, link targets), and only when the whole archive
has unpacked are its top-level entries renamed into the destination. A
refused or broken archive leaves nothing behind. xz and lzma archives are
decompressed within ``XZ_MEMLIMIT`` (a block header may ask for a 4 GiB
dictionary; gzip and bzip2 need little memory by design). The tar parser is bounded
before it allocates: long-name and PAX headers over 256 KiB, chains of them,
and sparse members are refused while their headers are read, and no list
of members is kept. Modes lose setuid, setgid, sticky and world-write bits;
an archive never changes the mode of a directory that already exists
(so a member named ``.`` cannot change the destination's).

Download walks the directory by descriptor (files.walk_tree): what user code
swaps in during the walk is skipped, never followed.
"""

from __future__ import annotations

import _compression
import contextlib
import io
import lzma
import math
import os
import queue
import shutil
import stat as st
import tarfile
import threading
import time
from typing import IO, TYPE_CHECKING, Any

from . import models
from .config import Settings
from .errors import Invalid, TooLarge
from .files import _DIR, _READ, os_errors, walk_tree
from .paths import Workspace, display

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

CHUNK = 1 << 20  # read from an uploaded archive's member at once
# A download hands the response this much at a time, at most 2 ahead: what a
# client that reads nothing leaves in memory (16 of them: ~16 MiB).
OUT_CHUNK = 256 << 10
MAX_META = 256 << 10  # one long-name or PAX header
MAX_META_CHAIN = 8  # such headers in front of one member
MAX_NAME = 4096  # bytes of a member's name or link target (PATH_MAX)
MAX_KEPT_NAMES = 32 << 20  # names remembered for hard-link checks, in all
MAX_MTIME = 2**33  # year 2242; later (or NaN, or negative) is taken as "now"
# What one xz/lzma decompressor may allocate: `xz -9` archives need 65 MiB.
XZ_MEMLIMIT = 72 << 20
_STAGE_PREFIX = ".sandbox-agent-extract-"
_IMPLICIT_DIR_MODE = 0o775  # tar's 0o777 under the usual umask 0o002
_META_TYPES = (
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
)


def _refuse(name: str, why: str) -> Invalid:
    shown = display(name[:300])
    return Invalid("archive_entry_refused", f"archive entry {shown[:200]!r}: {why}", entry=shown)


class _Refused(Exception):
    """Raised from inside tarfile's header parsing: carries the agent error."""

    def __init__(self, error: Invalid | TooLarge) -> None:
        super().__init__(error.message)
        self.error = error


class _BoundedTarInfo(tarfile.TarInfo):
    """tarfile's header parser, with sizes checked before anything is read."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _META_TYPES:
            chain = getattr(tarfile_, "_sandbox_meta_chain", 0) + 1
            tarfile_._sandbox_meta_chain = chain  # type: ignore[attr-defined]
            if self.size > MAX_META or self.size < 0:
                raise _Refused(
                    TooLarge("archive_too_large", f"a tar header is larger than {MAX_META} bytes")
                )
            if chain > MAX_META_CHAIN:
                raise _Refused(Invalid("invalid_archive", "too many chained tar headers"))
        elif self.type == tarfile.GNUTYPE_SPARSE:
            raise _Refused(_refuse(self.name, "sparse files are not supported"))
        return super()._proc_member(tarfile_)  # type: ignore[misc,no-any-return]

    def _sparse_refused(self, *args: Any) -> None:
        raise _Refused(_refuse(self.name, "sparse files are not supported"))

    _proc_gnusparse_00 = _sparse_refused
    _proc_gnusparse_01 = _sparse_refused
    _proc_gnusparse_10 = _sparse_refused


class _LimitedLZMA:
    """An LZMA decompressor that allocates at most XZ_MEMLIMIT; over it, the
    archive is refused as too large rather than the agent killed for memory."""

    def __init__(self) -> None:
        self._d = lzma.LZMADecompressor(memlimit=XZ_MEMLIMIT)

    def decompress(self, data: ReadableBuffer, /, max_length: int = -1) -> bytes:
        try:
            return self._d.decompress(data, max_length)
        except lzma.LZMAError as exc:
            if "memory usage limit" not in str(exc).lower():
                raise
            raise _Refused(
                TooLarge(
                    "archive_too_large",
                    f"the archive's xz/lzma stream needs more than {XZ_MEMLIMIT >> 20} MiB"
                    " of memory to decompress (its dictionary is too large)",
                    limit=XZ_MEMLIMIT,
                )
            ) from None

    @property
    def eof(self) -> bool:
        return self._d.eof

    @property
    def unused_data(self) -> bytes:
        return self._d.unused_data

    @property
    def needs_input(self) -> bool:
        return self._d.needs_input


class _BoundedTarFile(tarfile.TarFile):
    @classmethod
    def xzopen(  # type: ignore[override]
        cls, name: str | None, mode: str = "r", fileobj: IO[bytes] | None = None, **kwargs: Any
    ) -> tarfile.TarFile:
        """tarfile's xz reader, with a memory limit (its LZMAFile takes none)."""
        if mode != "r" or fileobj is None:
            raise tarfile.CompressionError("only reading an uploaded archive")
        stream = io.BufferedReader(
            _compression.DecompressReader(fileobj, _LimitedLZMA, trailing_error=lzma.LZMAError)
        )
        try:
            tar = cls.taropen(name, "r", stream, **kwargs)
        except (lzma.LZMAError, EOFError) as exc:
            stream.close()
            raise tarfile.ReadError("not an lzma file") from exc
        except BaseException:
            stream.close()
            raise
        tar._extfileobj = False  # type: ignore[attr-defined]  # close() closes the stream
        return tar


def _group_like_owner(mode: int) -> int:
    """Give the group the owner's bits (the sandbox user shares our group, not
    our UID), and drop setuid, setgid, sticky and world-write."""
    mode &= 0o777
    return (mode | ((mode & 0o700) >> 3)) & 0o775


def _parts(name: str) -> list[str]:
    return [p for p in name.split("/") if p not in ("", ".")]


def _check_member(m: tarfile.TarInfo, files_seen: set[str]) -> list[str]:
    """The member's path components, or a refusal."""
    name = m.name
    if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME:
        raise _refuse(name, "name too long")
    if len(m.linkname.encode("utf-8", "surrogateescape")) > MAX_NAME:
        raise _refuse(name, "link target too long")
    parts = _parts(name)
    if name.startswith("/") or "\\" in name:
        raise _refuse(name, "absolute path")
    if ".." in parts:
        raise _refuse(name, "'..' component")
    if "\0" in name or "\0" in m.linkname:
        raise _refuse(name, "NUL in name")
    if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
        raise _refuse(name, "device files, FIFOs and other special files are not allowed")
    if m.size < 0:
        raise _refuse(name, "negative size")
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
        if m.linkname.startswith("/") or ".." in target.split("/") or target not in files_seen:
            raise _refuse(name, "hard link to a file outside the archive")
    if (m.isreg() or m.issym() or m.islnk()) and not parts:
        raise _refuse(name, "a file cannot replace the destination directory")
    return parts


def _mtime(m: tarfile.TarInfo) -> float:
    t = m.mtime
    try:
        t = float(t)
    except (TypeError, ValueError, OverflowError):
        return time.time()
    if not math.isfinite(t) or t < 0 or t > MAX_MTIME:
        return time.time()
    return t


class _Stage:
    """The staging directory: a private tree built by descriptor."""

    def __init__(self, dest_fd: int) -> None:
        self.dest_fd = dest_fd
        self.name = f"{_STAGE_PREFIX}{os.urandom(8).hex()}"
        os.mkdir(self.name, 0o700, dir_fd=dest_fd)
        self.fd = os.open(self.name, _DIR, dir_fd=dest_fd)
        self.dirs: list[tuple[list[str], int, float]] = []

    def parent(self, parts: list[str], entry: str) -> int:
        """Descriptor of the staged directory that holds ``parts[-1]`` (made as needed).

        Components are opened with O_NOFOLLOW: a path through a symlink the
        archive itself planted is refused, not followed."""
        fd = os.dup(self.fd)
        try:
            for i, comp in enumerate(parts[:-1]):
                try:
                    os.mkdir(comp, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
                else:
                    # A parent the archive has no entry for gets the mode tar
                    # would give it; 0o700 would shut out the runtime
                    # container, which shares only the group.
                    self.dirs.append((parts[: i + 1], _IMPLICIT_DIR_MODE, time.time()))
                try:
                    nxt = os.open(comp, _DIR, dir_fd=fd)
                except OSError:
                    raise _refuse(entry, "a parent of this entry is not a directory") from None
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd

    def clear(self, dir_fd: int, leaf: str) -> None:
        """A later member of the same name replaces an earlier one, as tar does."""
        try:
            s = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if st.S_ISDIR(s.st_mode):
            shutil.rmtree(leaf, dir_fd=dir_fd)
        else:
            os.unlink(leaf, dir_fd=dir_fd)

    def add(
        self, tar: tarfile.TarFile, m: tarfile.TarInfo, parts: list[str], budget: list[int]
    ) -> None:
        if not parts:  # the destination itself ("."): its mode is never changed
            return
        leaf = parts[-1]
        pfd = self.parent(parts, m.name)
        try:
            if m.isdir():
                try:
                    s = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
                    if not st.S_ISDIR(s.st_mode):
                        self.clear(pfd, leaf)
                        os.mkdir(leaf, 0o700, dir_fd=pfd)
                except FileNotFoundError:
                    os.mkdir(leaf, 0o700, dir_fd=pfd)
                # Modes last: a directory without write permission would
                # refuse the entries still to come.
                self.dirs.append((parts, _group_like_owner(m.mode | 0o700), _mtime(m)))
                return
            self.clear(pfd, leaf)
            if m.issym():
                os.symlink(m.linkname, leaf, dir_fd=pfd)
                return
            if m.islnk():
                tparts = _parts(m.linkname)
                tfd = self.parent(tparts, m.name)
                try:
                    os.link(tparts[-1], leaf, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
                finally:
                    os.close(tfd)
                return
            fd = os.open(
                leaf,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=pfd,
            )
            try:
                src = tar.extractfile(m)
                if src is None:
                    raise _refuse(m.name, "no data")
                while True:
                    block = src.read(CHUNK)
                    if not block:
                        break
                    budget[0] -= len(block)
                    if budget[0] < 0:
                        raise TooLarge("archive_too_large", "archive unpacks to more than allowed")
                    view = memoryview(block)
                    while view:
                        view = view[os.write(fd, view) :]
                os.fchmod(fd, _group_like_owner(m.mode | 0o600))
                t = _mtime(m)
                os.utime(fd, (t, t))
            finally:
                os.close(fd)
        finally:
            os.close(pfd)

    def finish_dirs(self) -> None:
        done: set[tuple[str, ...]] = set()
        for parts, mode, t in reversed(self.dirs):  # the last entry for a directory wins
            if tuple(parts) in done:
                continue
            done.add(tuple(parts))
            pfd = self.parent(parts, "/".join(parts))
            try:
                fd = os.open(parts[-1], _DIR, dir_fd=pfd)
            except OSError:
                continue  # replaced by a later member
            finally:
                os.close(pfd)
            try:
                os.fchmod(fd, mode)
                os.utime(fd, (t, t))
            finally:
                os.close(fd)

    def remove(self) -> None:
        os.close(self.fd)
        with contextlib.suppress(OSError):
            shutil.rmtree(self.name, dir_fd=self.dest_fd)


def _conflicts(src_fd: int, dst_fd: int, rel: str) -> None:
    """Refuse, before anything moves, what a merge could not do atomically."""
    with os.scandir(src_fd) as it:
        names = [e.name for e in it]
    for name in names:
        s = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
        try:
            d = os.stat(name, dir_fd=dst_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        path = name if rel == "." else f"{rel}/{name}"
        if st.S_ISDIR(s.st_mode) != st.S_ISDIR(d.st_mode):
            if st.S_ISLNK(d.st_mode):
                why = "a symlink in the workspace stands where the archive has a directory"
            elif st.S_ISDIR(d.st_mode):
                why = "a directory in the workspace cannot be replaced by a file"
            else:
                why = "a file in the workspace stands where the archive has a directory"
            raise _refuse(path, why)
        if st.S_ISDIR(s.st_mode):
            sub_s = os.open(name, _DIR, dir_fd=src_fd)
            try:
                sub_d = os.open(name, _DIR, dir_fd=dst_fd)
            except OSError:
                os.close(sub_s)
                raise
            try:
                _conflicts(sub_s, sub_d, path)
            finally:
                os.close(sub_s)
                os.close(sub_d)


def _merge(src_fd: int, dst_fd: int) -> None:
    """Rename the staged entries into place; existing directories are merged into."""
    with os.scandir(src_fd) as it:
        names = [e.name for e in it]
    for name in names:
        s = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
        if st.S_ISDIR(s.st_mode):
            try:
                d = os.stat(name, dir_fd=dst_fd, follow_symlinks=False)
            except FileNotFoundError:
                d = None
            if d is not None and st.S_ISDIR(d.st_mode):
                sub_s = os.open(name, _DIR, dir_fd=src_fd)
                try:
                    sub_d = os.open(name, _DIR, dir_fd=dst_fd)
                    try:
                        _merge(sub_s, sub_d)
                    finally:
                        os.close(sub_d)
                finally:
                    os.close(sub_s)
                continue
        # Files and symlinks replace what is there atomically (rename over it).
        os.rename(name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)


def _open_tar(spool: IO[bytes]) -> tarfile.TarFile:
    try:
        return _BoundedTarFile.open(fileobj=spool, mode="r:*", tarinfo=_BoundedTarInfo)
    except _Refused as exc:
        raise exc.error from None
    except (tarfile.TarError, EOFError, OSError, ValueError, RecursionError, lzma.LZMAError) as exc:
        raise Invalid("invalid_archive", f"not a valid tar archive: {exc}") from None


def extract(ws: Workspace, rel: str, spool: IO[bytes], s: Settings) -> models.ArchiveResult:
    with os_errors(rel), ws.locate(rel, make_parents=True) as loc:
        with contextlib.suppress(FileExistsError):
            if loc.name != ".":
                os.mkdir(loc.name, 0o777, dir_fd=loc.dir_fd)
        dest_fd = os.open(loc.name, _DIR, dir_fd=loc.dir_fd)
        dest_rel = loc.rel
    try:
        tar = _open_tar(spool)
        with os_errors(rel):
            stage = _Stage(dest_fd)
        try:
            entries, total = _unpack(tar, stage, s)
            with os_errors(rel):
                stage.finish_dirs()
                _conflicts(stage.fd, dest_fd, dest_rel)
                _merge(stage.fd, dest_fd)
        finally:
            stage.remove()
            tar.close()
    finally:
        os.close(dest_fd)
    return models.ArchiveResult(path=display(dest_rel), entries=entries, bytes=total)


def _unpack(tar: tarfile.TarFile, stage: _Stage, s: Settings) -> tuple[int, int]:
    files_seen: set[str] = set()
    kept = 0
    entries = 0
    total = 0
    budget = [s.max_extract_bytes]
    while True:
        tar._sandbox_meta_chain = 0  # type: ignore[attr-defined]
        try:
            m = tar.next()
        except _Refused as exc:
            raise exc.error from None
        except tarfile.TarError as exc:
            raise Invalid("invalid_archive", f"not a valid tar archive: {exc}") from None
        except (EOFError, OSError, ValueError, RecursionError, lzma.LZMAError) as exc:
            raise Invalid("invalid_archive", f"archive is truncated or corrupt: {exc}") from None
        if m is None:
            break
        tar.members.clear()  # type: ignore[attr-defined]  # tarfile keeps them all otherwise
        entries += 1
        if entries > s.max_archive_entries:
            raise TooLarge(
                "archive_too_large", f"archive has more than {s.max_archive_entries} entries"
            )
        parts = _check_member(m, files_seen)
        total += m.size if m.isreg() else 0
        if total > s.max_extract_bytes:
            raise TooLarge(
                "archive_too_large", f"archive unpacks to more than {s.max_extract_bytes} bytes"
            )
        if m.isreg():
            key = "/".join(parts)
            if key not in files_seen:
                kept += len(key)
                if kept > MAX_KEPT_NAMES:
                    raise TooLarge("archive_too_large", "archive names take too much memory")
                files_seen.add(key)
        try:
            stage.add(tar, m, parts, budget)
        except _Refused as exc:
            raise exc.error from None
        except (tarfile.TarError, EOFError, lzma.LZMAError) as exc:
            raise Invalid("invalid_archive", f"cannot extract {m.name!r}: {exc}") from None
        except OSError as exc:
            with os_errors(m.name):
                raise exc from None
    return entries, total


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
        if len(self.buf) >= OUT_CHUNK:
            self.put(bytes(self.buf))
            self.buf.clear()
        return len(data)

    def flush(self) -> None:
        if self.buf:
            self.put(bytes(self.buf))
            self.buf.clear()


def _tarinfo(name: str, s: os.stat_result, kind: bytes, link: str = "") -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = st.S_IMODE(s.st_mode)
    ti.uid, ti.gid = s.st_uid, s.st_gid
    t = s.st_mtime
    ti.mtime = int(t) if math.isfinite(t) and 0 <= t <= MAX_MTIME else 0
    ti.size = s.st_size if kind == tarfile.REGTYPE else 0
    ti.linkname = link
    return ti


def _add_tree(ws: Workspace, tar: tarfile.TarFile, top_fd: int, hidden_cap: int) -> None:
    for rel, name, dfd, s, _ in walk_tree(top_fd, ".", True, None, hidden_cap):
        if st.S_ISDIR(s.st_mode):
            tar.addfile(_tarinfo(rel, s, tarfile.DIRTYPE))
        elif st.S_ISLNK(s.st_mode):
            try:
                target = os.readlink(name, dir_fd=dfd)
            except OSError:
                continue
            tar.addfile(_tarinfo(rel, s, tarfile.SYMTYPE, target))
        elif st.S_ISREG(s.st_mode):
            try:
                fd = os.open(name, _READ, dir_fd=dfd)
            except OSError:
                continue
            with os.fdopen(fd, "rb") as f:
                fs = os.fstat(fd)
                # Swapped for something else since it was listed, or an inode
                # that may live outside: left out.
                if not st.S_ISREG(fs.st_mode) or (fs.st_nlink > 1 and not ws.own_filesystem):
                    continue
                tar.addfile(_tarinfo(rel, fs, tarfile.REGTYPE), f)
        # sockets, FIFOs and devices are left out


class TarStream:
    """A directory as tar bytes, produced by a thread; ``close()`` stops it early."""

    def __init__(self, ws: Workspace, rel: str, gzip: bool, max_entries: int = 1 << 30) -> None:
        with os_errors(rel):
            top_fd, self.top = ws.open_dir(rel)
        self.q: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=2)
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
                    _add_tree(ws, tar, top_fd, max_entries)
                writer.flush()
                writer.put(None)
            except _Stopped:
                pass
            except BaseException as exc:
                with contextlib.suppress(_Stopped):
                    writer.put(exc)
            finally:
                os.close(top_fd)

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
