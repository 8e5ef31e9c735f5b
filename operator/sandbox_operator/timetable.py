"""When each Sandbox needs its next pass, and the one clock that runs the passes.

A Sandbox's pass works out when it must look again if nothing happens to the
Sandbox meanwhile (`handlers.sandbox.deadlines`): its idle deadline, the end
of its lease, a patience running out, the agent's next report. A pass from
any other trigger sets the time again (earlier or later); a deletion drops
it. One task (`Timetable.run`) sleeps until the earliest time and starts the
passes that are due, each in a task of its own that ends with the pass.

Nothing wakes between deadlines, and a Sandbox that waits costs a dictionary
entry and a heap entry, not a task: a Kopf daemon per Sandbox (the design
before this one) kept about 12 KiB of task, frames and records per Sandbox
for as long as it existed (a tracemalloc census at 1,500 Sandboxes), where a
fixed 30 s timer per Sandbox (the one before that) woke the operator 333
times a second at 10,000.

The clock stops starting passes while the operator is paused by peering (a
replica of higher priority is active: its passes would race this one's) and
goes on where it stopped when the pause ends, for the Sandboxes that still
exist: a key from before the pause has its pass only once an event of the
Sandbox has confirmed it (`ensure`: Kopf lists every object again after a
pause). Kopf sends no event for an object deleted while its watch was
closed, so a key that no event confirms within `default_seconds` of the end
of the pause is dropped. Keys are (namespace, name, UID): a namesake
created later is another Sandbox.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Protocol

Key = tuple[str, str, str]  # namespace, name, UID
Pass = Callable[[Key], Awaitable[None]]

logger = logging.getLogger(__name__)


class Pause(Protocol):
    """Whether the operator is paused (Kopf's toggle set of peering conflicts)."""

    def is_on(self) -> bool: ...

    async def wait_for(self, state: bool, /) -> None: ...


class Timetable:
    """Deadlines by key, and the clock (`run`) that starts each key's pass when
    its deadline comes: never two passes of one key at a time."""

    def __init__(self, default_seconds: float, retry_seconds: float) -> None:
        # When a key first seen (`ensure`) has its first pass, unless one sets a time.
        self.default_seconds = default_seconds
        # When a pass that raised is tried again.
        self.retry_seconds = retry_seconds
        self._due: dict[Key, float] = {}  # the event loop's clock
        # (due, key), one for every time set; those whose due is no longer the
        # key's are skipped when they come up (cheaper than removing them).
        self._heap: list[tuple[float, Key]] = []
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        # Keys from before a pause that no event has shown since; dropped at
        # `_confirm_by` (the event loop's clock) if none has by then.
        self._unconfirmed: set[Key] = set()
        self._confirm_by: float | None = None

    def __len__(self) -> int:
        return len(self._due)

    def set(self, key: Key, seconds: float) -> None:
        """The next pass of `key` in `seconds` (0 or less: now), replacing the time
        set before: the pass that calls this has just looked at everything."""
        due = asyncio.get_running_loop().time() + seconds
        self._due[key] = due
        self._unconfirmed.discard(key)  # a pass or an event of it: it exists
        heapq.heappush(self._heap, (due, key))
        if self._heap[0][1] == key and self._heap[0][0] == due:
            self._wake.set()  # the earliest now: the clock sleeps until a later time
        elif len(self._heap) > 2 * len(self._due) + 1024:
            self._compact()

    def ensure(self, key: Key) -> None:
        """A time for `key` if it has none: a Sandbox that no pass has seen yet
        is looked at within `default_seconds` all the same. Called for every
        event of a Sandbox, it also confirms, after a pause, that the Sandbox
        still exists: its time from before the pause stands."""
        if key not in self._due:
            self.set(key, self.default_seconds)
        elif key in self._unconfirmed:  # its time from before the pause, now confirmed
            self.set(key, self._due[key] - asyncio.get_running_loop().time())

    def sooner(self, key: Key, seconds: float) -> None:
        """The next pass of `key` in `seconds` at the latest (a retry after an
        error): a time set before that is earlier stays."""
        due = self._due.get(key)
        if due is None or asyncio.get_running_loop().time() + seconds < due:
            self.set(key, seconds)

    def due_in(self, key: Key) -> float | None:
        """Seconds until `key`'s next pass (negative: overdue), None if none is set."""
        due = self._due.get(key)
        return None if due is None else due - asyncio.get_running_loop().time()

    def drop(self, key: Key) -> None:
        """Forget `key`: no pass of it starts any more (one in flight goes on;
        see `settle`)."""
        self._due.pop(key, None)
        self._unconfirmed.discard(key)

    async def settle(self, key: Key, patience: float) -> None:
        """Wait for `key`'s pass in flight, if any; cancel it after `patience` seconds.
        A deletion waits for it before the finalizer goes, as Kopf waits for a
        daemon: the pass may be writing to the Sandbox's children."""
        task = self._running.get(key)
        if task is None:
            return
        done, _ = await asyncio.wait({task}, timeout=patience)
        if not done:
            task.cancel()
            await asyncio.wait({task})

    async def run(self, run_pass: Pass, pause: Pause | None = None) -> None:
        """The clock: start each key's pass when its time comes, until cancelled.
        While `pause` is on, no pass starts (those in flight finish)."""
        loop = asyncio.get_running_loop()
        follower = asyncio.create_task(self._follow(pause)) if pause is not None else None
        try:
            while True:
                if pause is not None and pause.is_on():
                    await pause.wait_for(False)
                self._wake.clear()
                now = loop.time()
                if self._confirm_by is not None and self._confirm_by <= now:
                    self._forget_unconfirmed()
                while self._heap and self._heap[0][0] <= now:
                    due, key = heapq.heappop(self._heap)
                    if self._due.get(key) != due or key in self._running:
                        continue  # moved; or pushed again when its pass in flight ends
                    if key in self._unconfirmed:
                        continue  # held until an event shows it (ensure)
                    self._start(key, run_pass)
                times = [self._heap[0][0]] if self._heap else []
                times += [self._confirm_by] if self._confirm_by is not None else []
                wait = min(times) - now if times else None
                with suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()
        finally:
            if follower is not None:
                follower.cancel()
                await asyncio.wait({follower})
            for task in list(self._running.values()):
                task.cancel()
            if self._running:
                await asyncio.wait(set(self._running.values()))

    async def _follow(self, pause: Pause) -> None:
        """Mark the keys of the moment a pause begins as unconfirmed (the watches
        close then: what happens to those Sandboxes meanwhile is not seen), and
        give them until `default_seconds` after it ends to be confirmed."""
        loop = asyncio.get_running_loop()
        while True:
            await pause.wait_for(True)
            logger.info("paused by peering: no Sandbox's pass starts until the pause ends")
            self._unconfirmed.update(self._due)
            await pause.wait_for(False)
            self._confirm_by = loop.time() + self.default_seconds
            self._wake.set()

    def _start(self, key: Key, run_pass: Pass) -> None:
        # Its time is used up: a pass that sets none is the next in `default_seconds`.
        self.set(key, self.default_seconds)
        task = asyncio.create_task(self._guarded(key, run_pass), name=f"pass of {key[0]}/{key[1]}")
        self._running[key] = task
        task.add_done_callback(lambda _: self._ended(key))

    async def _guarded(self, key: Key, run_pass: Pass) -> None:
        try:
            await run_pass(key)
        except Exception:
            # The pass reports what it can in status; what it could not is
            # logged here, and the clock goes on with the other keys.
            logger.exception("the pass of Sandbox %s/%s failed", key[0], key[1])
            self.sooner(key, self.retry_seconds)

    def _ended(self, key: Key) -> None:
        self._running.pop(key, None)
        due = self._due.get(key)
        if due is not None:
            # Its time may have come while it ran (another trigger set it).
            heapq.heappush(self._heap, (due, key))
            self._wake.set()

    def _forget_unconfirmed(self) -> None:
        if self._unconfirmed:
            logger.info(
                "%d Sandboxes not seen since the pause ended: gone meanwhile; their times dropped",
                len(self._unconfirmed),
            )
        for key in self._unconfirmed:
            self._due.pop(key, None)
        self._unconfirmed.clear()
        self._confirm_by = None

    def _compact(self) -> None:
        self._heap = [(due, key) for key, due in self._due.items()]
        heapq.heapify(self._heap)
