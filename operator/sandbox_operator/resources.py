"""Identities of everything the operator reads or writes: API groups, plurals,
label and annotation keys, and the one function that turns them into paths.

Kept apart from the handlers so that every controller, builder and test names
a resource the same way; nothing here performs I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandbox_operator.api.common import API_VERSION, GROUP


@dataclass(frozen=True)
class Resource:
    """A kind of object on the API server, by API version and plural."""

    api_version: str
    plural: str
    namespaced: bool = True

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]

    def path(
        self, namespace: str | None = None, name: str | None = None, sub: str | None = None
    ) -> str:
        """The REST path of the collection (no name) or of one object (and a subresource).

        Without a namespace, a namespaced resource's path lists across namespaces."""
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        parts = [base]
        if namespace and self.namespaced:
            parts.append(f"namespaces/{namespace}")
        parts.append(self.plural)
        if name:
            parts.append(name)
        if sub:
            parts.append(sub)
        return "/".join(parts)


# The project's own kinds.
SANDBOXES = Resource(API_VERSION, "sandboxes")
EXECUTIONS = Resource(API_VERSION, "executions")
SNAPSHOTS = Resource(API_VERSION, "snapshots")
SANDBOX_QUOTAS = Resource(API_VERSION, "sandboxquotas")
SANDBOX_TEMPLATES = Resource(API_VERSION, "sandboxtemplates")
CLUSTER_SANDBOX_TEMPLATES = Resource(API_VERSION, "clustersandboxtemplates", namespaced=False)
SANDBOX_POOLS = Resource(API_VERSION, "sandboxpools")

# Children and the objects they depend on.
PODS = Resource("v1", "pods")
SECRETS = Resource("v1", "secrets")
CLAIMS = Resource("v1", "persistentvolumeclaims")
VOLUMES = Resource("v1", "persistentvolumes", namespaced=False)
SERVICES = Resource("v1", "services")
EVENTS = Resource("v1", "events")
NETWORK_POLICIES = Resource("networking.k8s.io/v1", "networkpolicies")
STORAGE_CLASSES = Resource("storage.k8s.io/v1", "storageclasses", namespaced=False)

# CSI snapshots (external-snapshotter).
SNAPSHOT_GROUP = "snapshot.storage.k8s.io"
VOLUME_SNAPSHOTS = Resource(f"{SNAPSHOT_GROUP}/v1", "volumesnapshots")
VOLUME_SNAPSHOT_CONTENTS = Resource(
    f"{SNAPSHOT_GROUP}/v1", "volumesnapshotcontents", namespaced=False
)
VOLUME_SNAPSHOT_CLASSES = Resource(
    f"{SNAPSHOT_GROUP}/v1", "volumesnapshotclasses", namespaced=False
)

# Kopf peering: the replicas' keep-alives (peering.py).
CLUSTER_PEERINGS = Resource("kopf.dev/v1", "clusterkopfpeerings", namespaced=False)
PEERINGS = Resource("kopf.dev/v1", "kopfpeerings")

# -- labels (selectable, so values are at most 63 characters) --------------------
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "sandbox-operator"
# The Sandbox a child belongs to (Sandbox names are at most 50 characters).
LABEL_SANDBOX = f"{GROUP}/sandbox"
# UIDs, not names: Execution and Snapshot names may be up to 253 characters.
LABEL_EXECUTION_UID = f"{GROUP}/execution-uid"
LABEL_SNAPSHOT_UID = f"{GROUP}/snapshot-uid"
LABEL_IDLE = f"{GROUP}/idle-snapshot"
# On a template's build Sandbox and base Snapshots: the template they belong to.
LABEL_TEMPLATE = f"{GROUP}/template"
# On a pool's members while they wait to be claimed (removed by the claim).
LABEL_POOL = f"{GROUP}/pool"
# On a member: the template generation the pool made it from (until it pins its own).
GENERATION_ANNOTATION = f"{GROUP}/template-generation"

# -- annotations --------------------------------------------------------------------
# Written by users (or by the operator on their behalf); a new value is a request.
RESUME_ANNOTATION = f"{GROUP}/resume-requested-at"
RESTORE_ANNOTATION = f"{GROUP}/restore-requested-at"
# The names that the UID labels above stand for, for people reading the objects.
EXECUTION_ANNOTATION = f"{GROUP}/execution"
SNAPSHOT_ANNOTATION = f"{GROUP}/snapshot"
# On a sandbox pod: what it was built from (see builders.sandbox.stamp_pod).
POD_SPEC_ANNOTATION = f"{GROUP}/pod-spec"
POD_HASH_ANNOTATION = f"{GROUP}/pod-spec-hash"
IMAGE_ANNOTATION = f"{GROUP}/image"
# On a resumed pod of a sandbox paused with pauseMode Memory: the image the node's
# runsc restores it from (sandbox-node/sandbox-runsc reads it; containerd passes it).
RESTORE_FROM_ANNOTATION = f"{GROUP}/restore-from"
# kubectl's: the container `kubectl exec` and `logs` use when none is named
# (without it they name the one they chose on every call).
DEFAULT_CONTAINER_ANNOTATION = "kubectl.kubernetes.io/default-container"
# On a restored workspace claim: the Snapshot (and restore request) it was made
# from, and that Snapshot's lineage, so a restarted operator can tell claims apart.
CLAIM_FROM_SNAPSHOT = f"{GROUP}/from-snapshot"
CLAIM_RESTORE_REQUEST = f"{GROUP}/restore-request"
CLAIM_LINEAGE = f"{GROUP}/lineage"

# -- Kopf's bookkeeping ----------------------------------------------------------------
# A prefix of its own: Kopf ignores changes to annotations under its prefix, so
# no user-facing annotation may share it (the resume and restore requests above
# would go unnoticed until the next timer tick).
KOPF_PREFIX = f"kopf.{GROUP}"
# Unchanged since the first release: objects out there carry it, and a finalizer
# is not an annotation, so Kopf's change detection never looks at it.
FINALIZER = f"{GROUP}/finalizer"
# Where Kopf's bookkeeping lived before it had a prefix of its own (migrated on resume).
LEGACY_KOPF_PREFIX = GROUP
