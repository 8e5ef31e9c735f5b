"""The mount table of this process (/proc/self/mountinfo), read one way.

Cleanup of a cluster must find every mount below its state dir (container
root filesystems, pod volumes, netns files, CSI bind mounts) and unmount it
before anything is removed: `rmtree` through a mount point would reach into
another filesystem. A mount point the reader cannot decode is a mount the
cleanup misses, so paths are decoded exactly as the kernel encodes them:
it writes the path's bytes as they are, except space, tab, newline and
backslash, which become octal escapes (\\040, \\011, \\012, \\134). Names in
any other encoding (UTF-8 or not) come back as the same bytes, decoded the
way Python decodes file names (`os.fsdecode`, surrogateescape), so the path
reaches the file system again unchanged.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
_OCTAL_ESCAPE = re.compile(rb"\\([0-7]{3})")
# umount2(2) flag: detach now, release once the last user is gone.
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo (proc(5)): the fields cleanup and tests use."""

    mount_point: Path
    root: Path
    """The path inside the mounted filesystem that is mounted (bind mounts)."""
    fstype: str
    source: str
    options: str
    """Per-mount options (rw, relatime, ...)."""
    super_options: str
    """Per-filesystem options; for a cgroup v1 hierarchy, its controllers."""


def unescape(field: bytes) -> str:
    """A path field of mountinfo as a file name (octal escapes undone, bytes
    kept; non-UTF-8 bytes survive as surrogates, like os.listdir's)."""
    raw = _OCTAL_ESCAPE.sub(lambda match: bytes([int(match.group(1), 8)]), field)
    return os.fsdecode(raw)


def parse(text: bytes) -> list[Mount]:
    """The entries of a mountinfo file's content. Read as bytes: a single
    non-UTF-8 mount point anywhere on the machine must not break the reader."""
    found = []
    for line in text.splitlines():
        # Fields are separated by single spaces (a space inside a path is
        # escaped); optional fields end at the lone "-".
        fields = line.split(b" ")
        try:
            separator = fields.index(b"-", 6)
        except ValueError:
            continue
        if len(fields) < separator + 3:
            continue
        found.append(
            Mount(
                mount_point=Path(unescape(fields[4])),
                root=Path(unescape(fields[3])),
                fstype=os.fsdecode(fields[separator + 1]),
                source=unescape(fields[separator + 2]),
                options=os.fsdecode(fields[5]),
                super_options=os.fsdecode(fields[separator + 3])
                if len(fields) > separator + 3
                else "",
            )
        )
    return found


def mounts() -> list[Mount]:
    """The current mount table of this process's mount namespace."""
    return parse(MOUNTINFO.read_bytes())


def mount_points_under(root: Path, *, include_root: bool = True) -> list[Path]:
    """Mount points at or below `root` (or only below it), deepest first, each
    once. The kernel reports real paths, so `root` is resolved first (a state
    dir reached through a symlink still finds its mounts); the paths returned
    are the kernel's."""
    base = root.resolve()
    found = {
        mount.mount_point
        for mount in mounts()
        if mount.mount_point.is_relative_to(base) and (include_root or mount.mount_point != base)
    }
    return sorted(found, key=lambda point: len(point.parts), reverse=True)


def unmount(point: Path) -> None:
    """Lazy unmount (MNT_DETACH), repeated for mounts stacked on one point: a
    mount still busy is detached now and released once its last user is
    gone; either way it is off our tree. Quiet when nothing is mounted there."""
    for _ in range(5):
        if _libc.umount2(os.fsencode(point), _MNT_DETACH) != 0:
            return


def cgroup_hierarchies() -> list[Path]:
    """Mount points of the cgroup v1 hierarchies (cpu, memory, pids, ...,
    name=systemd)."""
    return [mount.mount_point for mount in mounts() if mount.fstype == "cgroup"]


def cgroup_hierarchy(controller: str) -> Path | None:
    """The mount point of the cgroup v1 hierarchy with `controller` (e.g.
    "pids"), None when that controller is not mounted."""
    for mount in mounts():
        if mount.fstype == "cgroup" and controller in mount.super_options.split(","):
            return mount.mount_point
    return None
