"""Builds of the node's Services, DNS and NetworkPolicy components.

- kube-proxy: from the pinned k8s.io/kubernetes, patched so that its
  nftables table is named by the cluster (`$DEVCLUSTER_KUBE_PROXY_TABLE`).
  Upstream hard-codes one table (`kube-proxy`) per network namespace, and
  the iptables mode hard-codes its chains the same way: two clusters on one
  machine would rewrite each other's rules on every sync. The same variable
  keeps it from deleting the iptables/IPVS rules of other proxy modes at
  start (upstream cleans those up when it runs in nftables mode: another
  kube-proxy on this machine may be using them).
- CoreDNS: a main package of our own (devcluster/dns/coredns) against the
  pinned CoreDNS module, with the few plugins the Corefile names.
- kube-network-policies: upstream's `standard` command, patched four ways.
  This kernel has no nftables `queue` expression (CONFIG_NFT_QUEUE is not
  set; `nft add rule ... queue` answers "No such file or directory"), so
  packets are sent to NFQUEUE through the xtables target over nft_compat
  (CONFIG_NFT_COMPAT and CONFIG_NETFILTER_XT_TARGET_NFQUEUE are there). Its
  nftables table is named by the cluster (`$DEVCLUSTER_NETWORK_POLICY_TABLE`).
  And packets of established connections pass without the conntrack label
  upstream requires: the enforcer accepts a connection's first packet with
  a verdict that also labels its conntrack entry, and lets later packets
  through by that label; here the verdict is applied but the label never
  appears (`conntrack -L -o labels`), so every reply was queued again and
  judged as a new connection the other way (a sandbox's DNS answer, say,
  refused by the sandbox's own ingress policy). Without the label, "strict
  mode" (cutting established connections when a policy changes) cannot work
  and is off: a policy change applies to new connections, which is what the
  NetworkPolicy API promises. And it fails closed for new pods: upstream
  judges only addresses of pods it knows to have policies, and lets a packet
  from a pod not in its informer yet through (no pod, no policy); a
  sandbox's first connections, before its IP reached the enforcer, went
  anywhere (seen under load: a sandbox with `egress: Internet` reached the
  API server and another sandbox's agent port). Every address of the
  cluster's pod subnet is diverted to the queue now, and a packet from one
  that is no known pod is dropped until it is.

Patches are applied to a copy of the module (`build.SourcePatch`); each is
checked to apply to exactly the text it was written for, so a version bump
that moves that text fails the build instead of silently building
upstream's behaviour.
"""

from __future__ import annotations

from pathlib import Path

from devcluster import build, versions

KUBE_PROXY_TABLE_ENV = "DEVCLUSTER_KUBE_PROXY_TABLE"
NETWORK_POLICY_TABLE_ENV = "DEVCLUSTER_NETWORK_POLICY_TABLE"
POD_SUBNET_ENV = "DEVCLUSTER_POD_SUBNET"
POD_GATEWAY_ENV = "DEVCLUSTER_POD_GATEWAY"
DNS_SOURCE = Path(__file__).resolve().parent / "dns"

KUBE_PROXY_PATCHES = (
    build.SourcePatch(
        "pkg/proxy/nftables/devcluster_table.go",
        "",
        f"""package nftables

import "os"

// devclusterTable is the nftables table of this kube-proxy: ${KUBE_PROXY_TABLE_ENV}
// if set (several local clusters share one network namespace), else upstream's.
// Added by sandbox-operator's devcluster at build time.
func devclusterTable() string {{
\tif name := os.Getenv("{KUBE_PROXY_TABLE_ENV}"); name != "" {{
\t\treturn name
\t}}
\treturn kubeProxyTable
}}
""",
        "nftables table named per cluster",
    ),
    build.SourcePatch(
        "pkg/proxy/nftables/proxier.go",
        "nft, err := knftables.New(nftablesFamily, kubeProxyTable)",
        "nft, err := knftables.New(nftablesFamily, devclusterTable())",
        "the proxier uses the per-cluster table",
    ),
    build.SourcePatch(
        "pkg/proxy/nftables/proxier.go",
        "nft, err := knftables.New(family, kubeProxyTable)",
        "nft, err := knftables.New(family, devclusterTable())",
        "CleanupLeftovers removes the per-cluster table",
    ),
    build.SourcePatch(
        "cmd/kube-proxy/app/server_linux.go",
        "if !isIPTablesBased(mode) || cleanupAndExit {",
        "if (!isIPTablesBased(mode) && "
        f'os.Getenv("{KUBE_PROXY_TABLE_ENV}") == "") || cleanupAndExit {{',
        "a per-cluster kube-proxy leaves the iptables/IPVS rules of others alone",
    ),
)

NETWORK_POLICY_PATCHES = (
    build.SourcePatch(
        "pkg/dataplane/devcluster_queue.go",
        "",
        """package dataplane

import (
\t"encoding/binary"

\t"github.com/google/nftables/expr"
\t"github.com/google/nftables/xt"
)

// devclusterQueue sends packets to NFQUEUE `num` through the xtables NFQUEUE
// target (revision 3) over nft_compat, for kernels built without the
// nftables queue expression (CONFIG_NFT_QUEUE). Same verdicts and bypass.
// Added by sandbox-operator's devcluster at build time.
func devclusterQueue(num uint16, bypass bool) expr.Any {
\t// struct xt_NFQ_info_v3 {__u16 queuenum, queues_total, flags}, padded to 8 bytes.
\tinfo := make(xt.Unknown, 8)
\tbinary.NativeEndian.PutUint16(info[0:], num)
\tbinary.NativeEndian.PutUint16(info[2:], 1)
\tif bypass {
\t\tbinary.NativeEndian.PutUint16(info[4:], 1) // NFQ_FLAG_BYPASS
\t}
\treturn &expr.Target{Name: "NFQUEUE", Rev: 3, Info: &info}
}
""",
        "NFQUEUE through nft_compat: no nft queue expression in this kernel",
    ),
    build.SourcePatch(
        "pkg/dataplane/controller.go",
        """queue := &expr.Queue{Num: uint16(c.config.QueueID)}
	if c.config.FailOpen {
		queue.Flag = expr.QueueFlagBypass
	}""",
        "queue := devclusterQueue(uint16(c.config.QueueID), c.config.FailOpen)",
        "every queue rule uses the xtables target",
        count=2,
    ),
    build.SourcePatch(
        "pkg/dataplane/controller.go",
        "\t\t\t&expr.Ct{Register: 0x1, Key: expr.CtKeyLABELS},\n"
        "\t\t\t&expr.Bitwise{SourceRegister: 0x1, DestRegister: 0x1, Len: 16, "
        "Mask: generateLabelMask(c.config.CTLabelAccept), Xor: make([]byte, 16)},\n"
        "\t\t\t&expr.Cmp{Op: expr.CmpOpNeq, Register: 0x1, Data: make([]byte, 16)},\n"
        "\t\t\t&expr.Ct{Register: 0x1, Key: expr.CtKeySTATE},",
        "\t\t\t&expr.Ct{Register: 0x1, Key: expr.CtKeySTATE},",
        "established/related packets pass without the conntrack label: a label set "
        "through the NFQUEUE verdict does not stick on this kernel, so replies were "
        "judged as new connections the other way",
    ),
    build.SourcePatch(
        "pkg/networkpolicy/devcluster_pods.go",
        "",
        f"""package networkpolicy

import (
\t"net"
\t"net/netip"
\t"os"
)

// The cluster's pod subnet (${POD_SUBNET_ENV}) and the node's own address in it
// (${POD_GATEWAY_ENV}). A packet from an address of the subnet that is no pod
// the enforcer knows yet is a new pod's whose IP has not reached the
// enforcer's informer: upstream lets it through (no pod, no policy), which
// is every policy off for a new pod's first second or so, longer on a busy
// node. Here it is dropped until the pod is known, and every address of the
// subnet is diverted to the queue so that such packets are judged at all.
// Added by sandbox-operator's devcluster at build time.
var devclusterSubnet, devclusterGateway = func() (netip.Prefix, netip.Addr) {{
\tsubnet, err := netip.ParsePrefix(os.Getenv("{POD_SUBNET_ENV}"))
\tif err != nil || subnet.Bits() < 20 {{
\t\treturn netip.Prefix{{}}, netip.Addr{{}}
\t}}
\tgateway, _ := netip.ParseAddr(os.Getenv("{POD_GATEWAY_ENV}"))
\treturn subnet.Masked(), gateway
}}()

// devclusterUnknownPod: is `ip` an address of the pod subnet (not the node's)?
func devclusterUnknownPod(ip net.IP) bool {{
\taddr, ok := netip.AddrFromSlice(ip)
\tif !ok || !devclusterSubnet.IsValid() {{
\t\treturn false
\t}}
\taddr = addr.Unmap()
\treturn devclusterSubnet.Contains(addr) && addr != devclusterGateway
}}

// devclusterPodAddresses: every address of the pod subnet but the node's.
func devclusterPodAddresses() []netip.Addr {{
\tvar out []netip.Addr
\tif !devclusterSubnet.IsValid() {{
\t\treturn out
\t}}
\tfor addr := devclusterSubnet.Addr(); devclusterSubnet.Contains(addr); addr = addr.Next() {{
\t\tif addr != devclusterGateway {{
\t\t\tout = append(out, addr)
\t\t}}
\t}}
\treturn out
}}
""",
        "a packet from a pod the enforcer does not know yet is dropped, not let through",
    ),
    build.SourcePatch(
        "pkg/networkpolicy/engine.go",
        "\tdstPod, _ := e.podInfoProvider.GetPodInfoByIP(packet.DstIP.String())\n",
        "\tdstPod, _ := e.podInfoProvider.GetPodInfoByIP(packet.DstIP.String())\n"
        "\tif srcPod == nil && devclusterUnknownPod(packet.SrcIP) {\n"
        '\t\tlogger.V(2).Info("Packet denied: from a pod not known yet")\n'
        "\t\treturn false, nil\n"
        "\t}\n",
        "packets of pods not known yet are denied",
    ),
    build.SourcePatch(
        "pkg/networkpolicy/engine.go",
        "\treturn ipSet.UnsortedList(), false, nil\n",
        "\tipSet.Insert(devclusterPodAddresses()...)\n\treturn ipSet.UnsortedList(), false, nil\n",
        "every pod address is diverted to the queue, known or not",
    ),
    build.SourcePatch(
        "cmd/kube-network-policies/standard/main.go",
        "dpCfg := dataplane.Config{",
        f'dpCfg := dataplane.Config{{\n\t\tNFTableName: os.Getenv("{NETWORK_POLICY_TABLE_ENV}"),',
        "nftables table named per cluster",
    ),
)


def kube_proxy_binary(*, build_missing: bool = True) -> Path:
    return build.patched_kubernetes_binary(
        "kube-proxy", KUBE_PROXY_PATCHES, build_missing=build_missing
    )


def coredns_binary(*, build_missing: bool = True) -> Path:
    return build.go_source_binaries(
        "coredns-devcluster",
        DNS_SOURCE,
        {versions.COREDNS_MODULE: versions.COREDNS},
        ["coredns"],
        # What `coredns -version` prints (upstream sets GitCommit the same way).
        ldflags=f"-s -w -X github.com/coredns/coredns/coremain.GitCommit={versions.COREDNS}",
        build_missing=build_missing,
    )["coredns"]


def network_policy_binary(*, build_missing: bool = True) -> Path:
    return build.go_module_binaries(
        "kube-network-policies",
        versions.NETWORK_POLICIES_MODULE,
        versions.NETWORK_POLICIES,
        [f"{versions.NETWORK_POLICIES_MODULE}/cmd/kube-network-policies/standard"],
        patches=NETWORK_POLICY_PATCHES,
        build_missing=build_missing,
    )["standard"]


def network_binaries(*, build_missing: bool = True) -> dict[str, Path]:
    """kube-proxy, coredns and kube-network-policies, built when missing."""
    return {
        "kube-proxy": kube_proxy_binary(build_missing=build_missing),
        "coredns": coredns_binary(build_missing=build_missing),
        "kube-network-policies": network_policy_binary(build_missing=build_missing),
    }


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for name, path in network_binaries().items():
        print(f"{name}\t{path}")
