"""Directory watches by polling (watchpoll.py): where inotify cannot see the
sandbox container's changes (gVisor), scans compared. The pure parts (the
mount table, the comparison of two scans) on their own; then a real agent
with SANDBOX_AGENT_WATCH_MODE=poll on this machine's filesystem. Under gVisor
itself: tests/e2e/test_watch_e2e.py."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from conftest import Sandbox, wait_until
from test_watch import Watch

from sandbox_agent.watch import Change
from sandbox_agent.watchpoll import Entry, Snapshot, diff, mount_type

# /proc/self/mountinfo of an agent container under gVisor (runsc, 2023-09), as
# read on the local node: every volume a 9p (gofer) mount of its own.
GVISOR = """\
20 19 0:19 / / ro  - 9p none ro,trans=fd,rfdno=51,wfdno=51,aname=/,cache=fscache,directfs
21 20 0:20 / /tmp rw  - 9p none rw,trans=fd,rfdno=53,wfdno=53,cache=remote_revalidating
28 20 0:24 / /workspace rw  - 9p none rw,trans=fd,rfdno=52,wfdno=52,cache=remote_revalidating
29 20 0:25 / /sandbox/run rw  - 9p none rw,trans=fd,rfdno=54,wfdno=54,cache=remote_revalidating
"""
# The same under runc: the host kernel's mounts.
RUNC = """\
1130 1011 0:88 / / ro,relatime master:501 - overlay overlay rw,lowerdir=/l,upperdir=/u
1140 1130 259:1 /var/lib/kubelet/pods/x/volumes/kubernetes.io~csi/pvc/mount /workspace rw,\
relatime - ext4 /dev/nvme0n1p1 rw
1141 1130 0:95 / /sandbox/run rw,relatime - tmpfs tmpfs rw
1150 1140 0:99 / /workspace/with\\040space rw - tmpfs tmpfs rw
"""


def test_the_workspace_filesystem_is_read_from_the_mount_table() -> None:
    assert mount_type(GVISOR, "/workspace") == "9p"
    assert mount_type(GVISOR, "/workspace/src/app") == "9p"
    assert mount_type(RUNC, "/workspace") == "ext4"
    assert mount_type(RUNC, "/workspacefoo") == "overlay"  # a prefix is not a parent
    assert mount_type(RUNC, "/workspace/with space/x") == "tmpfs"  # octal escapes
    # Several mounts on one point: the last one mounted is what the path shows.
    stacked = RUNC + "1160 1130 0:100 / /workspace rw - 9p none rw\n"
    assert mount_type(stacked, "/workspace/a") == "9p"
    assert mount_type("", "/workspace") is None


def entry(ino: int, *, d: bool = False, mtime: int = 1, size: int = 0, mode: int = 0o644) -> Entry:
    return Entry(ino, d, (mtime, size), (mode, 1000, 1000))


ROOT = entry(1, d=True, mode=0o755)


def changes(old: Snapshot, new: Snapshot) -> list[tuple[str, ...]]:
    def shown(c: Change) -> tuple[str, ...]:
        return (c.kind, c.path) if c.old is None else (c.kind, c.path, c.old)

    return [shown(c) for c in diff({"": ROOT, **old}, {"": ROOT, **new}, 0.0)]


def test_each_kind_of_change_between_two_scans() -> None:
    a = entry(10, size=4)
    assert changes({}, {"a": entry(10)}) == [("create", "a")]
    # Made with content: the client has something to read.
    assert changes({}, {"a": a}) == [("create", "a"), ("write", "a")]
    assert changes({"a": a}, {"a": entry(10, size=9, mtime=2)}) == [("write", "a")]
    assert changes({"a": a}, {"a": entry(10, size=4, mtime=2)}) == [("write", "a")]  # touch
    assert changes({"a": a}, {"a": entry(10, size=4, mode=0o600)}) == [("chmod", "a")]
    assert changes({"a": a}, {"b": a}) == [("rename", "b", "a")]
    assert changes({"a": a}, {}) == [("remove", "a")]
    assert changes({"a": a}, {"a": a}) == []
    # An inode reused by a file made under another name reads as a rename, and
    # its different content as a write: the client ends up right either way.
    assert changes({"a": a}, {"b": entry(10, size=1, mtime=5)}) == [
        ("rename", "b", "a"),
        ("write", "b"),
    ]
    # The watched directory's own mode.
    new_root = {"": entry(1, d=True, mode=0o700)}
    assert [(c.kind, c.path) for c in diff({"": ROOT}, new_root, 0.0)] == [("chmod", "")]


def test_replacements_and_renames_over_a_name() -> None:
    a, b = entry(10, size=4), entry(11, size=5)
    # Written elsewhere and renamed over it (an atomic write) unseen: a write.
    assert changes({"a": a}, {"a": b}) == [("write", "a")]
    # Renamed over an existing file: the rename only (as inotify tells it).
    assert changes({"a": a, "b": b}, {"b": a}) == [("rename", "b", "a")]
    # Two names swapped.
    assert changes({"a": a, "b": b}, {"a": b, "b": a}) == [
        ("rename", "a", "b"),
        ("rename", "b", "a"),
    ]
    # A file replaced by a directory of the same name.
    assert changes({"a": a}, {"a": entry(12, d=True)}) == [("remove", "a"), ("create", "a")]


def test_trees_move_as_one_and_go_deepest_first() -> None:
    tree = {
        "d": entry(20, d=True),
        "d/e": entry(21, d=True),
        "d/e/f.txt": entry(22, size=3),
        "d/g.txt": entry(23),
    }
    moved = {p.replace("d", "m", 1): e for p, e in tree.items()}
    # One rename for the directory: what it holds moved with it.
    assert changes(tree, moved) == [("rename", "m", "d")]
    # ...unless it changed meanwhile, or was renamed inside it too.
    moved["m/e/f.txt"] = entry(22, size=8, mtime=3)
    moved["m/h.txt"] = moved.pop("m/g.txt")
    assert changes(tree, moved) == [
        ("rename", "m", "d"),
        ("rename", "m/h.txt", "d/g.txt"),
        ("write", "m/e/f.txt"),
    ]
    # Removed (or moved out of the watch): each entry, deepest first.
    assert changes(tree, {}) == [
        ("remove", "d/e/f.txt"),
        ("remove", "d/e"),
        ("remove", "d/g.txt"),
        ("remove", "d"),
    ]
    # Appeared (made, or moved in): shallowest first, files with content written.
    assert changes({}, tree) == [
        ("create", "d"),
        ("create", "d/e"),
        ("create", "d/g.txt"),
        ("create", "d/e/f.txt"),
        ("write", "d/e/f.txt"),
    ]


def test_a_polled_watch_sees_each_kind_of_change(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(runner=False, watch_mode="poll", watch_poll_interval=0.05)
    ws = sb.workspace
    (ws / "w").mkdir()
    (ws / "w/old.txt").write_text("before the watch\n")
    with Watch(sb, "w", recursive=True) as w:
        started = w.started
        assert (started["mode"], started["pollInterval"], started["watches"]) == ("poll", 0.05, 1)
        # What was there at the start is the baseline, not news.
        w.quiet(0.3)
        (ws / "w/a.txt").write_text("one\n")
        assert w.changes(2) == [("create", "w/a.txt"), ("write", "w/a.txt")]
        with (ws / "w/a.txt").open("a") as f:
            f.write("two\n")
        assert w.changes(1) == [("write", "w/a.txt")]
        os.chmod(ws / "w/a.txt", 0o600)
        assert w.changes(1) == [("chmod", "w/a.txt")]
        os.rename(ws / "w/a.txt", ws / "w/b.txt")
        renamed = w.next()
        assert renamed is not None
        assert (renamed["type"], renamed["path"], renamed["oldPath"], renamed["move"]) == (
            "rename",
            "w/b.txt",
            "w/a.txt",
            "within",
        )
        (ws / "w/b.txt").unlink()
        assert w.changes(1) == [("remove", "w/b.txt")]
        # A new directory is scanned too (recursive), and a file in it seen.
        (ws / "w/sub").mkdir()
        assert w.changes(1) == [("create", "w/sub")]
        (ws / "w/sub/deep.txt").touch()
        assert w.changes(1) == [("create", "w/sub/deep.txt")]
        # The watched directory removed: what it held, itself, and the end.
        (ws / "w/sub/deep.txt").unlink()
        (ws / "w/old.txt").unlink()
        (ws / "w/sub").rmdir()
        (ws / "w").rmdir()
        seen = []
        while (event := w.next()) is not None:
            seen.append((event["type"], event.get("path", "")))
        assert seen[-2:] == [("remove", "w"), ("finished", "")], seen
        assert set(seen[:-2]) <= {
            ("remove", "w/sub/deep.txt"),
            ("remove", "w/old.txt"),
            ("remove", "w/sub"),
        }, seen


def test_a_polled_watch_ends_when_its_directory_moves(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(runner=False, watch_mode="poll", watch_poll_interval=0.05)
    (sb.workspace / "here").mkdir()
    (sb.workspace / "here/kept.txt").touch()  # an empty one may read as removed
    with Watch(sb, "here") as w:
        os.rename(sb.workspace / "here", sb.workspace / "there")
        end = w.next()
        assert end is not None and (end["type"], end["reason"]) == ("finished", "moved")
        assert w.next() is None


def test_polling_limits_refuse_at_the_start_and_overflow_later(
    fresh: Callable[..., Sandbox],
) -> None:
    sb = fresh(runner=False, watch_mode="poll", watch_poll_interval=0.05, watch_poll_max_entries=3)
    ws = sb.workspace
    (ws / "big").mkdir()
    for name in "abcd":
        (ws / "big" / name).touch()
    r = sb.client.get("/v1/files/watch", params={"path": "big"})
    assert sb.error(r, 429) == "too_many_watched_entries"
    (ws / "small").mkdir()
    with Watch(sb, "small") as w:
        for name in "abc":
            (ws / "small" / name).touch()
        assert sorted(w.changes(3)) == [("create", f"small/{n}") for n in "abc"]
        # Past the bound: one overflow, then nothing while over it...
        (ws / "small/d").touch()
        overflow = w.next()
        assert overflow is not None and (overflow["type"], overflow["reason"]) == (
            "overflow",
            "watch_limit",
        )
        (ws / "small/e").touch()
        (ws / "small/b").write_text("changed while over the bound\n")
        w.quiet(0.3)
        # ...and once back under (d is the last to go), what changed meanwhile.
        (ws / "small/e").unlink()
        (ws / "small/d").unlink()
        assert w.changes(1) == [("write", "small/b")]
        w.quiet(0.3)


def test_a_polled_watch_lets_its_directory_go_when_its_client_leaves(
    fresh: Callable[..., Sandbox],
) -> None:
    sb = fresh(runner=False, watch_mode="poll", watch_poll_interval=0.05)
    assert sb.agent is not None
    pid = sb.agent.pid
    (sb.workspace / "held/sub").mkdir(parents=True)
    held = os.path.realpath(sb.workspace / "held")

    def descriptors() -> int:
        """The agent's descriptors of the watched directory (its scans open more)."""
        count = 0
        for name in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile
                count += os.readlink(f"/proc/{pid}/fd/{name}") == held
        return count

    watches = [Watch(sb, "held", recursive=True) for _ in range(3)]
    assert descriptors() >= 3
    for w in watches:
        w.close()
    wait_until(lambda: descriptors() == 0, 10)
    assert "sandbox_agent_watches 0.0" in sb.client.get("/metrics").text


def test_auto_mode_keeps_inotify_on_a_filesystem_it_sees(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(runner=False)  # watch_mode auto, on this machine's filesystem
    with Watch(sb, ".") as w:
        assert w.started["mode"] == "inotify"
        assert "pollInterval" not in w.started
