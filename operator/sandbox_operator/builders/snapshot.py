"""Desired objects of snapshots and restores, as plain dicts. Pure: no I/O, no clock.

The VolumeSnapshot of a Snapshot is deliberately not owned by it: whether it
outlives the Snapshot is the retain policy's call, made by the finalizer, not
the garbage collector's. Snapshots the idle policy takes are not owned by
their Sandbox either: deleting a Sandbox never deletes its snapshots.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sandbox_operator.api.common import API_VERSION, quantity_value
from sandbox_operator.resources import (
    CLAIM_FROM_SNAPSHOT,
    CLAIM_LINEAGE,
    CLAIM_RESTORE_REQUEST,
    LABEL_IDLE,
    LABEL_MANAGED_BY,
    LABEL_SANDBOX,
    LABEL_SNAPSHOT_UID,
    MANAGED_BY,
    SNAPSHOT_ANNOTATION,
    SNAPSHOT_GROUP,
    VOLUME_SNAPSHOTS,
)

JSON = dict[str, Any]

DEFAULT_CLASS_ANNOTATION = "snapshot.storage.kubernetes.io/is-default-class"


@dataclass(frozen=True)
class SnapshotRef:
    name: str
    namespace: str
    uid: str


@dataclass(frozen=True)
class RestoreSource:
    """A ready Snapshot a workspace claim is made from."""

    snapshot: str
    volume_snapshot: str
    restore_size: str | None
    # The Snapshot itself, then its own lineage.
    lineage: tuple[str, ...]
    # The value of the Sandbox's restore-request annotation this restore answers.
    request: str = ""


def volume_snapshot_name(ref: SnapshotRef) -> str:
    """Unique per Snapshot object: a Snapshot deleted (retained) and recreated under
    the same name never collides with the VolumeSnapshot of its namesake."""
    return f"sandbox-snapshot-{ref.uid}"


def build_volume_snapshot(
    ref: SnapshotRef, sandbox: str, claim: str, class_name: str | None
) -> JSON:
    spec: JSON = {"source": {"persistentVolumeClaimName": claim}}
    if class_name:
        spec["volumeSnapshotClassName"] = class_name
    return {
        "apiVersion": VOLUME_SNAPSHOTS.api_version,
        "kind": "VolumeSnapshot",
        "metadata": {
            "name": volume_snapshot_name(ref),
            "namespace": ref.namespace,
            # The UID, not the name: label values are at most 63 characters.
            "labels": {
                LABEL_SNAPSHOT_UID: ref.uid,
                LABEL_SANDBOX: sandbox,
                LABEL_MANAGED_BY: MANAGED_BY,
            },
            "annotations": {SNAPSHOT_ANNOTATION: ref.name},
        },
        "spec": spec,
    }


def pick_snapshot_class(classes: list[JSON], driver: str) -> str | None:
    """The VolumeSnapshotClass for a CSI driver: its default one, else the only one."""
    mine = [c for c in classes if c.get("driver") == driver]
    defaults = [
        c
        for c in mine
        if (c["metadata"].get("annotations") or {}).get(DEFAULT_CLASS_ANNOTATION) == "true"
    ]
    chosen = defaults or mine
    if len(chosen) != 1:
        return None
    name: str = chosen[0]["metadata"]["name"]
    return name


def idle_snapshot_name(sandbox: str, deadline: datetime) -> str:
    """Named after the idle deadline it answers, which a restarted operator
    computes again from the agent's activity: the name survives a crash."""
    return f"{sandbox}-idle-{deadline:%Y%m%d%H%M%S}"


def build_idle_snapshot(sandbox: str, namespace: str, name: str) -> JSON:
    return {
        "apiVersion": API_VERSION,
        "kind": "Snapshot",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {LABEL_SANDBOX: sandbox, LABEL_IDLE: "true"},
        },
        "spec": {
            "sandboxRef": {"name": sandbox},
            "tag": "idle",
            "description": "taken by the idle policy before the sandbox was stopped",
        },
    }


def restored_size(requested: str, restore_size: str | None) -> str:
    """A claim restored from a snapshot must be at least the snapshot's size."""
    if restore_size and quantity_value(restore_size) > quantity_value(requested):
        return restore_size
    return requested


def restore_into(claim: JSON, source: RestoreSource) -> JSON:
    """The workspace claim `claim`, made from `source` instead of empty."""
    spec = dict(claim["spec"])
    requests = {**spec["resources"]["requests"]}
    requests["storage"] = restored_size(requests["storage"], source.restore_size)
    spec["resources"] = {**spec["resources"], "requests": requests}
    spec["dataSource"] = {
        "apiGroup": SNAPSHOT_GROUP,
        "kind": "VolumeSnapshot",
        "name": source.volume_snapshot,
    }
    meta = dict(claim["metadata"])
    meta["annotations"] = {
        **(meta.get("annotations") or {}),
        CLAIM_FROM_SNAPSHOT: source.snapshot,
        CLAIM_RESTORE_REQUEST: source.request,
        CLAIM_LINEAGE: json.dumps(list(source.lineage)),
    }
    return {**claim, "metadata": meta, "spec": spec}


def claim_origin(claim: JSON) -> tuple[str | None, str, list[str]]:
    """(snapshot, restore request, lineage) recorded on a workspace claim."""
    annotations = claim["metadata"].get("annotations") or {}
    try:
        lineage = json.loads(annotations.get(CLAIM_LINEAGE) or "[]")
    except ValueError:
        lineage = []
    if not isinstance(lineage, list):
        lineage = []
    return (
        annotations.get(CLAIM_FROM_SNAPSHOT),
        annotations.get(CLAIM_RESTORE_REQUEST, ""),
        [str(item) for item in lineage],
    )
