"""Workspace path confinement.

Two layers, because user code (another UID, same group) can rewrite the
workspace under our feet:
1. syntax: refuse absolute paths, '..' components, NUL and percent-encoded
   tricks before touching the filesystem;
2. resolution: realpath + commonpath must stay under the workspace root, and
   after opening, the descriptor's /proc/self/fd target is checked again so a
   symlink swapped in between check and open is caught (TOCTOU).
"""

from __future__ import annotations

import os
import posixpath
from urllib.parse import unquote

from .errors import AgentError, Forbidden, Invalid

MAX_PATH = 4096


def _refuse(code: str, message: str, path: str) -> AgentError:
    kind = Forbidden if code == "path_escape" else Invalid
    return kind(code, message, path=path[:300])


class Workspace:
    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)

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
                raise _refuse("path_traversal", "absolute paths are not allowed", rel)
            if ".." in cand.split("/"):
                raise _refuse("path_traversal", "'..' is not allowed in paths", rel)
        norm = posixpath.normpath(rel) if rel else "."
        return norm

    def resolve(self, rel: str, *, follow: bool = True) -> str:
        """Absolute path for ``rel``, confined to the workspace.

        ``follow=False`` resolves only the parent, for operations on a link
        itself (stat of a symlink, remove, move).
        """
        norm = self.clean(rel)
        full = self.root if norm == "." else os.path.join(self.root, norm)
        if follow or norm == ".":
            real = os.path.realpath(full)
        else:
            real = os.path.join(os.path.realpath(os.path.dirname(full)), os.path.basename(full))
        self.confine(real, rel)
        return real

    def confine(self, real: str, rel: str = "") -> None:
        if real != self.root and os.path.commonpath([self.root, real]) != self.root:
            raise _refuse("path_escape", "path resolves outside the workspace", rel or real)

    def check_fd(self, fd: int, rel: str) -> None:
        """Re-check what was actually opened (defeats symlink swaps after resolve)."""
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return  # no /proc (not Linux): the resolve() check stands alone
        self.confine(target, rel)

    def relative(self, real: str) -> str:
        rel = os.path.relpath(real, self.root)
        return "." if rel == "." else rel.replace(os.sep, "/")
