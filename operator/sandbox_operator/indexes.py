"""The operator's Kopf indexes, as one typed object, and what their entries keep.

main.py registers an index function for each field of `Indexes` and hands
every controller the object it builds from a handler's keyword arguments:
controllers read fields, never Kopf's names. Each index maps a key to a
collection of entries (Kopf's Store), one entry for almost every key. The
indexes are live: an object built once (a daemon's, the clock's) sees every later event.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from sandbox_operator.identity import SANDBOX_CONTAINER
from sandbox_operator.resources import (
    CLAIMS,
    EXECUTIONS,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    PODS,
    SANDBOX_POOLS,
    SANDBOX_QUOTAS,
    SANDBOXES,
    Resource,
)

JSON = dict[str, Any]
Key = tuple[str, str]
# (kind, namespace, pool name or claimer UID): see `builders.pool.pool_links`.
LinkKey = tuple[str, str, str]


@dataclass(frozen=True)
class Indexes:
    # Sandboxes by (namespace, name), without managedFields (`drop_managed_fields`).
    sandboxes: Mapping[Key, Collection[JSON]]
    # Sandbox names by pool link (`builders.pool.pool_links`).
    links: Mapping[LinkKey, Collection[str]]
    # Our pods by (namespace, sandbox): `pod_essentials`.
    pods: Mapping[Key, Collection[JSON]]
    # Our workspace claims by (namespace, sandbox), trimmed.
    claims: Mapping[Key, Collection[JSON]]
    # SandboxQuotas by namespace: {"name", "spec"} entries (`handlers.quota.index_entry`).
    quotas: Mapping[str, Collection[JSON]]
    # SandboxPools by (namespace, name), trimmed.
    pools: Mapping[Key, Collection[JSON]]
    # Executions by (namespace, sandbox): the per-sandbox queue
    # (`handlers.execution.slot_entry`).
    slots: Mapping[Key, Collection[JSON]]


@dataclass(frozen=True)
class Source:
    """The objects an index holds values of: a kind, and the label selector its
    index function is registered with (None: every object of the kind)."""

    resource: Resource
    selector: str | None = None


# The operator's own children carry this label; only those are indexed.
OWN_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
# Each field of `Indexes` and what main.py registers its index function on
# (tests/unit/test_sweep.py checks that the two agree).
SOURCES: dict[str, Source] = {
    "sandboxes": Source(SANDBOXES),
    "links": Source(SANDBOXES),
    "pods": Source(PODS, OWN_SELECTOR),
    "claims": Source(CLAIMS, OWN_SELECTOR),
    "quotas": Source(SANDBOX_QUOTAS),
    "pools": Source(SANDBOX_POOLS),
    "slots": Source(EXECUTIONS),
}


def drop_managed_fields(body: Mapping[str, Any]) -> None:
    """Remove managedFields from the object Kopf received, in place.

    The index keeps the latest body of every Sandbox (and Kopf that of every
    object with a daemon, each Execution) for as long as the object exists,
    and Kopf hands that same parsed event to every handler and index function. managedFields are
    nearly half of a Sandbox's parsed size (7 of 16 KiB) and nothing reads
    them, Kopf included: removed from the event by the first index function
    that sees it, they are never kept. `body["metadata"]` is the event's own
    dict, not a copy."""
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        metadata.pop("managedFields", None)


def trim(body: Mapping[str, Any]) -> JSON:
    """A body to keep in an index: managedFields are most of its size and never read."""
    meta = {k: v for k, v in body["metadata"].items() if k != "managedFields"}
    return {**dict(body), "metadata": meta}


def pod_essentials(pod: Mapping[str, Any]) -> JSON:
    """What the operator keeps of a pod it made: metadata (without managedFields),
    status, the sandbox container's env (which sync_environment compares) and
    the node it runs on (a pause that keeps memory asks that node to save it).
    The rest of the spec (probes, mounts, security contexts) is two thirds of a
    pod's size and never read after creation: at 10,000 Sandboxes, hundreds of
    MiB of the pod index. Pure."""
    meta = {key: value for key, value in pod["metadata"].items() if key != "managedFields"}
    containers = [
        {"name": c["name"], "env": c.get("env") or []}
        for c in (pod.get("spec") or {}).get("containers") or []
        if c.get("name") == SANDBOX_CONTAINER
    ]
    spec: JSON = {"containers": containers}
    node = (pod.get("spec") or {}).get("nodeName")
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": pod.get("apiVersion", "v1"),
        "kind": pod.get("kind", "Pod"),
        "metadata": meta,
        "spec": spec,
        "status": pod.get("status") or {},
    }
