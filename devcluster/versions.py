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
