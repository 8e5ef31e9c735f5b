"""E2B's directory watches: the agent's watch events as E2B's FilesystemEvents.

The agent reports `create`, `write`, `remove`, `chmod` and `rename` with a
path relative to the workspace (under the watched path as it was named); E2B
names an entry relative to the watched directory. A rename within the watch
is, in E2B's (fsnotify's) terms, a RENAME of the old name and a CREATE of the
new one; moved in is a CREATE, moved out a RENAME. The agent's `overflow`
(changes dropped past its bounded queue) has no E2B counterpart and is not
passed on; `keepalive` becomes E2B's keepalive on a stream.

WatchDir is a server stream over one connection: the agent's watch stream is
read and translated event by event, with E2B's keepalives every
`Keepalive-Ping-Interval` seconds, until the caller leaves, its deadline
(`Connect-Timeout-Ms`) passes, or the directory goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import aiohttp
from aiohttp import web

from sandbox_operator.gateway.e2b import connect, paths
from sandbox_operator.gateway.e2b.connect import ConnectError
from sandbox_operator.gateway.e2b.core import Adapter, E2BError, Target, whole
from sandbox_operator.gateway.e2b.entries import (
    agent_error,
    agent_json,
    entries,
    field,
    path_field,
    user_of,
)

JSON = dict[str, Any]
KINDS = {
    "create": "EVENT_TYPE_CREATE",
    "write": "EVENT_TYPE_WRITE",
    "remove": "EVENT_TYPE_REMOVE",
    "rename": "EVENT_TYPE_RENAME",
    "chmod": "EVENT_TYPE_CHMOD",
}
# Events whose entry still exists at its path (include_entry), as envd has it.
WITH_ENTRY = ("EVENT_TYPE_CREATE", "EVENT_TYPE_WRITE", "EVENT_TYPE_CHMOD")
KEEPALIVE_HEADER = "Keepalive-Ping-Interval"
DEFAULT_KEEPALIVE = 50.0  # seconds (what E2B's JS SDK asks for)
MAX_LINE = 1 << 20  # an agent event line is far smaller


def _name(path: str, top: str) -> str | None:
    if path == top:
        return "."
    return paths.below(path, top)


def translate(event: JSON, top: str) -> list[JSON]:
    """The FilesystemEvents (proto3 JSON, `name` relative to the watched
    directory `top`) of one agent watch event; none for what E2B has no name for."""
    kind = event.get("type")
    path = event.get("path")
    if not isinstance(path, str) or kind not in KINDS:
        return []
    name = _name(path, top)
    if name is None:
        return []
    if kind != "rename":
        return [{"name": name, "type": KINDS[kind]}]
    move = event.get("move")
    if move == "in":
        return [{"name": name, "type": "EVENT_TYPE_CREATE"}]
    if move == "out":
        return [{"name": name, "type": "EVENT_TYPE_RENAME"}]
    old = event.get("oldPath")
    old_name = _name(old, top) if isinstance(old, str) else None
    out = [] if old_name is None else [{"name": old_name, "type": "EVENT_TYPE_RENAME"}]
    return [*out, {"name": name, "type": "EVENT_TYPE_CREATE"}]


async def add_entry(adapter: Adapter, target: Target, event: JSON, top: str, home: str) -> None:
    """Put the entry's EntryInfo in `event` when it still exists (best effort,
    as envd: nothing when it is gone or cannot be read)."""
    if event["type"] not in WITH_ENTRY or event["name"] == ".":
        return
    rel = event["name"] if top == "." else f"{top}/{event['name']}"
    shown = paths.e2b_path(rel, home)
    with contextlib.suppress(ConnectError):
        info = await agent_json(adapter, target, "GET", "files/stat", shown, params={"path": rel})
        event["entry"] = (await entries(adapter, target, [(info, shown)]))[0]


def keepalive_seconds(request: web.Request) -> float:
    value = whole(request.headers.get(KEEPALIVE_HEADER, ""), 4)
    if value is not None and 0 < value <= 3600:
        return float(value)
    return DEFAULT_KEEPALIVE


class WatchDir:
    """The WatchDir server stream."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter

    async def serve(
        self, request: web.Request, target: Target, params: dict[str, str]
    ) -> web.StreamResponse:
        try:
            message, streaming = await connect.read_request(request)
            if not streaming:
                raise ConnectError("invalid_argument", f"a server stream: send {connect.STREAM}")
            user_of(request)
            home = target.route.workspace
            rel, shown = path_field(message, "path", home)
            recursive = field(message, "recursive", bool, False)
            with_entries = field(message, "includeEntry", bool, False)
            field(message, "allowNetworkMounts", bool, False)
        except ConnectError as exc:
            return exc.response()
        deadline = connect.timeout_seconds(request)
        until = None if deadline is None else time.monotonic() + deadline
        query = {"path": rel, "recursive": "true" if recursive else "false"}
        try:
            upstream = await self.adapter.agent(target, "GET", "files/watch", params=query)
        except E2BError as exc:
            return ConnectError("unavailable", exc.message).response()
        async with upstream:
            if upstream.status >= 400:
                return agent_error(upstream.status, await upstream.read(), shown).response()
            response = await connect.open_stream(request)
            error: ConnectError | None = None
            try:
                error = await self._relay(
                    upstream,
                    response,
                    target,
                    home,
                    with_entries,
                    keepalive_seconds(request),
                    until,
                )
            except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                return response  # the caller left: closing the agent's stream ends its watch
            with contextlib.suppress(ConnectionResetError, aiohttp.ClientConnectionResetError):
                await response.write(connect.end_stream(error))
                await response.write_eof()
            return response

    async def _relay(
        self,
        upstream: aiohttp.ClientResponse,
        response: web.StreamResponse,
        target: Target,
        home: str,
        with_entries: bool,
        keepalive: float,
        until: float | None,
    ) -> ConnectError | None:
        """Copy translated events until the end; the error to end the stream with."""
        top: str | None = None
        while True:
            wait = keepalive
            if until is not None:
                wait = min(wait, until - time.monotonic())
                if wait <= 0:
                    return ConnectError("deadline_exceeded", "the watch reached its deadline")
            try:
                async with asyncio.timeout(wait):
                    line = await upstream.content.readuntil(b"\n")
            except TimeoutError:
                if top is not None:
                    await response.write(connect.envelope({"keepalive": {}}))
                continue
            except (aiohttp.ClientError, ValueError) as exc:
                return ConnectError("unavailable", f"the watch stream broke off: {exc}")
            if not line:
                return None if top is not None else ConnectError("unavailable", "the watch ended")
            try:
                event = json.loads(line)
            except ValueError:
                continue
            kind = event.get("type") if isinstance(event, dict) else None
            if kind == "started":
                top = str(event.get("path", "."))
                await response.write(connect.envelope({"start": {}}))
            elif kind == "finished":
                return None
            elif kind == "keepalive":
                await response.write(connect.envelope({"keepalive": {}}))
            elif top is not None:
                for translated in translate(event, top):
                    if with_entries:
                        await add_entry(self.adapter, target, translated, top, home)
                    await response.write(connect.envelope({"filesystem": translated}))
