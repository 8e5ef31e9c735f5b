"""What the async code needs from its I/O world (the sync twin is `_sync_io`)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

sleep = asyncio.sleep
Lock = asyncio.Lock


async def readable(stream: Any, seconds: float | None) -> bool:
    """Whether a read of `stream` may start: at once, here, since the read
    itself waits (with its timeout) and sends of other tasks go on meanwhile."""
    return True


def reading(lock: asyncio.Lock) -> contextlib.nullcontext[None]:
    """What a read of a WebSocket holds: nothing. One event loop runs both
    directions, and each call into the TLS object finishes before another
    starts (the sync twin holds the connection's lock)."""
    return contextlib.nullcontext()


def interrupt(stream: Any) -> None:
    """Nothing to do: closing the stream ends a read waiting in another task."""
