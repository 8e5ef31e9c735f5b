"""What the filesystem parts share: request fields, EntryInfo, agent calls and their errors.

Requests are proto3 JSON from a hostile caller: each field is type-checked
(`field`), a path goes through paths.py. Entries are E2B's EntryInfo in
proto3 JSON: camelCase, int64 as a string, enum names, Timestamp as RFC 3339.
An agent's error answer becomes the Connect error nearest to it, naming the
path as the caller gave it.
"""

from __future__ import annotations

import asyncio
import json
import posixpath
import re
from typing import Any

from aiohttp import web

from sandbox_operator.gateway.agent_table import AgentErrorCode
from sandbox_operator.gateway.e2b import paths
from sandbox_operator.gateway.e2b.connect import ConnectError
from sandbox_operator.gateway.e2b.core import Adapter, E2BError, Target, whole

JSON = dict[str, Any]
# Owner and group names: the sandbox user (E2B's `user`) is UID and GID 1000 in
# the E2B templates, as in E2B's own; other IDs are shown as numbers, as envd
# shows an ID it cannot name.
NAMES = {0: "root", 1000: "user"}
FILE_TYPES = {"file": "FILE_TYPE_FILE", "directory": "FILE_TYPE_DIRECTORY"}
MAX_LINKS = 256  # symlinks of one answer whose targets are looked up


def field(message: JSON, name: str, kind: type, default: Any) -> Any:
    """The field `name` (lowerCamel, or as the proto spells it) of a request, of
    type `kind`, or `default` when absent; invalid_argument otherwise."""
    snake = re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name)
    value = message.get(name, message.get(snake))
    if value is None:
        return default
    if kind is int:
        # proto3 JSON: a uint32 is a number or a decimal string.
        if isinstance(value, str):
            value = whole(value, 10)
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


def entry_info(info: JSON, shown: str, home: str, resolved: JSON | None = None) -> JSON:
    """An EntryInfo (proto3 JSON) of the agent's FileInfo `info`, at the absolute
    path `shown`. A symlink, as the newest envd shows it: `isSymlink`, with the
    type and mode of what it points to and that path as its target (`resolved`:
    the agent's FileInfo of the target, None when it leads nowhere or outside
    the workspace: then the type is FILE_TYPE_SYMLINK, the mode the link's own
    and the target the link's text)."""
    kind = str(info.get("type", ""))
    mode = _mode(info)
    entry: JSON = {
        "name": posixpath.basename(shown) or "/",
        "type": FILE_TYPES.get(kind, "FILE_TYPE_UNSPECIFIED"),
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
        entry["isSymlink"] = True
        if resolved is not None:
            entry["type"] = FILE_TYPES.get(str(resolved.get("type")), "FILE_TYPE_UNSPECIFIED")
            entry["mode"] = _mode(resolved) & 0o777
            entry["symlinkTarget"] = paths.e2b_path(str(resolved.get("path", ".")), home)
        else:
            # Leads nowhere, or out of the workspace: shown as a symlink (as older
            # envd shows every symlink) rather than dropped as of unknown type.
            entry["type"] = "FILE_TYPE_SYMLINK"
            text = str(info.get("symlinkTarget") or "")
            if not text.startswith("/"):
                text = posixpath.normpath(posixpath.join(posixpath.dirname(shown), text))
            entry["symlinkTarget"] = text
    return entry


def _mode(info: JSON) -> int:
    try:
        return int(str(info.get("mode", "0")), 8)
    except ValueError:
        return 0


async def entries(adapter: Adapter, target: Target, found: list[tuple[JSON, str]]) -> list[JSON]:
    """EntryInfos of the agent's FileInfos (each with its absolute path), the
    targets of symlinks looked up (at most MAX_LINKS of them, a few at a time;
    past that a symlink's target is left unresolved)."""
    home = target.route.workspace
    links = [shown for info, shown in found if info.get("type") == "symlink"][:MAX_LINKS]
    resolved: dict[str, JSON | None] = {}
    gate = asyncio.Semaphore(8)

    async def follow(shown: str) -> None:
        async with gate:
            try:
                rel = paths.agent_path(shown, home)
                params = {"path": rel, "follow": "true"}
                resolved[shown] = await agent_json(
                    adapter, target, "GET", "files/stat", shown, params=params
                )
            except (ConnectError, paths.Refused):
                resolved[shown] = None

    await asyncio.gather(*(follow(shown) for shown in links))
    return [entry_info(info, shown, home, resolved.get(shown)) for info, shown in found]


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


def agent_message(data: bytes) -> tuple[str, str]:
    """(code, message) of an agent's error answer."""
    try:
        error = json.loads(data).get("error") or {}
        return str(error.get("code", "")), str(error.get("message", ""))
    except (ValueError, AttributeError):
        return "", data[:200].decode(errors="replace")


def agent_error(status: int, data: bytes, shown: str) -> ConnectError:
    """A Connect error for an agent's error answer. Its message names a path the
    agent's way (relative to the workspace): `shown` is named instead."""
    code, message = agent_message(data)
    sentence = message.split(": ", 1)[0] if ": " in message else message
    text = f"{sentence}: {shown}" if shown else message
    if status == 404 and code == AgentErrorCode.NOT_FOUND:
        return ConnectError("not_found", f"no such file or directory: {shown}")
    if status == 409 and code != AgentErrorCode.ALREADY_EXISTS:
        return ConnectError("failed_precondition", text)
    if status == 507:
        return ConnectError("resource_exhausted", text)
    return ConnectError.from_http(status, text)


def user_of(request: web.Request) -> None:
    """Refuses a call made as any user but E2B's default one."""
    try:
        paths.check_user(paths.basic_user(request.headers.get("Authorization")))
    except paths.Refused as exc:
        raise ConnectError(exc.code, exc.message) from None
