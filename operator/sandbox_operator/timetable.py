"""When each Sandbox needs its next pass, and the one sleeper per Sandbox that waits for it.

A Sandbox's pass works out when it must look again if nothing happens to the
Sandbox meanwhile (`handlers.sandbox.deadlines`): its idle deadline, the end
of its lease, a patience running out, the agent's next report. The Sandbox's
daemon (main.py) sleeps until then. A pass from any other trigger sets the
time again (earlier or later); a deletion ends the sleep. Nothing wakes
between deadlines: 10,000 Sandboxes that wait for nothing cost no CPU, where a
fixed 30 s timer per Sandbox woke the operator 333 times a second.

A sleep costs one future and one timer handle of the event loop; an entry,
its deadline. Keys are (namespace, Sandbox UID): a namesake created later is
another Sandbox.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

Key = tuple[str, str]


@dataclass
class _Entry:
    due: float  # the event loop's clock
    # Resolved to wake its sleeper: True to look at `due` again, False to stop.
    waiter: asyncio.Future[bool] | None = None


class Timetable:
    """Deadlines by key; `sleep(key)` returns when the key's deadline comes."""

    def __init__(self, default_seconds: float) -> None:
        # How long a sleeper waits when no pass has set a time for its key yet.
        self.default_seconds = default_seconds
        self._entries: dict[Key, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def set(self, key: Key, seconds: float) -> None:
        """The next pass of `key` in `seconds` (0 or less: now), replacing the time
        set before: the pass that calls this has just looked at everything."""
        due = asyncio.get_running_loop().time() + seconds
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = _Entry(due)
            return
        moved_earlier = due < entry.due
        entry.due = due
        if moved_earlier:
            _resolve(entry.waiter, True)
        # A later time needs no wake: the sleeper looks again when its timer fires.

    def sooner(self, key: Key, seconds: float) -> None:
        """The next pass of `key` in `seconds` at the latest (a retry after an
        error): a time set before that is earlier stays."""
        entry = self._entries.get(key)
        if entry is None or asyncio.get_running_loop().time() + seconds < entry.due:
            self.set(key, seconds)

    def due_in(self, key: Key) -> float | None:
        """Seconds until `key`'s next pass (negative: overdue), None if none is set."""
        entry = self._entries.get(key)
        return None if entry is None else entry.due - asyncio.get_running_loop().time()

    def drop(self, key: Key) -> None:
        """Forget `key`; its sleeper returns False."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            _resolve(entry.waiter, False)

    async def sleep(self, key: Key) -> bool:
        """Wait until `key`'s pass is due (True) or `key` is dropped (False). One
        sleeper per key: its Sandbox's daemon."""
        loop = asyncio.get_running_loop()
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(loop.time() + self.default_seconds)
        # Always a turn of the event loop, even when already due: a caller that
        # loops on this must never hold the loop.
        await asyncio.sleep(0)
        if self._entries.get(key) is not entry:
            return False
        while entry.due > loop.time():
            waiter: asyncio.Future[bool] = loop.create_future()
            entry.waiter = waiter
            timer = loop.call_at(entry.due, _resolve, waiter, True)
            try:
                if not await waiter:
                    return False
            finally:
                timer.cancel()
                entry.waiter = None
            if self._entries.get(key) is not entry:
                return False  # dropped and set again while this sleeper was being woken
        return True


def _resolve(waiter: asyncio.Future[bool] | None, value: bool) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(value)
