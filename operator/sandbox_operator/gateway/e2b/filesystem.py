"""E2B's `filesystem.Filesystem` service (Connect RPC, JSON codec) on the agent's files API.

    Stat                      GET  files/stat
    ListDir (depth)           GET  files/list (depth, hidden files)
    MakeDir                   POST files/mkdir (parents; an existing one: already_exists)
    Move                      POST files/move (overwrite, parents: as rename(2) and envd)
    Remove                    POST files/remove (recursive; a missing path is no error)
    WatchDir (server stream)  GET  files/watch, its events translated one by one
    CreateWatcher,            POST files/watchers, GET files/watchers/{id}/events,
    GetWatcherEvents,         DELETE files/watchers/{id}: polled watchers live in
    RemoveWatcher             the agent, so any gateway replica serves any call

Paths and users: paths.py. Entries (EntryInfo) in proto3 JSON: camelCase,
int64 as a string, enum names, Timestamp as RFC 3339. Events: watch.py.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Awaitable, Callable
from urllib.parse import quote

from aiohttp import web

from sandbox_operator.gateway.e2b import connect, core, paths, watch
from sandbox_operator.gateway.e2b.connect import ConnectError
from sandbox_operator.gateway.e2b.core import Adapter, Endpoint, Target
from sandbox_operator.gateway.e2b.entries import (
    JSON,
    agent_json,
    entries,
    field,
    path_field,
    tree_order,
    user_of,
)

SERVICE = "/filesystem\\.Filesystem/"
MAX_DEPTH = 64  # the agent's own bound on a listing's depth
# The agent's ids of polled watchers (its route table's id pattern); `.e` marks
# a watcher whose events carry entries (include_entry): a flag kept in the id,
# because the gateway keeps nothing between calls.
WATCHER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,100}(\.e)?")
_ENTRY_SUFFIX = ".e"

Handler = Callable[[Target, JSON, str], Awaitable[JSON]]


class Filesystem:
    """The Connect service, one method an endpoint."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter

    def endpoints(self) -> list[Endpoint]:
        unary: dict[str, Handler] = {
            "Stat": self.stat,
            "ListDir": self.list_dir,
            "MakeDir": self.make_dir,
            "Move": self.move,
            "Remove": self.remove,
            "CreateWatcher": self.create_watcher,
            "GetWatcherEvents": self.get_watcher_events,
            "RemoveWatcher": self.remove_watcher,
        }
        found = [
            Endpoint(core.ENVD_PORT, "POST", SERVICE + name, self._unary(handler))
            for name, handler in unary.items()
        ]
        watcher = watch.WatchDir(self.adapter)
        found.append(Endpoint(core.ENVD_PORT, "POST", SERVICE + "WatchDir", watcher.serve))
        return found

    @staticmethod
    def _unary(
        handler: Handler,
    ) -> Callable[[web.Request, Target, dict[str, str]], Awaitable[web.StreamResponse]]:
        async def serve(
            request: web.Request, target: Target, params: dict[str, str]
        ) -> web.StreamResponse:
            try:
                message, streaming = await connect.read_request(request)
                if streaming:
                    raise ConnectError("invalid_argument", "a unary call: send application/json")
                user_of(request)
                return connect.unary(await handler(target, message, target.route.workspace))
            except ConnectError as exc:
                return exc.response()

        return serve

    async def _stat(self, target: Target, rel: str, shown: str) -> JSON:
        info = await agent_json(
            self.adapter, target, "GET", "files/stat", shown, params={"path": rel}
        )
        return (await entries(self.adapter, target, [(info, shown)]))[0]

    async def stat(self, target: Target, message: JSON, home: str) -> JSON:
        rel, shown = path_field(message, "path", home)
        return {"entry": await self._stat(target, rel, shown)}

    async def list_dir(self, target: Target, message: JSON, home: str) -> JSON:
        rel, shown = path_field(message, "path", home)
        depth = min(max(field(message, "depth", int, 0), 1), MAX_DEPTH)
        params = {"path": rel, "depth": str(depth), "hidden": "true"}
        listing = await agent_json(self.adapter, target, "GET", "files/list", shown, params=params)
        top = str(listing.get("path", rel))
        found = []
        for info in listing.get("entries") or []:
            inside = paths.below(str(info.get("path", "")), top)
            if inside is not None:
                found.append((info, posixpath.join(shown, inside)))
        described = await entries(self.adapter, target, found)
        described.sort(key=tree_order)
        return {"entries": described}

    async def make_dir(self, target: Target, message: JSON, home: str) -> JSON:
        rel, shown = path_field(message, "path", home)
        if rel == ".":
            raise ConnectError("already_exists", f"directory already exists: {shown}")
        body = {"path": rel, "parents": True, "existOk": False}
        try:
            info = await agent_json(self.adapter, target, "POST", "files/mkdir", shown, body=body)
        except ConnectError as exc:
            if exc.code == "already_exists":
                # As envd: a directory there is already_exists, anything else is in the way.
                existing = await self._stat(target, rel, shown)
                if existing["type"] != "FILE_TYPE_DIRECTORY":
                    raise ConnectError(
                        "invalid_argument",
                        f"path already exists but it is not a directory: {shown}",
                    ) from None
                raise ConnectError("already_exists", f"directory already exists: {shown}") from None
            raise
        return {"entry": (await entries(self.adapter, target, [(info, shown)]))[0]}

    async def move(self, target: Target, message: JSON, home: str) -> JSON:
        source, source_shown = path_field(message, "source", home)
        destination, shown = path_field(message, "destination", home)
        body = {"source": source, "destination": destination, "overwrite": True, "parents": True}
        info = await agent_json(self.adapter, target, "POST", "files/move", source_shown, body=body)
        return {"entry": (await entries(self.adapter, target, [(info, shown)]))[0]}

    async def remove(self, target: Target, message: JSON, home: str) -> JSON:
        rel, shown = path_field(message, "path", home)
        body = {"path": rel, "recursive": True, "missingOk": True}
        await agent_json(self.adapter, target, "POST", "files/remove", shown, body=body)
        return {}

    # -- polled watchers (their state is the agent's) ---------------------------------

    async def create_watcher(self, target: Target, message: JSON, home: str) -> JSON:
        rel, shown = path_field(message, "path", home)
        recursive = field(message, "recursive", bool, False)
        with_entries = field(message, "includeEntry", bool, False)
        field(message, "allowNetworkMounts", bool, False)  # checked; nothing to allow here
        body = {"path": rel, "recursive": recursive}
        try:
            made = await agent_json(
                self.adapter, target, "POST", "files/watchers", shown, body=body
            )
        except ConnectError as exc:
            if exc.code == "not_found":
                await self._stat(target, rel, shown)  # not_found when the directory is missing
                # It is there: the agent is older than its polled watchers.
                raise ConnectError(
                    "unimplemented",
                    "this sandbox's agent keeps no watchers (an image older than the adapter):"
                    " watch with AsyncSandbox.files.watch_dir (a stream) instead",
                ) from None
            raise
        return {"watcherId": str(made["id"]) + (_ENTRY_SUFFIX if with_entries else "")}

    def _watcher(self, message: JSON) -> tuple[str, bool]:
        given = field(message, "watcherId", str, "")
        if not WATCHER_ID.fullmatch(given):
            raise ConnectError("not_found", f"watcher {given[:100]!r} not found")
        with_entries = given.endswith(_ENTRY_SUFFIX)
        return (given[: -len(_ENTRY_SUFFIX)] if with_entries else given), with_entries

    async def get_watcher_events(self, target: Target, message: JSON, home: str) -> JSON:
        ident, with_entries = self._watcher(message)
        # The agent's message names the watcher (shown: nothing to add).
        found = await agent_json(
            self.adapter, target, "GET", f"files/watchers/{quote(ident)}/events", ""
        )
        top = str(found.get("path", "."))
        translated: list[JSON] = []
        for event in found.get("events") or []:
            translated.extend(watch.translate(event, top))
        if with_entries:
            for event in translated:
                await watch.add_entry(self.adapter, target, event, top, home)
        return {"events": translated}

    async def remove_watcher(self, target: Target, message: JSON, home: str) -> JSON:
        ident, _ = self._watcher(message)
        await agent_json(self.adapter, target, "DELETE", f"files/watchers/{quote(ident)}", "")
        return {}
