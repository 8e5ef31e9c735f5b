"""What the async code needs from its I/O world (the sync twin is `_sync_io`)."""

from __future__ import annotations

import asyncio

sleep = asyncio.sleep
