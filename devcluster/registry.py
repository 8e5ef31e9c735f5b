"""The clusters on this machine, as found in their state dirs.

A cluster outlives the process that started it (the CLI's `up` exits; a test
session may be killed), so later processes find it by name under
`state.clusters_root()` and must stop it with the class that started it:
stopping a node cluster also unmounts, deletes its bridge and so on, which
only `LocalCluster` knows how to do. That class is named by the `kind` its
start recorded in cluster.json, and mapped back to a class here, above
`devcluster.controlplane` and `devcluster.cluster` in the import order (the
control plane knows no subclass of itself).
"""

from __future__ import annotations

import logging
from pathlib import Path

from devcluster import processes, state
from devcluster.cluster import LocalCluster
from devcluster.controlplane import ControlPlane, ControlPlaneError

log = logging.getLogger("devcluster")

KINDS: dict[str, type[ControlPlane]] = {
    ControlPlane.kind: ControlPlane,
    LocalCluster.kind: LocalCluster,
}
"""Cluster classes by the `kind` they record. Subclasses that share their
parent's stop (e.g. `storage.StorageControlPlane`, whose extra processes are
stopped from their PID records like the rest) keep the parent's kind."""


def open_cluster(name: str, *, state_dir: Path | None = None) -> ControlPlane:
    """The cluster of that name as the class that started it (a control plane
    when nothing, or an unknown kind, is recorded)."""
    directory = state_dir or state.clusters_root() / name
    kind = state.ClusterRecord.read(directory).kind
    return KINDS.get(kind or "", ControlPlane)(name, state_dir=directory)


def sweep_orphans(prefix: str) -> list[str]:
    """Stop and remove clusters named `prefix*` whose starting process is gone.

    For test runs: a pytest killed with SIGKILL leaves its state dir behind
    (its processes die with it). Clusters of live processes are left alone,
    and so are those named `<prefix><pid>-...` while that PID runs: a test
    session's cluster started through the CLI is owned by the CLI process,
    which has exited, yet the session still uses it.
    """
    root = state.clusters_root()
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for state_dir in sorted(root.iterdir()):
        if not state_dir.is_dir() or not state_dir.name.startswith(prefix):
            continue
        if _named_for_a_live_process(state_dir.name.removeprefix(prefix)):
            continue
        cluster = open_cluster(state_dir.name, state_dir=state_dir)
        if cluster.owner_alive():
            continue  # the common case, without waiting for its lock
        try:
            # Looked at again under its lock: another lane may be starting it now,
            # before its owner is recorded (it was stopped under that lane once).
            if not cluster.stop_if_orphaned():
                continue
        except ControlPlaneError as error:
            # Not this session's problem to fail on; but say so.
            log.warning("could not remove orphaned cluster %s: %s", state_dir.name, error)
            continue
        removed.append(state_dir.name)
    # Lock files of clusters that are gone (names with a dead PID are never reused).
    for lock in root.glob(f".{prefix}*.lock"):
        if not (root / lock.name[1:].removesuffix(".lock")).exists():
            lock.unlink(missing_ok=True)
    return removed


def _named_for_a_live_process(rest: str) -> bool:
    """Whether a name's first part is the PID of a process that runs."""
    pid = rest.partition("-")[0]
    if not pid.isdigit():
        return False
    return processes.process_start_ticks(int(pid)) is not None and not processes.is_zombie(int(pid))
