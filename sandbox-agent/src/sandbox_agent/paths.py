"""Workspace path confinement, by descriptor.

User code (another UID, same group) rewrites the workspace under our feet,
in a loop if it likes: a directory becomes a symlink to ``/`` between two of
our system calls, a file becomes a FIFO. So no full path is ever handed to
the kernel. A path is walked one component at a time from a descriptor of
the workspace root, each with ``openat(..., O_PATH | O_NOFOLLOW)``; a symlink
met on the way is read and its target walked the same way (relative targets
only, and never above the root: ``..`` pops the stack of directories we hold,
it does not ask the filesystem). What a caller then opens, it opens relative
to the parent's descriptor with ``O_NOFOLLOW`` (and ``O_NONBLOCK``, then an
``fstat`` type check), so a swap after the walk is refused, never followed.

Client paths are also checked for syntax first: absolute paths, ``..``
components, NUL, backslashes and percent-encoded tricks are refused before
the filesystem is touched.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import stat as st
from collections import deque
from dataclasses import dataclass
from urllib.parse import unquote

from .errors import AgentError, Code, Forbidden, Invalid, NotFound

MAX_PATH = 4096
MAX_LINKS = 40  # symlinks followed in one walk, as the kernel's ELOOP limit
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_PATH = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def _refuse(code: Code, message: str, path: str) -> AgentError:
    kind = Forbidden if code == "path_escape" else Invalid
    return kind(code, message, path=display(path[:300]))


def display(name: str) -> str:
    """A name as the API shows it. File names are bytes; one that is not UTF-8
    is shown with U+FFFD in place of the bad bytes instead of failing the call."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(name).decode("utf-8", "replace")
    return name


@dataclass
class Located:
    """A walked path: ``name`` inside the directory open as ``dir_fd``.

    ``name`` is "." for the workspace root. ``rel`` is the path the walk
    ended at (symlinks resolved), relative to the root. The caller owns
    ``dir_fd`` and closes it (``close()``, or use it as a context manager).
    """

    dir_fd: int
    name: str
    rel: str

    def close(self) -> None:
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1

    def __enter__(self) -> Located:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Workspace:
    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        # On its own filesystem (a volume: the pod's case) every inode belongs
        # to the workspace, so a file with several hard links is harmless. In a
        # directory of a larger filesystem a hard link may name an inode that
        # lives outside: such files are refused (see check_links).
        try:
            self.own_filesystem = os.path.ismount(self.root)
        except OSError:
            self.own_filesystem = False

    def clean(self, rel: str) -> str:
        """Validate the syntax of a client path; return it normalised ('.' for root)."""
        if len(rel) > MAX_PATH:
            raise _refuse("invalid_path", "path too long", rel)
        if "\0" in rel:
            raise _refuse("invalid_path", "path contains NUL", rel)
        if "\\" in rel:
            raise _refuse("invalid_path", "backslashes are not allowed in paths", rel)
        candidates = {rel}
        # Requests are already percent-decoded once; a second layer of
        # encoding in a path is only ever an attempt to smuggle '..' or '/'.
        decoded = rel
        for _ in range(3):
            nxt = unquote(decoded)
            if nxt == decoded:
                break
            candidates.add(nxt)
            decoded = nxt
        for cand in candidates:
            if cand.startswith("/"):
                # Say what paths are: "/" reads as the workspace's root to someone
                # who has not met the confinement yet.
                raise _refuse(
                    "path_traversal",
                    "absolute paths are not allowed: paths are relative to the workspace"
                    " ('.' is its root)",
                    rel,
                )
            if ".." in cand.split("/"):
                raise _refuse(
                    "path_traversal",
                    "'..' is not allowed in paths: paths are relative to the workspace"
                    " and stay inside it",
                    rel,
                )
        norm = posixpath.normpath(rel) if rel else "."
        return norm

    def open_root(self) -> int:
        return os.open(self.root, _DIR)

    def locate(
        self, rel: str, *, follow: bool = True, make_parents: bool = False, mode: int = 0o777
    ) -> Located:
        """Walk ``rel`` (validated first) to its parent directory's descriptor.

        Symlinks on the way are followed inside the workspace; the last
        component too when ``follow`` (it need not exist). ``make_parents``
        creates missing directories on the way (``mode``). A symlink that
        leads out is 403 ``path_escape``; other failures are OSError for the
        caller's ``os_errors``.
        """
        norm = self.clean(rel)
        return self.walk([] if norm == "." else norm.split("/"), rel, follow, make_parents, mode)

    def walk(
        self,
        parts: list[str],
        rel: str,
        follow: bool = True,
        make_parents: bool = False,
        mode: int = 0o777,
    ) -> Located:
        fds = [self.open_root()]
        names: list[str] = []
        pending = deque(p for p in parts if p not in ("", "."))
        links = 0
        try:
            while pending:
                comp = pending.popleft()
                if comp == "..":  # only ever from a symlink's target
                    if len(fds) == 1:
                        raise _refuse("path_escape", "path resolves outside the workspace", rel)
                    os.close(fds.pop())
                    names.pop()
                    continue
                last = not pending
                if last and not follow:
                    return self._located(fds, names, comp)
                try:
                    fd = os.open(comp, _PATH, dir_fd=fds[-1])
                except FileNotFoundError:
                    if last:
                        return self._located(fds, names, comp)
                    if not make_parents:
                        raise
                    # made meanwhile: the next round opens (and checks) it
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(comp, mode, dir_fd=fds[-1])
                    pending.appendleft(comp)
                    continue
                kind = os.fstat(fd).st_mode
                if st.S_ISLNK(kind):
                    try:
                        target = os.readlink("", dir_fd=fd)
                    finally:
                        os.close(fd)
                    links += 1
                    if links > MAX_LINKS:
                        raise _refuse("path_escape", "too many levels of symbolic links", rel)
                    if target.startswith("/") or not target:
                        raise _refuse("path_escape", "path resolves outside the workspace", rel)
                    steps = [p for p in target.split("/") if p not in ("", ".")]
                    pending.extendleft(reversed(steps))
                    continue
                if last:
                    os.close(fd)
                    return self._located(fds, names, comp)
                if not st.S_ISDIR(kind):
                    os.close(fd)
                    raise NotADirectoryError(20, "Not a directory")
                fds.append(fd)
                names.append(comp)
            # The walk ended on a directory (the root, or a symlink to a directory
            # as the last component): name it through its parent when there is one.
            if len(fds) == 1:
                return self._located(fds, names, ".")
            os.close(fds.pop())
            return self._located(fds, names, names.pop())
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    @staticmethod
    def _located(fds: list[int], names: list[str], name: str) -> Located:
        for fd in fds[:-1]:
            os.close(fd)
        dir_fd = fds[-1]
        fds.clear()
        rel = "/".join([*names, name]) if name != "." else ("/".join(names) or ".")
        return Located(dir_fd, name, rel)

    def check_links(self, s: os.stat_result, rel: str) -> None:
        """Refuse a regular file that may be an inode from outside (see __init__)."""
        if st.S_ISREG(s.st_mode) and s.st_nlink > 1 and not self.own_filesystem:
            raise _refuse(
                "path_escape",
                "file has several hard links and the workspace is not a filesystem "
                "of its own: it may be a file from outside",
                rel,
            )

    def open_dir(self, rel: str) -> tuple[int, str]:
        """A readable descriptor of directory ``rel`` and the path it resolved to."""
        with self.locate(rel) as loc:
            try:
                fd = os.open(loc.name, _DIR, dir_fd=loc.dir_fd)
            except FileNotFoundError:
                raise NotFound("not_found", f"not found: {display(rel)}") from None
            except (NotADirectoryError, OSError) as exc:
                if isinstance(exc, NotADirectoryError) or exc.errno == 40:  # ELOOP
                    raise Invalid("not_a_directory", f"not a directory: {display(rel)}") from None
                raise
            return fd, loc.rel
