"""The one mount-table reader (devcluster/mounts.py) against real mounts.

Cleanup finds what to unmount below a cluster's state dir through this
reader; a mount point it decodes wrongly is one it leaves behind, and then
the state dir cannot be removed safely. The kernel escapes space, tab,
newline and backslash in mountinfo as octal and writes every other byte as
it is, UTF-8 or not: each kind gets a tmpfs of its own here. Needs root
(mount(2)), like the node tier.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster import mounts

NAMES = {
    "space": "with space",
    "tab": "with\ttab",
    "newline": "with\nnewline",
    "backslash": "back\\slash",
    "utf-8": "naïve-Übung-名前",
    # Not UTF-8: a Latin-1 "ä" (one byte, 0xE4), as os.listdir would return it.
    "latin-1": os.fsdecode(b"l\xe4tin"),
    "all at once": "ä b\\c\td",
}


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """A tmpfs on a directory of each awkward name, below tmp_path."""
    points: dict[str, Path] = {}
    try:
        for kind, name in NAMES.items():
            point = tmp_path / name
            point.mkdir()
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=64k", "devcluster-test", os.fsencode(point)],
                check=True,
                capture_output=True,
            )
            points[kind] = point
        yield points
    finally:
        for point in points.values():
            subprocess.run(["umount", os.fsencode(point)], check=False, capture_output=True)


def test_mount_points_with_escaped_and_non_ascii_names_are_found_as_they_are(
    tmp_path: Path, mounted: dict[str, Path]
) -> None:
    found = mounts.mount_points_under(tmp_path)
    assert sorted(found) == sorted(mounted.values())
    # Each decoded path reaches the very mount again: the mounted tmpfs, not
    # the directory underneath it.
    for kind, point in mounted.items():
        assert os.path.ismount(point), kind
        (point / "probe").write_text(kind)
    entries = {mount.mount_point: mount for mount in mounts.mounts()}
    for point in mounted.values():
        assert entries[point].fstype == "tmpfs"
        assert entries[point].source == "devcluster-test"


def test_include_root_and_depth_order(tmp_path: Path, mounted: dict[str, Path]) -> None:
    outer = mounted["space"]
    inner = outer / "inner dir"
    inner.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "devcluster-test", str(inner)],
        check=True,
        capture_output=True,
    )
    try:
        assert mounts.mount_points_under(outer) == [inner, outer]
        assert mounts.mount_points_under(outer, include_root=False) == [inner]
        # Reached through a symlink: the kernel reports the real path.
        link = tmp_path / "link"
        link.symlink_to(outer)
        assert mounts.mount_points_under(link) == [inner, outer]
    finally:
        mounts.unmount(inner)
    assert mounts.mount_points_under(outer) == [outer]


def test_unmount_takes_any_name_off(tmp_path: Path, mounted: dict[str, Path]) -> None:
    for point in mounted.values():
        mounts.unmount(point)
    assert mounts.mount_points_under(tmp_path) == []


def test_parse_undoes_each_kernel_escape() -> None:
    line = (
        rb"99 23 0:50 /sub\040dir /a\040b\011c\012d\134e\303\244 rw,relatime shared:5"
        rb" - tmpfs my\040src rw,size=64k"
    )
    (entry,) = mounts.parse(line + b"\n")
    assert entry.mount_point == Path("/a b\tc\nd\\eä")
    assert entry.root == Path("/sub dir")
    assert (entry.fstype, entry.source, entry.super_options) == ("tmpfs", "my src", "rw,size=64k")


def test_cgroup_hierarchies_include_pids() -> None:
    # The per-pod PID limit of the node tier needs this controller.
    pids = mounts.cgroup_hierarchy("pids")
    assert pids is not None, "the pids cgroup controller is not mounted on this host"
    assert pids in mounts.cgroup_hierarchies()
    assert (pids / "cgroup.procs").exists()
