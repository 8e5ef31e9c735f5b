"""File operations on the workspace (blocking; the app runs them in threads).

Every path goes through paths.Workspace. Writes are atomic (temporary file in
the target directory, then rename) and leave group-writable files behind (the
agent's umask), because the sandbox user is another UID in the same group.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import re
import shutil
import stat as st
import time
from collections.abc import Iterator

from . import models
from .config import Settings
from .errors import (
    AgentError,
    Conflict,
    Forbidden,
    Invalid,
    IOFailure,
    NoSpace,
    NotFound,
    TooLarge,
)
from .paths import Workspace

_ERRNO: dict[int, tuple[type[AgentError], str]] = {
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
}


@contextlib.contextmanager
def os_errors(rel: str) -> Iterator[None]:
    """Turn OSError into the API's error vocabulary."""
    try:
        yield
    except OSError as exc:
        kind, code = _ERRNO.get(exc.errno or 0, (IOFailure, "io_error"))
        raise kind(code, f"{exc.strerror or exc}: {rel}", path=rel) from None


def parse_mode(mode: str | None) -> int | None:
    return None if mode is None else int(mode, 8)


def info(ws: Workspace, real: str, s: os.stat_result | None = None) -> models.FileInfo:
    if s is None:
        s = os.lstat(real)
    if st.S_ISREG(s.st_mode):
        kind = "file"
    elif st.S_ISDIR(s.st_mode):
        kind = "directory"
    elif st.S_ISLNK(s.st_mode):
        kind = "symlink"
    else:
        kind = "other"
    target = None
    if kind == "symlink":
        with contextlib.suppress(OSError):
            target = os.readlink(real)
    rel = ws.relative(real)
    return models.FileInfo(
        path=rel,
        name=os.path.basename(real) if rel != "." else ".",
        type=kind,  # type: ignore[arg-type]
        size=s.st_size,
        mode=f"{st.S_IMODE(s.st_mode):04o}",
        modified_at=models.rfc3339(s.st_mtime),
        uid=s.st_uid,
        gid=s.st_gid,
        symlink_target=target,
    )


def stat(ws: Workspace, rel: str) -> models.FileInfo:
    real = ws.resolve(rel, follow=False)
    with os_errors(rel):
        return info(ws, real)


def list_dir(ws: Workspace, rel: str, depth: int, hidden: bool, limit: int) -> models.FileList:
    real = ws.resolve(rel)
    entries: list[models.FileInfo] = []
    truncated = False
    with os_errors(rel):
        if not os.path.isdir(real):
            raise Invalid("not_a_directory", f"not a directory: {rel}")
        stack = [(real, 1)]
        while stack and not truncated:
            d, level = stack.pop()
            with os.scandir(d) as it:
                items = sorted(it, key=lambda e: e.name)
            for e in items:
                if not hidden and e.name.startswith("."):
                    continue
                if len(entries) >= limit:
                    truncated = True
                    break
                try:
                    entries.append(info(ws, e.path, e.stat(follow_symlinks=False)))
                except OSError:
                    continue  # vanished while listing
                if level < depth and e.is_dir(follow_symlinks=False):
                    stack.append((e.path, level + 1))
    entries.sort(key=lambda i: i.path)
    return models.FileList(path=ws.relative(real), entries=entries, truncated=truncated)


def open_for_read(ws: Workspace, rel: str) -> tuple[int, int]:
    """Open a regular file confined to the workspace; returns (fd, size)."""
    real = ws.resolve(rel)
    with os_errors(rel):
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        ws.check_fd(fd, rel)
        s = os.fstat(fd)
        if st.S_ISDIR(s.st_mode):
            raise Invalid("is_a_directory", f"is a directory: {rel}")
        if not st.S_ISREG(s.st_mode):
            raise Invalid("not_a_file", f"not a regular file: {rel}")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, s.st_size


def read_lines(fd: int, start: int, count: int | None, max_bytes: int) -> bytes:
    """Lines start..start+count-1 (1-based) of an open file."""
    out = bytearray()
    with os.fdopen(os.dup(fd), "rb") as f:
        for n, line in enumerate(f, start=1):
            if n < start:
                continue
            if count is not None and n >= start + count:
                break
            out += line
            if len(out) > max_bytes:
                raise TooLarge("read_too_large", "selected lines exceed the read limit")
    return bytes(out)


class AtomicWriter:
    """A temp file next to the target; commit() renames it into place."""

    def __init__(self, ws: Workspace, rel: str, mode: int | None, parents: bool) -> None:
        self.ws = ws
        self.rel = rel
        norm = ws.clean(rel)
        if norm == ".":
            raise Invalid("invalid_path", "cannot write to the workspace root")
        target = ws.resolve(rel, follow=False)
        parent = os.path.dirname(target)
        self.name = os.path.basename(target)
        with os_errors(rel):
            if parents:
                os.makedirs(parent, exist_ok=True)
                ws.confine(os.path.realpath(parent), rel)
            self.dir_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            ws.check_fd(self.dir_fd, rel)
            with os_errors(rel):
                existing: os.stat_result | None = os.stat(
                    self.name, dir_fd=self.dir_fd, follow_symlinks=False
                )
        except NotFound:
            existing = None
        except AgentError:
            os.close(self.dir_fd)
            raise
        if existing is not None and st.S_ISDIR(existing.st_mode):
            os.close(self.dir_fd)
            raise Invalid("is_a_directory", f"is a directory: {rel}")
        # Keep the mode of a file we replace unless told otherwise.
        self.mode = (
            mode
            if mode is not None
            else (
                st.S_IMODE(existing.st_mode) if existing and st.S_ISREG(existing.st_mode) else None
            )
        )
        self.tmp = f".{self.name[:200]}.{os.urandom(6).hex()}.tmp"
        with os_errors(rel):
            try:
                self.fd = os.open(
                    self.tmp,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                    0o666,
                    dir_fd=self.dir_fd,
                )
            except BaseException:
                os.close(self.dir_fd)
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
                if self.mode is not None:
                    os.fchmod(self.fd, self.mode)
                os.close(self.fd)
                self.fd = -1
                os.rename(self.tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
                real = os.path.join(self.ws.resolve(os.path.dirname(self.rel) or "."), self.name)
                return info(self.ws, real)
        finally:
            self.abort()

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            with contextlib.suppress(OSError):
                os.unlink(self.tmp, dir_fd=self.dir_fd)
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
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
            raise TooLarge("file_too_large", f"{rel} is larger than {limit} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit + 1)[:limit]
    finally:
        os.close(fd)


def mkdir(ws: Workspace, req: models.MkdirRequest) -> models.FileInfo:
    real = ws.resolve(req.path)
    mode = parse_mode(req.mode)
    with os_errors(req.path):
        created = False
        if os.path.isdir(real):
            if not req.exist_ok:
                raise Conflict("already_exists", f"already exists: {req.path}")
        elif req.parents:
            os.makedirs(real)
            created = True
        else:
            os.mkdir(real)
            created = True
        ws.confine(os.path.realpath(real), req.path)
        # Only a directory we just made gets the mode (never chmod an existing
        # one, e.g. the workspace root, through mkdir).
        if mode is not None and created:
            os.chmod(real, mode)
        return info(ws, real)


def remove(ws: Workspace, req: models.RemoveRequest) -> models.Removed:
    if ws.clean(req.path) == ".":
        raise Invalid("invalid_path", "refusing to remove the workspace root")
    real = ws.resolve(req.path, follow=False)
    with os_errors(req.path):
        try:
            s = os.lstat(real)
        except FileNotFoundError:
            if req.missing_ok:
                return models.Removed(path=ws.relative(real), removed=False)
            raise
        if st.S_ISDIR(s.st_mode):
            if req.recursive:
                shutil.rmtree(real)  # fd-based on Linux: does not follow symlinks
            else:
                os.rmdir(real)
        else:
            os.unlink(real)
    return models.Removed(path=ws.relative(real), removed=True)


def move(ws: Workspace, req: models.MoveRequest) -> models.FileInfo:
    if ws.clean(req.source) == "." or ws.clean(req.destination) == ".":
        raise Invalid("invalid_path", "cannot move the workspace root")
    src = ws.resolve(req.source, follow=False)
    dst = ws.resolve(req.destination, follow=False)
    with os_errors(req.source):
        os.lstat(src)
    with os_errors(req.destination):
        if req.parents:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            ws.confine(os.path.realpath(os.path.dirname(dst)), req.destination)
        if os.path.lexists(dst):
            if not req.overwrite:
                raise Conflict("already_exists", f"destination exists: {req.destination}")
            if os.path.isdir(dst) and not os.path.islink(dst) and src != dst:
                if not os.path.isdir(src) or os.path.islink(src):
                    raise Invalid("is_a_directory", "cannot replace a directory with a file")
                shutil.rmtree(dst)
        if src == dst or dst.startswith(src + os.sep):
            raise Invalid("invalid_operation", "cannot move a path into itself")
        os.rename(src, dst)
        return info(ws, dst)


def _walk_files(
    ws: Workspace, root: str, hidden: bool, max_depth: int | None = None
) -> Iterator[tuple[str, os.DirEntry[str], int]]:
    """(relative path, entry, depth) for everything under root, symlinks not followed."""
    stack = [(root, 1)]
    while stack:
        d, depth = stack.pop()
        try:
            with os.scandir(d) as it:
                items = sorted(it, key=lambda e: e.name, reverse=True)
        except OSError:
            continue
        for e in reversed(items):
            if not hidden and e.name.startswith("."):
                continue
            yield ws.relative(e.path), e, depth
            try:
                is_dir = e.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if is_dir and (max_depth is None or depth < max_depth):
                stack.append((e.path, depth + 1))


def search(ws: Workspace, req: models.SearchRequest, s: Settings) -> models.SearchResult:
    root = ws.resolve(req.path)
    flags = re.IGNORECASE if req.ignore_case else 0
    pattern = re.escape(req.pattern) if req.fixed_string else req.pattern
    try:
        rx = re.compile(pattern.encode("utf-8", "surrogateescape"), flags)
    except (re.error, OverflowError, RecursionError) as exc:
        raise Invalid("invalid_regex", f"invalid regular expression: {exc}") from None
    limit = min(req.max_results or s.search_max_results, s.search_max_results)
    matches: list[models.SearchMatch] = []
    scanned = skipped = 0
    truncated = False
    if os.path.isfile(root):
        targets: Iterator[tuple[str, str]] = iter([(ws.relative(root), root)])
    elif os.path.isdir(root):
        targets = (
            (rel, e.path)
            for rel, e, _ in _walk_files(ws, root, req.include_hidden)
            if e.is_file(follow_symlinks=False)
            and (
                req.glob is None
                or fnmatch.fnmatch(e.name, req.glob)
                or fnmatch.fnmatch(rel, req.glob)
            )
        )
    else:
        raise NotFound("not_found", f"not found: {req.path}")
    for rel, path in targets:
        if scanned + skipped >= s.search_max_files:
            truncated = True
            break
        try:
            if os.lstat(path).st_size > s.search_max_file_bytes:
                skipped += 1
                continue
            with open(path, "rb") as f:
                data = f.read(s.search_max_file_bytes + 1)
        except OSError:
            skipped += 1
            continue
        if b"\0" in data[:8192]:
            skipped += 1  # binary
            continue
        scanned += 1
        for lineno, line in enumerate(data.splitlines(), start=1):
            m = rx.search(line)
            if m is None:
                continue
            if len(matches) >= limit:
                truncated = True
                break
            matches.append(
                models.SearchMatch(
                    path=rel,
                    line=lineno,
                    column=len(line[: m.start()].decode("utf-8", "replace")) + 1,
                    text=line[:1000].decode("utf-8", "replace"),
                )
            )
        if truncated:
            break
    return models.SearchResult(
        matches=matches, truncated=truncated, files_scanned=scanned, files_skipped=skipped
    )


def find(ws: Workspace, req: models.FindRequest, s: Settings) -> models.FindResult:
    root = ws.resolve(req.path)
    if not os.path.isdir(root):
        with os_errors(req.path):
            os.stat(root)
        raise Invalid("not_a_directory", f"not a directory: {req.path}")
    limit = min(req.max_results or s.search_max_results, s.search_max_results)
    by_path = "/" in req.pattern
    out: list[str] = []
    truncated = False
    seen = 0
    for rel, e, _ in _walk_files(ws, root, req.include_hidden, req.max_depth):
        seen += 1
        if seen > s.search_max_files:
            truncated = True
            break
        try:
            is_dir = e.is_dir(follow_symlinks=False)
        except OSError:
            continue
        if (req.type == "file" and is_dir) or (req.type == "directory" and not is_dir):
            continue
        subject = os.path.relpath(e.path, root) if by_path else e.name
        if fnmatch.fnmatchcase(subject, req.pattern):
            if len(out) >= limit:
                truncated = True
                break
            out.append(rel)
    return models.FindResult(paths=out, truncated=truncated)


def replace(ws: Workspace, req: models.ReplaceRequest, s: Settings) -> models.ReplaceResult:
    raw = read_all(ws, req.path, s.search_max_file_bytes * 8)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Invalid("not_text", f"{req.path} is not UTF-8 text") from None
    if req.regex:
        try:
            rx = re.compile(req.find, re.MULTILINE)
        except (re.error, OverflowError, RecursionError) as exc:
            raise Invalid("invalid_regex", f"invalid regular expression: {exc}") from None
        count = len(rx.findall(text))
    else:
        count = text.count(req.find)
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
    if req.regex:
        try:
            new = rx.sub(req.replace, text)
        except (re.error, IndexError) as exc:
            raise Invalid("invalid_replacement", f"invalid replacement: {exc}") from None
    else:
        new = text.replace(req.find, req.replace)
    write_bytes(ws, req.path, new.encode("utf-8"), parents=False)
    return models.ReplaceResult(path=ws.relative(ws.resolve(req.path)), replacements=count)


def sync(ws: Workspace) -> models.SyncResult:
    t = time.monotonic()
    # syncfs(2) on the workspace would be narrower, but os has no binding for
    # it; sync(2) flushes everything including the workspace volume.
    os.sync()
    return models.SyncResult(synced=True, duration_seconds=round(time.monotonic() - t, 6))
