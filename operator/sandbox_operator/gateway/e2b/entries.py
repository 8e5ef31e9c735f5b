"""What the filesystem parts share: request fields, EntryInfo, agent calls and their errors.

Requests are proto3 JSON from a hostile caller: each field is type-checked
(`field`), a path goes through paths.py. Entries are E2B's EntryInfo in
proto3 JSON: camelCase, int64 as a string, enum names, Timestamp as RFC 3339.
An agent's error answer becomes the Connect error nearest to it, naming the
path as the caller gave it.
"""

from __future__ import annotations

import json
import posixpath
import re
from typing import Any

from aiohttp import web

from sandbox_operator.gateway.e2b import paths
from sandbox_operator.gateway.e2b.connect import ConnectError
from sandbox_operator.gateway.e2b.core import Adapter, E2BError, Target

JSON = dict[str, Any]
# Owner and group names: the sandbox user (E2B's `user`) is UID and GID 1000 in
# the E2B templates, as in E2B's own; other IDs are shown as numbers, as envd
# shows an ID it cannot name.
NAMES = {0: "root", 1000: "user"}
FILE_TYPES = {"file": "FILE_TYPE_FILE", "directory": "FILE_TYPE_DIRECTORY"}


def field(message: JSON, name: str, kind: type, default: Any) -> Any:
    """The field `name` (lowerCamel, or as the proto spells it) of a request, of
    type `kind`, or `default` when absent; invalid_argument otherwise."""
    snake = re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name)
    value = message.get(name, message.get(snake))
    if value is None:
        return default
    if kind is int:
        # proto3 JSON: a uint32 is a number or a decimal string.
        if isinstance(value, str) and value.isdigit() and len(value) <= 10:
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 32:
            raise ConnectError("invalid_argument", f"{name} must be an unsigned 32-bit integer")
        return value
    if not isinstance(value, kind):
        raise ConnectError("invalid_argument", f"{name} must be a {kind.__name__}")
    return value


def path_field(message: JSON, name: str, home: str) -> tuple[str, str]:
    """(agent path, absolute path shown) of a path field."""
    raw = field(message, name, str, "")
    try:
        rel = paths.agent_path(raw, home)
    except paths.Refused as exc:
        raise ConnectError(exc.code, exc.message) from None
    return rel, paths.e2b_path(rel, home)


# -- entries -----------------------------------------------------------------------------


def go_permissions(kind: str, mode: int) -> str:
    """The permissions string envd shows (Go's FileMode.String: type letters, then
    rwx): `-rw-r--r--`, `drwxr-xr-x`, `Lrwxrwxrwx` for a symlink."""
    letters = {"directory": "d", "symlink": "L", "other": "?"}.get(kind, "")
    special = "".join(c for bit, c in ((0o4000, "u"), (0o2000, "g"), (0o1000, "t")) if mode & bit)
    prefix = letters[:1] + special + letters[1:]
    rwx = "".join(c if mode & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))
    return (prefix or "-") + rwx


def entry_info(info: JSON, shown: str) -> JSON:
    """An EntryInfo (proto3 JSON) of the agent's FileInfo `info`, at the absolute
    path `shown`. A symlink is FILE_TYPE_SYMLINK (and isSymlink), its target an
    absolute path as envd shows it."""
    kind = str(info.get("type", ""))
    try:
        mode = int(str(info.get("mode", "0")), 8)
    except ValueError:
        mode = 0
    entry: JSON = {
        "name": posixpath.basename(shown) or "/",
        "type": "FILE_TYPE_SYMLINK"
        if kind == "symlink"
        else FILE_TYPES.get(kind, "FILE_TYPE_UNSPECIFIED"),
        "path": shown,
        "size": str(int(info.get("size") or 0)),
        "mode": mode & 0o777,
        "permissions": go_permissions(kind, mode),
        "owner": NAMES.get(int(info.get("uid", -1)), str(info.get("uid", ""))),
        "group": NAMES.get(int(info.get("gid", -1)), str(info.get("gid", ""))),
    }
    if info.get("modifiedAt"):
        entry["modifiedTime"] = info["modifiedAt"]
    if kind == "symlink":
        target = str(info.get("symlinkTarget") or "")
        if target and not target.startswith("/"):
            target = posixpath.normpath(posixpath.join(posixpath.dirname(shown), target))
        entry["symlinkTarget"] = target
        entry["isSymlink"] = True
    return entry


def tree_order(entry: JSON) -> list[str]:
    # As envd walks a tree: a directory, then what it holds, names sorted at each level.
    return str(entry["path"]).split("/")


# -- calls into the agent ----------------------------------------------------------------


async def agent_json(
    adapter: Adapter,
    target: Target,
    method: str,
    path: str,
    shown: str,
    *,
    params: dict[str, str] | None = None,
    body: JSON | None = None,
) -> Any:
    """The agent's JSON answer, or the ConnectError its error maps to (`shown`:
    the path named in the message)."""
    try:
        response = await adapter.agent(target, method, path, params=params, json_body=body)
    except E2BError as exc:
        raise ConnectError("unavailable", exc.message) from None
    async with response:
        data = await response.read()
        if response.status < 400:
            return json.loads(data) if data else None
        raise agent_error(response.status, data, shown)


def agent_error(status: int, data: bytes, shown: str) -> ConnectError:
    """A Connect error for an agent's error answer: its message, naming `shown`."""
    try:
        error = json.loads(data).get("error") or {}
        code, message = str(error.get("code", "")), str(error.get("message", ""))
    except (ValueError, AttributeError):
        code, message = "", data[:200].decode(errors="replace")
    if status == 409 and code != "already_exists":
        return ConnectError("failed_precondition", f"{shown}: {message}")
    if status == 507:
        return ConnectError("resource_exhausted", f"{shown}: {message}")
    if status == 400 and code == "path_traversal":
        return ConnectError("invalid_argument", f"{shown}: {message}")
    return ConnectError.from_http(status, f"{shown}: {message}" if shown else message)


def user_of(request: web.Request) -> None:
    """Refuses a call made as any user but E2B's default one."""
    try:
        paths.check_user(paths.basic_user(request.headers.get("Authorization")))
    except paths.Refused as exc:
        raise ConnectError(exc.code, exc.message) from None
