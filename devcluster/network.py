"""The pod network of a local node cluster: a Linux bridge, CNI config, cleanup.

Each node cluster gets its own bridge (`dc-<hash of the cluster name>`) and
its own /24 out of 10.88.0.0/16, so node clusters run side by side. The
bridge is created here, before anything starts, with the subnet's first
address on it: that address is the pods' gateway, the node's InternalIP, and
the address kube-apiserver and the kubelet serve on. This machine reaches pod
IPs directly through the bridge's connected route.

CNI (Debian's containernetworking-plugins, run by containerd): `bridge` on
that bridge with `isGateway: false` (the address is ours already; the plugin
would otherwise also switch on net.ipv4.ip_forward, a host-wide setting) and
no IP masquerading (pods need nothing beyond this machine), `host-local` IPAM
with its data in the cluster's state dir, and `portmap` for hostPort pods.
containerd adds the `loopback` plugin itself.

The only iptables rules come from `portmap`, and only for pods with a
hostPort: each carries a comment with the CNI network name
(`devcluster-<cluster>`), which is what `remove_iptables_rules` deletes by,
after CNI DEL did its part (or could not, after a crash).
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import logging
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from devcluster import records

log = logging.getLogger("devcluster.network")

POD_SUPERNET = ipaddress.IPv4Network("10.88.0.0/16")
"""Each node cluster takes one /24 of this."""
SUBNET_PREFIX = 24
SERVICE_SUPERNET = ipaddress.IPv4Network("10.96.0.0/16")
"""...and the /24 of this with the same third octet for its Services: every
node cluster's kube-proxy programs this machine's one network namespace, so
two clusters must never hand out the same ClusterIP."""
CNI_BIN_DIR = Path("/usr/lib/cni")
# portmap's shared chains (nat table); per-pod chains are CNI-DN-<hash>.
_HOSTPORT_CHAINS = ("CNI-HOSTPORT-DNAT", "CNI-HOSTPORT-SETMARK", "CNI-HOSTPORT-MASQ")


class NetworkError(RuntimeError):
    """The pod network could not be set up or removed."""


@dataclass(frozen=True)
class PodNetwork:
    cluster: str
    subnet: ipaddress.IPv4Network

    @property
    def name(self) -> str:
        """CNI network name; also in every iptables comment portmap writes."""
        return f"devcluster-{self.cluster}"

    @property
    def bridge(self) -> str:
        # Interface names are at most 15 characters; a hash keeps long
        # cluster names apart.
        return "dc-" + hashlib.sha256(self.cluster.encode()).hexdigest()[:10]

    @property
    def gateway(self) -> str:
        return str(next(self.subnet.hosts()))

    @property
    def service_subnet(self) -> ipaddress.IPv4Network:
        """The cluster's Service (ClusterIP) range: the /24 of SERVICE_SUPERNET
        at the pod subnet's place in POD_SUPERNET."""
        return service_subnet_of(self.subnet)

    @property
    def dns_ip(self) -> str:
        """The `kube-dns` Service's ClusterIP (the kubelet's clusterDNS): .10,
        as kubeadm chooses it."""
        return str(self.service_subnet.network_address + 10)

    def cni_config(self, ipam_dir: Path) -> dict[str, object]:
        """The conflist containerd's CRI plugin loads (cni.conf_dir)."""
        return {
            "cniVersion": "1.0.0",
            "name": self.name,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": False,
                    "ipMasq": False,
                    # A pod can reach itself through its own hostPort/Service.
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": str(self.subnet), "gateway": self.gateway}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        # Not /var/lib/cni/networks: per cluster, and removed with it.
                        "dataDir": str(ipam_dir),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }


def service_subnet_of(subnet: ipaddress.IPv4Network) -> ipaddress.IPv4Network:
    offset = int(subnet.network_address) - int(POD_SUPERNET.network_address)
    return ipaddress.IPv4Network((int(SERVICE_SUPERNET.network_address) + offset, SUBNET_PREFIX))


def _ip_json(*args: str) -> list[dict[str, object]]:
    proc = subprocess.run(["ip", "-j", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    data = json.loads(proc.stdout or "[]")
    return data if isinstance(data, list) else []


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _networks_in_use(except_bridge: str) -> list[ipaddress.IPv4Network]:
    """IPv4 networks of this machine's addresses and routes (any table),
    except those on our own bridge."""
    used: list[ipaddress.IPv4Network] = []
    for link in _ip_json("-4", "addr", "show"):
        if link.get("ifname") == except_bridge:
            continue
        infos = link.get("addr_info")
        for info in infos if isinstance(infos, list) else []:
            with contextlib.suppress(KeyError, ValueError, TypeError):
                used.append(
                    ipaddress.IPv4Network(f"{info['local']}/{info['prefixlen']}", strict=False)
                )
    for route in _ip_json("-4", "route", "show", "table", "all"):
        dst, dev = route.get("dst"), route.get("dev")
        if dev == except_bridge or not isinstance(dst, str) or dst == "default":
            continue
        with contextlib.suppress(ValueError):
            network = ipaddress.IPv4Network(dst, strict=False)
            if network.prefixlen > 0:
                used.append(network)
    return used


def allocate(cluster: str, record: Path, lock_dir: Path) -> PodNetwork:
    """The pod network of `cluster`: the one recorded in `record` if its subnet
    is still free, else a free /24 of POD_SUPERNET (recorded). A lock across
    processes keeps two clusters starting at once from taking the same one;
    the subnets recorded by other clusters' state dirs are avoided too."""
    with records.file_lock(lock_dir / ".pod-network.lock"):
        bridge = PodNetwork(cluster, POD_SUPERNET).bridge
        used = _networks_in_use(except_bridge=bridge)
        reserved = []
        for other in lock_dir.glob("*/network.json"):
            if other == record:
                continue
            with contextlib.suppress(OSError, ValueError):
                reserved.append(records.load(PodNetwork, other).subnet)

        def free(subnet: ipaddress.IPv4Network, blocked: list[ipaddress.IPv4Network]) -> bool:
            # The Service range goes with the pod subnet: both must be free.
            ranges = (subnet, service_subnet_of(subnet))
            return not any(r.overlaps(net) for r in ranges for net in blocked)

        with contextlib.suppress(OSError, ValueError):
            previous = records.load(PodNetwork, record)
            if free(previous.subnet, used + reserved):
                return previous
        subnets = list(POD_SUPERNET.subnets(new_prefix=SUBNET_PREFIX))
        # Start at a place given by the name: a cluster tends to get the same
        # subnet again even after its record was removed (stable certificates).
        start = int(hashlib.sha256(cluster.encode()).hexdigest(), 16) % len(subnets)
        for blocked in (used + reserved, used):
            for offset in range(len(subnets)):
                subnet = subnets[(start + offset) % len(subnets)]
                if free(subnet, blocked):
                    network = PodNetwork(cluster, subnet)
                    records.save(network, record)
                    return network
        raise NetworkError(f"no free /{SUBNET_PREFIX} left in {POD_SUPERNET}")


def bridge_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def create_bridge(network: PodNetwork) -> None:
    """The bridge with the gateway address, up. Idempotent."""
    if not bridge_exists(network.bridge):
        _ip("link", "add", network.bridge, "type", "bridge")
    address = f"{network.gateway}/{network.subnet.prefixlen}"
    addresses = [
        f"{info.get('local')}/{info.get('prefixlen')}"
        for link in _ip_json("-4", "addr", "show", "dev", network.bridge)
        for info in (link.get("addr_info") or [])  # type: ignore[attr-defined]
    ]
    for other in addresses:
        if other != address:
            _ip("addr", "del", other, "dev", network.bridge)
    if address not in addresses:
        _ip("addr", "add", address, "dev", network.bridge)
    _ip("link", "set", network.bridge, "up")


def forward_table(network: PodNetwork) -> str:
    """The nftables table (inet family) that keeps the bridge's forwarding
    inside the bridge."""
    return f"{network.bridge}-forward"


def _nft(*args: str, script: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nft", *args], input=script, capture_output=True, text=True, check=False)


def enable_forwarding(network: PodNetwork) -> None:
    """Let packets that arrive from the pods be routed, but only back onto the
    bridge. Idempotent.

    A pod's packet to a ClusterIP is addressed to the bridge's own MAC; once
    kube-proxy has rewritten its destination to another pod it must be
    routed, bridge to bridge, and this kernel (6.18) routes it only with
    forwarding on for the interface it came in on (br_netfilter's old
    "bridged DNAT" path without forwarding no longer delivers it). This
    turns forwarding on for this bridge alone (net.ipv4.conf.<bridge>.
    forwarding; the host-wide net.ipv4.ip_forward stays as it is), and the
    table drops every forwarded packet from the bridge to any other
    interface first: pods still reach nothing beyond this machine, nor other
    clusters' pods. The table is written before forwarding is switched on.
    """
    name, bridge = forward_table(network), network.bridge
    script = f"""add table inet {name}
delete table inet {name}
table inet {name} {{
    chain forward {{
        type filter hook forward priority filter; policy accept;
        iifname "{bridge}" oifname != "{bridge}" counter drop comment "{network.name}: pods only"
    }}
}}
"""
    done = _nft("-f", "-", script=script)
    if done.returncode != 0:
        raise NetworkError(f"nft: {done.stderr.strip()}")
    Path(f"/proc/sys/net/ipv4/conf/{bridge}/forwarding").write_text("1")


def remove_forward_table(network: PodNetwork) -> None:
    """Delete the table of `enable_forwarding` (after the bridge, whose
    forwarding setting goes with it)."""
    if _nft("list", "table", "inet", forward_table(network)).returncode == 0:
        _nft("delete", "table", "inet", forward_table(network))


def delete_bridge(network: PodNetwork) -> None:
    """Remove the bridge and any veth still enslaved to it (their peers in
    pod namespaces go with them)."""
    if not bridge_exists(network.bridge):
        return
    for link in _ip_json("link", "show", "master", network.bridge):
        name = link.get("ifname")
        if isinstance(name, str):
            _ip("link", "del", name, check=False)
    _ip("link", "del", network.bridge)


def interfaces_on(network: PodNetwork) -> list[str]:
    """The bridge and the interfaces enslaved to it, if any exist."""
    if not bridge_exists(network.bridge):
        return []
    found = [network.bridge]
    for link in _ip_json("link", "show", "master", network.bridge):
        name = link.get("ifname")
        if isinstance(name, str):
            found.append(name)
    return found


# ---- iptables ----------------------------------------------------------------------


def iptables_save() -> str:
    proc = subprocess.run(["iptables-save"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NetworkError(f"iptables-save: {proc.stderr.strip()}")
    return proc.stdout


def rules_of(network: PodNetwork, saved: str | None = None) -> list[str]:
    """iptables-save lines (rules and chain declarations) that belong to the
    network: rules whose comment names it, and the per-pod chains they jump to."""
    text = iptables_save() if saved is None else saved
    marker = f'name: \\"{network.name}\\"'
    ours = [line for line in text.splitlines() if line.startswith("-A ") and marker in line]
    chains = {m.group(1) for line in ours for m in [re.search(r" -j (CNI-DN-\S+)", line)] if m}
    for line in text.splitlines():
        words = line.split()
        if (line.startswith(":") and line[1:].split()[0] in chains) or (
            line.startswith("-A ") and len(words) > 1 and words[1] in chains
        ):
            ours.append(line)
    return ours


def _iptables(table: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["iptables", "-w", "5", "-t", table, *args], capture_output=True, text=True, check=False
    )


def remove_iptables_rules(network: PodNetwork) -> list[str]:
    """Delete the portmap rules of this network that CNI DEL left (a crashed
    run), the per-pod chains they used, and portmap's shared chains once no
    pod of any network uses them. Returns the rules deleted."""
    try:
        text = iptables_save()
    except (NetworkError, FileNotFoundError):
        return []
    removed: list[str] = []
    table = ""
    per_pod_chains: set[tuple[str, str]] = set()
    marker = f'name: \\"{network.name}\\"'
    for line in text.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith("-A ") and marker in line:
            words = shlex.split(line)
            chain = words[1]
            if _iptables(table, "-D", chain, *words[2:]).returncode == 0:
                removed.append(line)
            jump = re.search(r" -j (CNI-DN-\S+)", line)
            if jump:
                per_pod_chains.add((table, jump.group(1)))
    for table_name, chain in per_pod_chains:
        _iptables(table_name, "-F", chain)
        _iptables(table_name, "-X", chain)
    _remove_unused_hostport_chains()
    return removed


def _remove_unused_hostport_chains() -> None:
    """portmap creates its shared nat chains on first use and never removes
    them. Once CNI-HOSTPORT-DNAT has no per-pod jumps, no pod of any network
    on this machine has a hostPort: remove the chains and the jumps to them."""
    text = iptables_save()
    if ":CNI-HOSTPORT-DNAT" not in text:
        return
    nat = text.split("*nat", 1)[1].split("COMMIT", 1)[0]
    if any(line.startswith("-A CNI-HOSTPORT-DNAT ") for line in nat.splitlines()):
        return
    for line in nat.splitlines():
        words = line.split()
        if (
            line.startswith("-A ")
            and words[1] not in _HOSTPORT_CHAINS
            and any(f"-j {chain}" in line for chain in _HOSTPORT_CHAINS)
        ):
            _iptables("nat", "-D", *shlex.split(line)[1:])
    for chain in _HOSTPORT_CHAINS:
        if f":{chain} " in nat:
            _iptables("nat", "-F", chain)
            _iptables("nat", "-X", chain)
