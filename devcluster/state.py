"""Where clusters keep their state, and the one reader of a cluster's record.

Each cluster has a state dir, `<cache root>/clusters/<name>` unless given,
with `cluster.json`: what its last start chose (ports, the API server's
address, the components started so far, the process that owns it, and the
node tier's extras). Everything that needs those facts after the fact (the
cluster object itself, the CLI's `down`, the test sessions' orphan sweep,
another cluster choosing its subnet) reads them through `ClusterRecord`.

Below `devcluster.controlplane` and `devcluster.cluster` in the import
order, so that both, and `devcluster.registry` above them, can use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from devcluster import build, records

LOOPBACK = "127.0.0.1"
CLUSTER_FILE = "cluster.json"


def clusters_root() -> Path:
    return build.cache_root() / "clusters"


@dataclass(frozen=True)
class Ports:
    """The control plane's ports, chosen free at every start."""

    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int

    def all(self) -> list[int]:
        return [self.etcd_client, self.etcd_peer, self.apiserver, self.controller_manager]


@dataclass(frozen=True)
class NodePorts:
    """The node tier's ports (`devcluster.cluster.LocalCluster`)."""

    scheduler: int
    kubelet: int
    kubelet_healthz: int
    # Services and NetworkPolicy (devcluster.netstack); 0 in the records of
    # clusters started before these existed.
    kube_proxy_healthz: int = 0
    kube_proxy_metrics: int = 0
    network_policy_metrics: int = 0


@dataclass(frozen=True)
class ClusterRecord:
    """`cluster.json`. Fields are None (absent from the file) until a start
    wrote them; an unreadable file reads as an empty record, like a missing
    one: a cluster that cannot say what it started has nothing to stop."""

    name: str | None = None
    kind: str | None = None
    """The class that started the cluster (`devcluster.registry.KINDS`)."""
    ports: Ports | None = None
    apiserver_host: str = LOOPBACK
    started: tuple[str, ...] = ()
    """Component names in start order, recorded before each one's readiness wait."""
    owner_pid: int | None = None
    owner_start_ticks: int | None = None
    created: float | None = None
    start_seconds: float | None = None
    node_ports: NodePorts | None = None
    node_name: str | None = None
    cgroup_root: str | None = None

    @classmethod
    def path(cls, state_dir: Path) -> Path:
        return state_dir / CLUSTER_FILE

    @classmethod
    def read(cls, state_dir: Path) -> ClusterRecord:
        try:
            return records.load(cls, cls.path(state_dir))
        except (FileNotFoundError, records.RecordError):
            return cls()

    def write(self, state_dir: Path) -> None:
        records.save(self, self.path(state_dir))

    def updated(self, **changes: object) -> ClusterRecord:
        """A copy with `changes`, checked like a record read from disk."""
        return records.decode(ClusterRecord, records.plain({**records.encode(self), **changes}))


def update_record(state_dir: Path, **changes: object) -> ClusterRecord:
    """Read, change and write back `cluster.json` (callers hold the cluster's lock)."""
    record = ClusterRecord.read(state_dir).updated(**changes)
    record.write(state_dir)
    return record
