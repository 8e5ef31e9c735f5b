"""Polled watchers: a directory watch kept by the agent between calls.

A watch stream (GET /v1/files/watch) lives as long as its connection. A
client that cannot hold one open asks for a watcher instead: the same watch
(watch.py, or watchpoll.py where inotify cannot see the sandbox's changes),
kept here under an id, whose changes it fetches when it likes. That is what
E2B's CreateWatcher / GetWatcherEvents / RemoveWatcher need through a gateway
whose replicas keep nothing: any replica passes any call to the one place
that has the watch.

Bounds: at most ``max_watchers`` at once (429 ``too_many_watchers``); each
holds the stream's bounded queue (past ``watch_queue`` changes the rest are
dropped and one ``overflow`` event says how many); a watcher nobody fetched
from for ``idle_seconds`` is closed and forgotten (404 afterwards), so a
client that forgets its watchers does not keep them for ever.

Fetching returns what waits, at once: the changes the kernel has queued by
then are read first (inotify), so a change made before the call is in its
answer. A polling watch (gVisor) reports a change up to one scan interval
late, as its streams do.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from dataclasses import dataclass, field

from . import models
from .errors import Busy, NotFound
from .paths import display
from .watch import Stream, event_of


@dataclass
class _Entry:
    stream: Stream
    created: float
    polled: float = field(default_factory=time.monotonic)


class Watchers:
    def __init__(self, max_watchers: int, idle_seconds: float) -> None:
        self.max_watchers = max_watchers
        self.idle_seconds = idle_seconds
        self.items: dict[str, _Entry] = {}
        self.sweeper: asyncio.Task[None] | None = None

    def check_room(self) -> None:
        self.sweep()
        if len(self.items) >= self.max_watchers:
            raise Busy(
                "too_many_watchers",
                f"{self.max_watchers} watchers are open (SANDBOX_AGENT_MAX_WATCHERS):"
                " remove one first",
            )

    def add(self, stream: Stream) -> models.PolledWatcher:
        """Keep an opened watch stream (``open()`` done) under a new id."""
        self.check_room()  # again: another one may have been added while this one opened
        stream.start()
        ident = "w" + secrets.token_hex(8)
        self.items[ident] = _Entry(stream, time.time())
        if self.sweeper is None or self.sweeper.done():
            self.sweeper = asyncio.get_running_loop().create_task(self._sweep_while_any())
        return self.view(ident, self.items[ident])

    def view(self, ident: str, entry: _Entry) -> models.PolledWatcher:
        s = entry.stream
        return models.PolledWatcher(
            id=ident,
            path=display(s.shown),
            recursive=s.recursive,
            mode=s.mode,
            poll_interval=s.poll_interval,
            created_at=models.rfc3339(entry.created),
            idle_timeout_seconds=self.idle_seconds,
        )

    def list(self) -> models.WatcherList:
        self.sweep()
        return models.WatcherList(watchers=[self.view(i, e) for i, e in self.items.items()])

    def _get(self, ident: str) -> _Entry:
        self.sweep()
        entry = self.items.get(ident)
        if entry is None:
            raise NotFound(
                "watcher_not_found", f"no watcher {ident[:128]} (removed, or idle too long)"
            )
        return entry

    def events(self, ident: str) -> models.WatcherEvents:
        """What the watcher saw since the previous call (at most its queue)."""
        entry = self._get(ident)
        entry.polled = time.monotonic()
        stream = entry.stream
        stream.read_pending()  # what the kernel has queued already: no wait for the loop
        changes = stream.drain(stream.limits.queue + 2)
        return models.WatcherEvents(
            path=display(stream.shown),
            events=[event_of(stream, c) for c in changes],
            finished=stream.ended is not None,
        )

    def remove(self, ident: str) -> None:
        entry = self._get(ident)
        del self.items[ident]
        entry.stream.close()

    def sweep(self) -> None:
        """Close and forget the watchers nobody fetched from for idle_seconds."""
        limit = time.monotonic() - self.idle_seconds
        for ident, entry in list(self.items.items()):
            if entry.polled < limit:
                del self.items[ident]
                entry.stream.close()

    def close(self) -> None:
        for entry in self.items.values():
            entry.stream.close()
        self.items.clear()
        if self.sweeper is not None:
            self.sweeper.cancel()

    async def _sweep_while_any(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            while self.items:
                await asyncio.sleep(min(self.idle_seconds / 4, 30.0))
                self.sweep()
