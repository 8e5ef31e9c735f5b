"""Linux inotify through libc (ctypes): the three calls and the event record.

No third-party binding: the agent needs four system calls and one struct.
Watches are added by descriptor (``/proc/self/fd/N`` of a directory the
caller opened with ``O_NOFOLLOW``), so what is watched is the directory that
was walked to, never what a path names a moment later.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Iterator
from typing import NamedTuple

# <sys/inotify.h>
IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of NUL-padded name)

_libc = ctypes.CDLL(None, use_errno=True)
_init1 = _libc.inotify_init1
_init1.argtypes = [ctypes.c_int]
_init1.restype = ctypes.c_int
_add = _libc.inotify_add_watch
_add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_add.restype = ctypes.c_int
_rm = _libc.inotify_rm_watch
_rm.argtypes = [ctypes.c_int, ctypes.c_int]
_rm.restype = ctypes.c_int


class Event(NamedTuple):
    wd: int
    mask: int
    cookie: int
    name: bytes  # b"" for an event about the watched directory itself


def _raise() -> None:
    errno = ctypes.get_errno()
    raise OSError(errno, os.strerror(errno))


def init() -> int:
    """A new non-blocking, close-on-exec inotify descriptor."""
    fd = int(_init1(IN_NONBLOCK | IN_CLOEXEC))
    if fd < 0:
        _raise()
    return fd


def add_watch(fd: int, dir_fd: int, mask: int) -> int:
    """Watch the directory open as ``dir_fd`` (any descriptor of it, O_PATH too).

    ``/proc/self/fd/N`` is resolved by the kernel to the open file itself, not
    by name, so a rename or a symlink swapped in meanwhile changes nothing.
    Returns the watch descriptor (the same one again for a directory already
    watched through ``fd``)."""
    wd = int(_add(fd, f"/proc/self/fd/{dir_fd}".encode(), mask | IN_ONLYDIR))
    if wd < 0:
        _raise()
    return wd


def rm_watch(fd: int, wd: int) -> None:
    """Stop a watch; a watch the kernel already dropped (EINVAL) is no error."""
    if _rm(fd, wd) < 0 and ctypes.get_errno() != 22:
        _raise()


def parse(buf: bytes) -> Iterator[Event]:
    """The events of one read(2) of an inotify descriptor (the kernel never
    splits an event across reads)."""
    pos, end = 0, len(buf)
    size = _HEADER.size
    while pos + size <= end:
        wd, mask, cookie, length = _HEADER.unpack_from(buf, pos)
        pos += size
        name = buf[pos : pos + length].rstrip(b"\0")
        pos += length
        yield Event(wd, mask, cookie, name)
