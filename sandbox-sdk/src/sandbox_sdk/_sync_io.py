"""What the sync code needs from its I/O world (the async twin is `_async_io`)."""

from __future__ import annotations

import time

sleep = time.sleep
