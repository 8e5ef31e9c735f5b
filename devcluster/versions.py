"""Every pinned upstream version of the local cluster, in one place.

Changing a pin here changes the binary cache key, so the next run rebuilds.
"""

from __future__ import annotations

# Kubernetes control plane (and, later, node) components.
KUBERNETES = "v1.34.4"
# Staging modules (k8s.io/api, k8s.io/client-go, ...) are tagged v0.N.M for v1.N.M.
KUBERNETES_STAGING = "v0." + KUBERNETES.removeprefix("v1.")
# etcd server: the 3.6 line Kubernetes 1.34 is tested against.
ETCD = "v3.6.13"

KUBERNETES_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kubectl")

# ---- CSI storage (devcluster/storage.py) ------------------------------------
# Sidecars built from their upstream Go modules. The module proxy reachable
# here serves these versions; it refuses (403) every version tried of
# github.com/kubernetes-csi/csi-driver-host-path and node-driver-registrar/v2,
# so the hostpath driver and the registrar are built from devcluster/csi/.
CSI_PROVISIONER_MODULE = "github.com/kubernetes-csi/external-provisioner/v5"
CSI_PROVISIONER = "v5.3.0"
# v8.4.0 is built against k8s.io/* v0.34 (the pinned Kubernetes minor).
CSI_SNAPSHOTTER_MODULE = "github.com/kubernetes-csi/external-snapshotter/v8"
CSI_SNAPSHOTTER = "v8.4.0"
# Nested module of external-snapshotter (its go.mod points it at ./client);
# also carries the VolumeSnapshot CRD YAMLs in config/crd.
CSI_SNAPSHOTTER_CLIENT_MODULE = "github.com/kubernetes-csi/external-snapshotter/client/v8"
CSI_SNAPSHOTTER_CLIENT = CSI_SNAPSHOTTER
# Requirements of the in-repo driver and registrar: the CSI spec and gRPC
# that external-snapshotter CSI_SNAPSHOTTER builds with, the kubelet's plugin
# registration API at the pinned Kubernetes version.
CSI_SPEC = "v1.12.0"
CSI_GRPC = "v1.72.1"
CSI_PROTOBUF = "v1.36.5"
# The CSI conformance suite (csi-sanity), run against the in-repo driver.
# v5.5.0 or later: before it, the suite's own connect loop could miss the
# channel's change to READY and wait its full minute ("Connection timed out").
CSI_TEST_MODULE = "github.com/kubernetes-csi/csi-test/v5"
CSI_TEST = "v5.5.0"
# ---- end CSI storage ------------------------------------------------------------

# ---- node tier (devcluster.cluster.LocalCluster) -------------------------------
# Built from the same k8s.io/kubernetes module wrapper as the control plane.
KUBERNETES_NODE_COMMANDS = ("kube-scheduler", "kubelet")
# crictl: talks CRI to the node's private containerd, so stop() can tear pod
# sandboxes down through CNI DEL (veths, IPAM, portmap rules) rather than by force.
# Same minor as Kubernetes (cri-tools follows its CRI releases).
CRI_TOOLS = "v1.34.0"
# Debian release of the locally built images (mmdebstrap suite). Its python3
# (3.11) and glibc (2.36) decide which wheels images.py installs.
DEBIAN_SUITE = "bookworm"
DEBIAN_PYTHON = "3.11"
DEBIAN_GLIBC = (2, 36)

# helm, for installing the chart like a user (built from its Go module).
HELM_MODULE = "helm.sh/helm/v3"
HELM = "v3.19.0"

# gopher-lua, the Lua 5.1 interpreter Argo CD runs resource health scripts
# with (the version its go.mod requires), for testing the chart's scripts.
GOPHER_LUA_MODULE = "github.com/yuin/gopher-lua"
GOPHER_LUA = "v1.1.1"

# ---- Services, DNS, NetworkPolicy on the node (devcluster/netstack.py) ---------
# kube-proxy: from the pinned k8s.io/kubernetes (the wrapper module of the
# other node binaries), in nftables mode, with a two-line patch (netstack.py)
# that lets each cluster name its own nftables table.
# CoreDNS: the newest release the module proxy serves (it listed v1.14.3 to
# v1.15.0); a command of our own with only the plugins the node needs
# (devcluster/dns/coredns/main.go), so none of the cloud SDKs are built.
COREDNS_MODULE = "github.com/coredns/coredns"
COREDNS = "v1.15.0"
# kube-network-policies: v0.8.0 (the newest the proxy lists) runs in-cluster
# only; v1.1.1 (resolved by version) runs as a host process with a kubeconfig.
# Patched at build time (netstack.py): this kernel has no nft `queue`
# expression (CONFIG_NFT_QUEUE is off), so packets go to NFQUEUE through the
# xtables target (nft_compat), and the nftables table name is per cluster.
NETWORK_POLICIES_MODULE = "sigs.k8s.io/kube-network-policies"
NETWORK_POLICIES = "v1.1.1"

# ---- gVisor on the node (devcluster/gvisor.py) ------------------------------------
# runsc and containerd-shim-runsc-v1 from the module's `go` branch (the proxy
# serves pseudo-versions only). The shim of GVISOR_SHIM builds against
# containerd 1.x libraries and runs under the node's containerd 1.6 (later
# shims answer containerd 2's start protocol); it drives runsc by its command
# line, which GVISOR's runsc still speaks. GVISOR's runsc checkpoints and
# restores a pod of several containers (pause mode Memory).
GVISOR = "v0.0.0-20260905035102-160fafc42237"
GVISOR_SHIM = "v0.0.0-20230927004350-cbd86285d259"
