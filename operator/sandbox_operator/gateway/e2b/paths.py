"""E2B's paths and users, mapped onto the workspace a sandbox's agent serves.

E2B's daemon takes a path that is absolute, or relative to the user's home
(`~` and `~/...` too). Here the home is the workspace: mounted in the
sandbox container at `Route.workspace` (`/home/user` for the E2B templates,
`/workspace` for the project's runtimes), and the agent takes paths relative
to it. So an absolute path under the mount becomes the relative one, a
relative path stays as it is, and every path in an answer is absolute again.

Nothing outside the workspace can be reached (the agent serves only the
workspace): such a path is refused, naming the workspace. `..` is refused
outright rather than resolved (resolving it lexically would disagree with the
kernel wherever a symlink is on the way), as are its percent-encoded forms,
which the agent refuses too; this check does not rely on it. Empty and `.`
segments and a trailing slash are harmless and dropped (`/home/user/` is the
home).

Users: E2B's default user `user` (or none) is the one the sandbox runs as;
`root` is refused (sandboxes run under Pod Security `restricted`: no root),
and so is any other name.
"""

from __future__ import annotations

import base64
import binascii
import posixpath
from urllib.parse import unquote

MAX_PATH = 4096
DEFAULT_USER = "user"
_STATUS = {"invalid_argument": 400, "permission_denied": 403, "unauthenticated": 401}
# Decoding layers looked through for a hidden '..' or leading '/'.
_LAYERS = 3


class Refused(Exception):
    """A path or user the adapter will not act on: `code` is a Connect code
    (`invalid_argument`, `permission_denied`, `unauthenticated`), `status` the
    HTTP status the daemon's /files answers with for it."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message
        self.status = _STATUS[code]


def _segments(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]


def _check_text(path: str) -> None:
    if len(path) > MAX_PATH:
        raise Refused("invalid_argument", f"a path is at most {MAX_PATH} characters")
    if any(c < " " or c == "\x7f" or "\ud800" <= c <= "\udfff" for c in path) or "\\" in path:
        raise Refused(
            "invalid_argument",
            f"path {path[:200]!r}: control characters and backslashes are not allowed",
        )


def _check_layers(rel: str, shown: str) -> None:
    """No layer of percent-decoding of `rel` may hold '..', start with '/' or
    hold a backslash or control character (what the agent refuses too)."""
    layer = rel
    for _ in range(_LAYERS):
        decoded = unquote(layer, errors="surrogateescape")
        if decoded == layer:
            return
        layer = decoded
        if layer.startswith("/") or ".." in layer.split("/"):
            raise Refused(
                "invalid_argument",
                f"path {shown[:200]!r}: encoded '..' or '/' segments are not allowed",
            )
        if "\\" in layer or any(c < " " or c == "\x7f" for c in layer):
            raise Refused(
                "invalid_argument",
                f"path {shown[:200]!r}: encoded backslashes and control characters are not allowed",
            )
    raise Refused("invalid_argument", f"path {shown[:200]!r}: too many layers of percent-encoding")


def agent_path(path: str, home: str) -> str:
    """The workspace-relative path the agent takes for E2B's `path` ('.' for
    the home itself); Refused when it names nothing the agent may serve."""
    _check_text(path)
    if path == "~" or path.startswith("~/"):
        path = path[1:].lstrip("/")
    elif path.startswith("~"):
        raise Refused("invalid_argument", f"path {path[:200]!r}: only '~' (the home) is expanded")
    if ".." in path.split("/"):
        raise Refused(
            "invalid_argument",
            f"path {path[:200]!r}: '..' is not allowed (name the path from {home} or as"
            " an absolute path)",
        )
    parts = _segments(path)
    if path.startswith("/"):
        base = _segments(home)
        if parts[: len(base)] != base:
            raise Refused(
                "permission_denied",
                f"path {path[:200]!r} is outside the sandbox's workspace {home}: files are"
                f" served from {home} and below only",
            )
        parts = parts[len(base) :]
    rel = "/".join(parts) or "."
    _check_layers(rel, path)
    return rel


def e2b_path(rel: str, home: str) -> str:
    """The absolute path E2B shows for the workspace-relative `rel`."""
    base = "/" + "/".join(_segments(home))
    if rel in ("", "."):
        return base
    return posixpath.join(base, rel)


def below(rel: str, top: str) -> str | None:
    """`rel` relative to the directory `top` (both workspace-relative), or None
    when it is not below it."""
    if top == ".":
        return rel
    if rel.startswith(top + "/"):
        return rel[len(top) + 1 :]
    return None


def check_user(name: str | None) -> None:
    """Refused unless `name` is E2B's default user (or none)."""
    if name is None or name == "" or name == DEFAULT_USER:
        return
    if name == "root":
        raise Refused(
            "permission_denied",
            "user 'root' is not available: sandboxes run as 'user' (no root under Pod Security"
            " 'restricted')",
        )
    raise Refused(
        "unauthenticated", f"invalid username: {name[:100]!r} (this sandbox knows only 'user')"
    )


def basic_user(header: str | None) -> str | None:
    """The user E2B's SDKs name in `Authorization: Basic base64(user:)`, or None
    when none is named. Refused when the header cannot be read."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode()
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise Refused("unauthenticated", "the Authorization header is not valid Basic") from None
    return decoded.partition(":")[0]
