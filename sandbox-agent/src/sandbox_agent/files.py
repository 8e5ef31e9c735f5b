"""File operations on the workspace (blocking; the app runs them in threads).

Every path is walked by descriptor (paths.Workspace.locate) and every
operation is relative to the descriptor of its parent directory, with
O_NOFOLLOW and, for opens, O_NONBLOCK and an fstat type check: a path that
user code swaps for a symlink, a FIFO or a socket mid-call is refused or
skipped, never followed or waited on. Tree walks (list, find, search) hold a
descriptor per level and open each subdirectory relative to its parent.

Writes are atomic (temporary file in the target directory, then rename) and
leave group-writable files behind (the agent's umask), because the sandbox
user is another UID in the same group.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import fnmatch
import os
import shutil
import stat as st
import time
from collections.abc import Iterator

import re2

from . import models, tempfiles
from .config import Settings
from .errors import (
    AgentError,
    Code,
    Conflict,
    Forbidden,
    Invalid,
    IOFailure,
    NoSpace,
    NotFound,
    TooLarge,
)
from .paths import Located, Workspace, display

_ERRNO: dict[int, tuple[type[AgentError], Code]] = {
    errno.ENOENT: (NotFound, "not_found"),
    errno.EEXIST: (Conflict, "already_exists"),
    errno.ENOTEMPTY: (Conflict, "directory_not_empty"),
    errno.ENOTDIR: (Invalid, "not_a_directory"),
    errno.EISDIR: (Invalid, "is_a_directory"),
    errno.EACCES: (Forbidden, "permission_denied"),
    errno.EPERM: (Forbidden, "permission_denied"),
    errno.EROFS: (Forbidden, "read_only"),
    errno.ELOOP: (Forbidden, "path_escape"),
    errno.EINVAL: (Invalid, "invalid_operation"),
    errno.EBUSY: (Conflict, "busy"),
    errno.EXDEV: (Invalid, "cross_device"),
    errno.ENAMETOOLONG: (Invalid, "invalid_path"),
    errno.ENOSPC: (NoSpace, "no_space"),
    errno.EDQUOT: (NoSpace, "quota_exceeded"),
    errno.EFBIG: (TooLarge, "file_too_large"),
    errno.ETXTBSY: (Conflict, "busy"),
    errno.ENXIO: (Invalid, "not_a_file"),  # opening a socket
    errno.ENODEV: (Invalid, "not_a_file"),
    errno.EOVERFLOW: (TooLarge, "file_too_large"),
}


@contextlib.contextmanager
def os_errors(rel: str) -> Iterator[None]:
    """Turn OSError into the API's error vocabulary."""
    try:
        yield
    except OSError as exc:
        kind, code = _ERRNO.get(exc.errno or 0, (IOFailure, "io_error"))
        shown = display(rel)
        raise kind(code, f"{exc.strerror or exc}: {shown}", path=shown) from None


MAX_WALK_DEPTH = 128  # tree walks go no deeper (one descriptor is held per level)
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


# Set-user-ID and set-group-ID: files the agent writes are owned by the agent's
# UID, so a set-id executable would let code in the sandbox run as the agent.
SET_ID = st.S_ISUID | st.S_ISGID


def parse_mode(mode: str | None) -> int | None:
    """A caller's octal mode (the route checked its syntax); set-id bits refused."""
    if mode is None:
        return None
    bits = int(mode, 8)
    if bits & SET_ID:
        raise Invalid(
            "invalid_mode",
            f"mode {mode}: set-user-ID and set-group-ID bits are not allowed (mask 6000)",
        )
    return bits


def _kind(mode: int) -> str:
    if st.S_ISREG(mode):
        return "file"
    if st.S_ISDIR(mode):
        return "directory"
    if st.S_ISLNK(mode):
        return "symlink"
    return "other"


def _rfc3339(t: float) -> str:
    # A timestamp user code set to something absurd must not fail the call.
    try:
        return models.rfc3339(t)
    except (OverflowError, ValueError, OSError):
        return models.rfc3339(0)


def info(rel: str, s: os.stat_result, target: str | None = None) -> models.FileInfo:
    """FileInfo of what ``s`` describes, named by its workspace path ``rel``."""
    return models.FileInfo(
        path=display(rel),
        name=display(rel.rsplit("/", 1)[-1]) if rel != "." else ".",
        type=_kind(s.st_mode),  # type: ignore[arg-type]
        size=s.st_size,
        mode=f"{st.S_IMODE(s.st_mode):04o}",
        modified_at=_rfc3339(s.st_mtime),
        uid=s.st_uid,
        gid=s.st_gid,
        symlink_target=None if target is None else display(target),
    )


def _info_at(dir_fd: int, name: str, rel: str) -> models.FileInfo:
    s = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    target = None
    if st.S_ISLNK(s.st_mode):
        with contextlib.suppress(OSError):
            target = os.readlink(name, dir_fd=dir_fd)
    return info(rel, s, target)


def stat(ws: Workspace, rel: str, follow: bool = False) -> models.FileInfo:
    with os_errors(rel), ws.locate(rel, follow=follow) as loc:
        return _info_at(loc.dir_fd, loc.name, loc.rel)


def _names(dir_fd: int, hidden: bool, cap: int) -> tuple[list[str], bool]:
    """Up to ``cap`` names of a directory, sorted; True when more were left unread.

    Reading stops at the cap, so a directory of millions of entries costs no
    more than the cap (which entries a truncated answer holds is then the
    directory's order, not the alphabet's)."""
    out: list[str] = []
    more = False
    with os.scandir(dir_fd) as it:
        for e in it:
            if not hidden and e.name.startswith("."):
                continue
            if len(out) >= cap:
                more = True
                break
            out.append(e.name)
    out.sort()
    return out, more


def walk_tree(
    top_fd: int, top_rel: str, hidden: bool, max_depth: int | None, cap: int
) -> Iterator[tuple[str, str, int, os.stat_result, int]]:
    """(path, name, parent descriptor, lstat, depth) for everything under an
    open directory, pre-order, names sorted, symlinks not followed.

    Each subdirectory is opened relative to its parent with O_NOFOLLOW: one
    swapped for a symlink (or anything else) after it was listed is skipped.
    The parent descriptor is valid only until the next item. ``cap`` bounds
    the names read from any one directory.
    """
    first, _ = _names(top_fd, hidden, cap)
    stack: list[tuple[int, str, Iterator[str], int]] = [(top_fd, top_rel, iter(first), 1)]
    try:
        while stack:
            dfd, drel, names, depth = stack[-1]
            name = next(names, None)
            if name is None:
                stack.pop()
                if dfd != top_fd:
                    os.close(dfd)
                continue
            try:
                s = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue  # vanished meanwhile
            rel = name if drel == "." else f"{drel}/{name}"
            yield rel, name, dfd, s, depth
            if not st.S_ISDIR(s.st_mode) or (max_depth is not None and depth >= max_depth):
                continue
            if len(stack) >= MAX_WALK_DEPTH:
                continue
            try:
                sub = os.open(name, _DIR, dir_fd=dfd)
            except OSError:
                continue  # swapped for a symlink or a file: not followed
            try:
                children, _ = _names(sub, hidden, cap)
            except OSError:
                os.close(sub)
                continue
            stack.append((sub, rel, iter(children), depth + 1))
    finally:
        for dfd, *_ in stack:
            if dfd != top_fd:
                os.close(dfd)


def list_dir(ws: Workspace, rel: str, depth: int, hidden: bool, limit: int) -> models.FileList:
    with os_errors(rel):
        fd, top = ws.open_dir(rel)
    entries: list[models.FileInfo] = []
    truncated = False
    try:
        with os_errors(rel):
            if depth <= 1:
                names, truncated = _names(fd, hidden, limit)
                for name in names:
                    with contextlib.suppress(OSError):  # vanished while listing
                        entries.append(_info_at(fd, name, name if top == "." else f"{top}/{name}"))
            else:
                for path, name, dfd, s, _ in walk_tree(fd, top, hidden, depth, limit + 1):
                    if len(entries) >= limit:
                        truncated = True
                        break
                    target = None
                    if st.S_ISLNK(s.st_mode):
                        with contextlib.suppress(OSError):
                            target = os.readlink(name, dir_fd=dfd)
                    entries.append(info(path, s, target))
    finally:
        os.close(fd)
    entries.sort(key=lambda i: i.path)
    return models.FileList(path=display(top), entries=entries, truncated=truncated)


def _open_regular(ws: Workspace, dir_fd: int, name: str, rel: str) -> tuple[int, os.stat_result]:
    """Open ``name`` in ``dir_fd`` for reading: a regular file or a refusal.

    O_NONBLOCK so that a FIFO swapped in cannot block the open, O_NOFOLLOW so
    that a symlink swapped in is not followed, then fstat decides."""
    with os_errors(rel):
        fd = os.open(name, _READ, dir_fd=dir_fd)
    try:
        s = os.fstat(fd)
        if st.S_ISDIR(s.st_mode):
            raise Invalid("is_a_directory", f"is a directory: {display(rel)}")
        if not st.S_ISREG(s.st_mode):
            raise Invalid("not_a_file", f"not a regular file: {display(rel)}")
        ws.check_links(s, rel)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, s


def open_for_read(ws: Workspace, rel: str) -> tuple[int, int]:
    """Open a regular file confined to the workspace; returns (fd, size)."""
    with os_errors(rel), ws.locate(rel) as loc:
        if loc.name == ".":
            raise Invalid("is_a_directory", f"is a directory: {display(rel)}")
        fd, s = _open_regular(ws, loc.dir_fd, loc.name, rel)
    return fd, s.st_size


def read_lines(fd: int, start: int, count: int | None, max_bytes: int, max_scan: int) -> bytes:
    """Lines start..start+count-1 (1-based) of an open file.

    Read in blocks: lines before the range are skipped without being kept
    (a file of one endless line costs a block of memory, not its size), the
    selected bytes are refused as soon as they pass ``max_bytes``, and no more
    than ``max_scan`` bytes are read in all."""
    out = bytearray()
    line = 1
    end_line = None if count is None else start + count
    scanned = 0
    while end_line is None or line < end_line:
        block = os.read(fd, 1 << 20)
        if not block:
            break
        scanned += len(block)
        pos = 0
        if line < start:
            # Lines before the range are counted, not walked one by one (a
            # block of newlines is a million lines).
            ahead = block.count(b"\n")
            if line + ahead < start:
                line += ahead
                if scanned > max_scan:
                    raise TooLarge("read_too_large", f"line ranges scan at most {max_scan} bytes")
                continue
            for _ in range(start - line):
                pos = block.index(b"\n", pos) + 1
            line = start
        while pos < len(block) and (end_line is None or line < end_line):
            nl = block.find(b"\n", pos)
            stop = len(block) if nl < 0 else nl + 1
            if line >= start:
                out += block[pos:stop]
                if len(out) > max_bytes:
                    raise TooLarge("read_too_large", "selected lines exceed the read limit")
            if nl < 0:
                break
            line += 1
            pos = stop
        if scanned > max_scan and (end_line is None or line < end_line):
            raise TooLarge("read_too_large", f"line ranges scan at most {max_scan} bytes")
    return bytes(out)


class AtomicWriter:
    """A temp file next to the target; commit() renames it into place."""

    def __init__(self, ws: Workspace, rel: str, mode: int | None, parents: bool) -> None:
        self.ws = ws
        self.rel = rel
        self.fd = -1
        norm = ws.clean(rel)
        if norm == ".":
            raise Invalid("invalid_path", "cannot write to the workspace root")
        with os_errors(rel):
            self.loc: Located = ws.locate(rel, follow=False, make_parents=parents)
        self.dir_fd = self.loc.dir_fd
        self.name = self.loc.name
        try:
            with os_errors(rel):
                try:
                    existing: os.stat_result | None = os.stat(
                        self.name, dir_fd=self.dir_fd, follow_symlinks=False
                    )
                except FileNotFoundError:
                    existing = None
            if existing is not None and st.S_ISDIR(existing.st_mode):
                raise Invalid("is_a_directory", f"is a directory: {display(rel)}")
            self.mode = mode
            self.gid = -1
            if mode is None and existing is not None and st.S_ISREG(existing.st_mode):
                # Keep the mode of a file we replace. The new file is ours (the
                # agent's UID): a file the sandbox user owned must stay writable
                # for them, through the group we share, as it was for its owner.
                kept = st.S_IMODE(existing.st_mode) & ~SET_ID
                if existing.st_uid != os.geteuid():
                    kept |= (kept & 0o700) >> 3
                    self.gid = existing.st_gid
                self.mode = kept
            self.tmp = f".{self.name[:200]}.{os.urandom(6).hex()}.tmp"
            tempfiles.register(self.tmp, existing is not None)  # for watches: see tempfiles.py
            with os_errors(rel):
                self.fd = os.open(
                    self.tmp,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                    0o666,
                    dir_fd=self.dir_fd,
                )
                if self.mode is None:  # new: set its mode too (the umask's), the same steps
                    self.mode = st.S_IMODE(os.fstat(self.fd).st_mode)
        except BaseException:
            self.loc.close()
            self.dir_fd = -1
            raise
        self.size = 0

    def write(self, data: bytes | memoryview) -> None:
        with os_errors(self.rel):
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]
                self.size += n

    def write_chunks(self, chunks: list[bytes]) -> None:
        """writev in batches (no joined copy of the data)."""
        with os_errors(self.rel):
            for i in range(0, len(chunks), 512):  # well under IOV_MAX
                batch = chunks[i : i + 512]
                want = sum(len(c) for c in batch)
                done = os.writev(self.fd, batch)
                self.size += done
                if done < want:  # short write (rare on files): finish the rest plainly
                    self.write(b"".join(batch)[done:])

    def commit(self) -> models.FileInfo:
        try:
            with os_errors(self.rel):
                if self.gid >= 0:
                    with contextlib.suppress(OSError):  # not a member of that group
                        os.fchown(self.fd, -1, self.gid)
                if self.mode is not None:
                    os.fchmod(self.fd, self.mode)
                s = os.fstat(self.fd)
                os.close(self.fd)
                self.fd = -1
                os.rename(self.tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
                return info(self.loc.rel, s)
        finally:
            self.abort()

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            with contextlib.suppress(OSError):
                os.unlink(self.tmp, dir_fd=self.dir_fd)
        if self.dir_fd >= 0:
            self.loc.close()
            self.dir_fd = -1


def write_bytes(
    ws: Workspace, rel: str, data: bytes, mode: int | None = None, parents: bool = True
) -> models.FileInfo:
    w = AtomicWriter(ws, rel, mode, parents)
    try:
        w.write(data)
    except BaseException:
        w.abort()
        raise
    return w.commit()


def read_all(ws: Workspace, rel: str, limit: int) -> bytes:
    fd, size = open_for_read(ws, rel)
    try:
        if size > limit:
            raise TooLarge("file_too_large", f"{display(rel)} is larger than {limit} bytes")
        return _read_fd(fd, limit + 1)[:limit]
    finally:
        os.close(fd)


def _read_fd(fd: int, limit: int) -> bytes:
    parts: list[bytes] = []
    got = 0
    while got < limit:
        block = os.read(fd, min(limit - got, 4 << 20))
        if not block:
            break
        parts.append(block)
        got += len(block)
    return b"".join(parts)


def mkdir(ws: Workspace, req: models.MkdirRequest) -> models.FileInfo:
    mode = parse_mode(req.mode)
    with os_errors(req.path), ws.locate(req.path, make_parents=req.parents) as loc:
        if loc.name == ".":
            if not req.exist_ok:
                raise Conflict("already_exists", f"already exists: {display(req.path)}")
            return _info_at(loc.dir_fd, ".", ".")
        try:
            os.mkdir(loc.name, 0o777, dir_fd=loc.dir_fd)
        except FileExistsError:
            s = os.stat(loc.name, dir_fd=loc.dir_fd, follow_symlinks=False)
            if not req.exist_ok or not st.S_ISDIR(s.st_mode):
                raise Conflict("already_exists", f"already exists: {display(req.path)}") from None
            # Never chmod an existing directory (e.g. the root) through mkdir.
            return info(loc.rel, s)
        if mode is not None:
            # Only a directory we just made gets the mode, through a
            # descriptor of it (the name may be swapped by now).
            fd = os.open(loc.name, _DIR, dir_fd=loc.dir_fd)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
        return _info_at(loc.dir_fd, loc.name, loc.rel)


def remove(ws: Workspace, req: models.RemoveRequest) -> models.Removed:
    if ws.clean(req.path) == ".":
        raise Invalid("invalid_path", "refusing to remove the workspace root")
    with os_errors(req.path), ws.locate(req.path, follow=False) as loc:
        try:
            s = os.stat(loc.name, dir_fd=loc.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            if req.missing_ok:
                return models.Removed(path=display(loc.rel), removed=False)
            raise
        if st.S_ISDIR(s.st_mode):
            if req.recursive:
                # descriptor-based (openat/unlinkat): never follows a symlink
                shutil.rmtree(loc.name, dir_fd=loc.dir_fd)
            else:
                os.rmdir(loc.name, dir_fd=loc.dir_fd)
        else:
            os.unlink(loc.name, dir_fd=loc.dir_fd)
        return models.Removed(path=display(loc.rel), removed=True)


def move(ws: Workspace, req: models.MoveRequest) -> models.FileInfo:
    if ws.clean(req.source) == "." or ws.clean(req.destination) == ".":
        raise Invalid("invalid_path", "cannot move the workspace root")
    with os_errors(req.source), ws.locate(req.source, follow=False) as src:
        src_stat = os.stat(src.name, dir_fd=src.dir_fd, follow_symlinks=False)
        with (
            os_errors(req.destination),
            ws.locate(req.destination, follow=False, make_parents=req.parents) as dst,
        ):
            try:
                existing: os.stat_result | None = os.stat(
                    dst.name, dir_fd=dst.dir_fd, follow_symlinks=False
                )
            except FileNotFoundError:
                existing = None
            if existing is not None and not req.overwrite:
                raise Conflict("already_exists", f"destination exists: {display(req.destination)}")
            if dst.rel == src.rel or dst.rel.startswith(src.rel + "/"):
                raise Invalid("invalid_operation", "cannot move a path into itself")
            if existing is not None and st.S_ISDIR(existing.st_mode):
                if not st.S_ISDIR(src_stat.st_mode):
                    raise Invalid("is_a_directory", "cannot replace a directory with a file")
                shutil.rmtree(dst.name, dir_fd=dst.dir_fd)
            os.rename(src.name, dst.name, src_dir_fd=src.dir_fd, dst_dir_fd=dst.dir_fd)
            return _info_at(dst.dir_fd, dst.name, dst.rel)


def compile_regex(
    pattern: str, ignore_case: bool = False, literal: bool = False, one_line: bool = False
) -> re2._Regexp:
    """A linear-time (RE2) regular expression: no pattern can backtrack for
    ever, and matching releases the GIL, so a search cannot stall the agent.
    RE2 has no backreferences or lookaround; such patterns are a 400.
    `one_line`: no match spans a newline (search runs it over a whole file)."""
    opts = re2.Options()
    opts.log_errors = False
    opts.case_sensitive = not ignore_case
    opts.literal = literal
    opts.never_nl = one_line
    try:
        return re2.compile(pattern, opts)
    except (re2.error, TypeError, ValueError) as exc:
        why = exc.args[0] if exc.args else exc
        if isinstance(why, bytes):
            why = why.decode("utf-8", "replace")
        raise Invalid(
            "invalid_regex",
            f"invalid regular expression (RE2 syntax: no backreferences or lookaround): {why}",
        ) from None


def _read_for_search(ws: Workspace, dir_fd: int, name: str, limit: int) -> bytes | None:
    """A regular file's bytes, or None to skip it (special, too large, linked from outside)."""
    try:
        fd = os.open(name, _READ, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        s = os.fstat(fd)
        if not st.S_ISREG(s.st_mode) or s.st_size > limit:
            return None
        if s.st_nlink > 1 and not ws.own_filesystem:
            return None
        return _read_fd(fd, limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)


def _line_matches(rx: re2._Regexp, data: bytes) -> Iterator[tuple[int, int, int, int]]:
    """(line number, line start, line end, match start) of each line's first
    match (`rx` never matches across a newline). Nothing is made per line, so
    a file of millions of short lines costs what its matches do: without CRs
    the whole buffer is searched at once. A CR before the LF is not part of
    the line (`x$` matches "x\\r\\n"): such files are searched line by line, one
    line's copy at a time."""
    size = len(data)
    if b"\r" in data:
        pos, lineno = 0, 1
        while pos < size:
            nl = data.find(b"\n", pos)
            end = size if nl < 0 else nl
            stop = end - 1 if end > pos and data[end - 1] == 0x0D else end
            # A slice, not endpos: RE2 sees the CR after endpos, and `$` fails.
            m = rx.search(data[pos:stop])
            if m is not None:
                yield lineno, pos, stop, pos + m.start()
            pos, lineno = end + 1, lineno + 1
        return
    pos, lineno, counted = 0, 1, 0
    while pos < size:
        m = rx.search(data, pos)
        if m is None or m.start() >= size:
            return  # (an empty match after the last newline is no line)
        nl = data.rfind(b"\n", pos, m.start())
        start = pos if nl < 0 else nl + 1
        lineno += data.count(b"\n", counted, start)
        counted = start
        end = data.find(b"\n", start)
        end = size if end < 0 else end
        yield lineno, start, end, m.start()
        pos = end + 1


def search(ws: Workspace, req: models.SearchRequest, s: Settings) -> models.SearchResult:
    pattern = req.pattern.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    # Per line: `^` and `$` at each line's ends, no match across a newline.
    rx = compile_regex(
        pattern if req.fixed_string else "(?m)" + pattern,
        req.ignore_case,
        req.fixed_string,
        one_line=True,
    )
    limit = min(req.max_results or s.search_max_results, s.search_max_results)
    matches: list[models.SearchMatch] = []
    scanned = skipped = 0
    truncated = False
    with os_errors(req.path), ws.locate(req.path) as loc:
        kind = os.stat(loc.name, dir_fd=loc.dir_fd, follow_symlinks=False).st_mode
        top_fd = -1
        if st.S_ISDIR(kind):
            top_fd = os.open(loc.name, _DIR, dir_fd=loc.dir_fd)
        elif not st.S_ISREG(kind):
            raise Invalid("not_a_file", f"not a regular file: {display(req.path)}")
        try:
            if top_fd < 0:
                targets: Iterator[tuple[str, str, int]] = iter([(loc.rel, loc.name, loc.dir_fd)])
            else:
                targets = (
                    (rel, name, dfd)
                    for rel, name, dfd, fs, _ in walk_tree(
                        top_fd, loc.rel, req.include_hidden, None, s.search_max_files + 1
                    )
                    if st.S_ISREG(fs.st_mode)
                    and (
                        req.glob is None
                        or fnmatch.fnmatch(name, req.glob)
                        or fnmatch.fnmatch(rel, req.glob)
                    )
                )
            for rel, name, dfd in targets:
                if scanned + skipped >= s.search_max_files:
                    truncated = True
                    break
                data = _read_for_search(ws, dfd, name, s.search_max_file_bytes)
                if data is None or b"\0" in data[:8192]:
                    skipped += 1  # special, oversized or binary
                    continue
                scanned += 1
                for lineno, start, end, at in _line_matches(rx, data):
                    if len(matches) >= limit:
                        truncated = True
                        break
                    matches.append(
                        models.SearchMatch(
                            path=display(rel),
                            line=lineno,
                            column=len(data[start:at].decode("utf-8", "replace")) + 1,
                            text=data[start : min(end, start + 1000)].decode("utf-8", "replace"),
                        )
                    )
                if truncated:
                    break
        finally:
            if top_fd >= 0:
                os.close(top_fd)
    return models.SearchResult(
        matches=matches, truncated=truncated, files_scanned=scanned, files_skipped=skipped
    )


def find(ws: Workspace, req: models.FindRequest, s: Settings) -> models.FindResult:
    with os_errors(req.path):
        fd, top = ws.open_dir(req.path)
    limit = min(req.max_results or s.search_max_results, s.search_max_results)
    by_path = "/" in req.pattern
    out: list[str] = []
    truncated = False
    seen = 0
    try:
        for rel, name, _, fs, _ in walk_tree(
            fd, top, req.include_hidden, req.max_depth, s.search_max_files + 1
        ):
            seen += 1
            if seen > s.search_max_files:
                truncated = True
                break
            is_dir = st.S_ISDIR(fs.st_mode)
            if (req.type == "file" and is_dir) or (req.type == "directory" and not is_dir):
                continue
            subject = (rel if top == "." else rel[len(top) + 1 :]) if by_path else name
            if fnmatch.fnmatchcase(subject, req.pattern):
                if len(out) >= limit:
                    truncated = True
                    break
                out.append(display(rel))
    finally:
        os.close(fd)
    return models.FindResult(paths=out, truncated=truncated)


def edit_limit(s: Settings) -> int:
    """The largest file replace and patch work on (and produce): held twice in
    memory while edited, beside a search and another edit, so a sixteenth of
    the agent's memory limit at most (16 MiB for 256 MiB)."""
    limit = s.search_max_file_bytes * 8
    if s.memory_limit_bytes:
        limit = min(limit, max(s.memory_limit_bytes // 16, 1 << 20))
    return limit


def require_utf8(data: bytes, rel: str) -> None:
    """UTF-8 checked a block at a time: no decoded copy (a str of one astral
    character and 60 MiB of ASCII takes 240 MiB)."""
    check = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(data)
    try:
        for pos in range(0, len(view), 1 << 20):
            check.decode(view[pos : pos + (1 << 20)])
        check.decode(b"", final=True)
    except UnicodeDecodeError:
        raise Invalid("not_text", f"{display(rel)} is not UTF-8 text") from None


def _utf8(value: str, field: str) -> bytes:
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        raise Invalid("invalid_request", f"{field} is not valid Unicode") from None


def replace(ws: Workspace, req: models.ReplaceRequest, s: Settings) -> models.ReplaceResult:
    """Find and replace on the file's bytes (UTF-8 is self-synchronising: a
    match of UTF-8 bytes is a match of characters)."""
    limit = edit_limit(s)
    raw = read_all(ws, req.path, limit)
    require_utf8(raw, req.path)
    find, replacement = _utf8(req.find, "find"), _utf8(req.replace, "replace")
    if req.regex:
        rx = compile_regex("(?m)" + req.find)
        count = sum(1 for _ in rx.finditer(raw))
    else:
        count = raw.count(find)
    if req.expected_count is not None and count != req.expected_count:
        raise Conflict(
            "match_count_mismatch",
            f"expected {req.expected_count} matches, found {count}",
            found=count,
        )
    if count == 0:
        raise Conflict("no_match", "the search text was not found", found=0)
    if count > 1 and not req.all and req.expected_count is None:
        raise Conflict(
            "ambiguous_match",
            f"the search text occurs {count} times; pass all=true or expectedCount",
            found=count,
        )
    too_large = TooLarge(
        "replace_too_large", f"the file would grow past {limit} bytes", limit=limit
    )
    if req.regex and b"\\" not in replacement:
        # No group references: each match becomes exactly the replacement.
        if len(raw) + count * len(replacement) > limit:
            raise too_large
        new = rx.sub(replacement, raw)
    elif req.regex:
        # Built piece by piece so that the size is checked as it grows: a
        # short pattern with a long replacement can multiply a file.
        pieces: list[bytes] = []
        size = pos = 0
        try:
            for m in rx.finditer(raw):
                rep = m.expand(replacement)
                size += m.start() - pos + len(rep)
                if size > limit:
                    raise too_large
                pieces += (raw[pos : m.start()], rep)
                pos = m.end()
        except (re2.error, IndexError, ValueError, KeyError) as exc:
            raise Invalid("invalid_replacement", f"invalid replacement: {exc}") from None
        pieces.append(raw[pos:])
        del raw  # the pieces are copies: the join then peaks at two, not three
        new = b"".join(pieces)
    else:
        if len(raw) + count * (len(replacement) - len(find)) > limit:
            raise too_large
        new = raw.replace(find, replacement)
    if len(new) > limit:
        raise too_large
    result = write_bytes(ws, req.path, new, parents=False)
    return models.ReplaceResult(path=result.path, replacements=count)


def sync(ws: Workspace) -> models.SyncResult:
    t = time.monotonic()
    # syncfs(2) on the workspace would be narrower, but os has no binding for
    # it; sync(2) flushes everything including the workspace volume.
    os.sync()
    return models.SyncResult(synced=True, duration_seconds=round(time.monotonic() - t, 6))
