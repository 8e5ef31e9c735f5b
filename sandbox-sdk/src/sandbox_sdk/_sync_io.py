"""What the sync code needs from its I/O world (the async twin is `_async_io`)."""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from typing import Any

sleep = time.sleep
Lock = threading.Lock


def readable(stream: Any, seconds: float | None) -> bool:
    """Whether bytes wait on `stream` (an httpcore network stream), waiting up
    to `seconds` for some. A sync read holds the connection's lock (a
    TLS connection must not read and write at once), so it starts only when it
    will not block, and a send from another thread is not held up by a
    receiver waiting for output."""
    sock = stream.get_extra_info("socket")
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True  # decrypted already: the socket itself has nothing to say
    try:
        ready, _, _ = select.select([sock], [], [], seconds)
    except (OSError, ValueError):
        return True  # closed under us: the read says so
    return bool(ready)


def reading(lock: threading.Lock) -> threading.Lock:
    """What a read of a WebSocket holds: the connection's lock (see `readable`)."""
    return lock


def interrupt(stream: Any) -> None:
    """Wake a thread waiting in `readable` on `stream` (closing a descriptor
    does not wake a select() on it; shutting the socket down does). The plain
    socket's shutdown, also under TLS: the TLS object stays as it is for a
    read that is under way."""
    sock = stream.get_extra_info("socket")
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):  # not connected any more
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
