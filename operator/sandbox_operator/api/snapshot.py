"""The Snapshot resource: a sandbox workspace captured as a CSI VolumeSnapshot.

Besides the models, this module declares the status vocabulary: phases,
condition types and reasons.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field

from sandbox_operator.api.common import (
    DNS_SUBDOMAIN_PATTERN,
    Condition,
    LocalObjectReference,
    Model,
    immutable,
    validations,
)


class SnapshotPhase(StrEnum):
    """Derived from the Ready condition (see builders.snapshot_status)."""

    PENDING = "Pending"
    IN_PROGRESS = "InProgress"
    READY = "Ready"
    FAILED = "Failed"


class SnapshotCondition(StrEnum):
    """Ready always; Quiesced only when `spec.quiesce` paused running commands;
    Reconciling, Stalled (kstatus) only while True."""

    READY = "Ready"
    QUIESCED = "Quiesced"
    RECONCILING = "Reconciling"
    STALLED = "Stalled"


class SnapshotReason(StrEnum):
    READY = "SnapshotReady"
    INVALID_SPEC = "InvalidSpec"
    SANDBOX_NOT_FOUND = "SandboxNotFound"
    WORKSPACE_PENDING = "WorkspacePending"
    SANDBOX_NOT_READY = "SandboxNotReady"
    UNSUPPORTED = "SnapshotsUnsupported"
    NO_PERSISTENT_WORKSPACE = "NoPersistentWorkspace"
    CLASS_NOT_FOUND = "VolumeSnapshotClassNotFound"
    QUIESCE_FAILED = "QuiesceFailed"
    SYNC_FAILED = "SyncFailed"
    CREATING = "Creating"
    SNAPSHOT_FAILED = "SnapshotFailed"
    # The VolumeSnapshot reports an error that the snapshot controller retries.
    CSI_RETRYING = "SnapshotRetrying"
    VOLUME_SNAPSHOT_MISSING = "VolumeSnapshotMissing"
    # Quiesced.
    QUIESCED = "ExecutionsPaused"
    RESUMED = "ExecutionsResumed"
    NO_POD = "NoPod"


class RetainPolicy(StrEnum):
    DELETE = "Delete"
    RETAIN = "Retain"


class SnapshotSpec(Model):
    """Desired state of a Snapshot. Immutable: a snapshot is taken once."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            immutable("sandboxRef", "tag", "volumeSnapshotClassName", "quiesce")
        )
    )

    sandbox_ref: LocalObjectReference = Field(description="The Sandbox whose workspace to take.")
    tag: Annotated[str | None, Field(max_length=128, pattern=r"^[A-Za-z0-9][-._A-Za-z0-9]*$")] = (
        Field(default=None, description="A free-form label, shown by kubectl get.")
    )
    description: Annotated[str | None, Field(max_length=1024)] = Field(
        default=None, description="What the snapshot holds, for people."
    )
    volume_snapshot_class_name: Annotated[
        str | None, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)
    ] = Field(
        default=None,
        description="Defaults to the operator's configured class, else the default class of"
        " the workspace volume's CSI driver.",
    )
    quiesce: bool = Field(
        default=False, description="Pause running executions' writes while the snapshot is cut."
    )
    retain_policy: RetainPolicy = Field(
        default=RetainPolicy.DELETE,
        description="Retain: deleting this Snapshot (or its namespace) keeps the volume"
        " snapshot's content and the data in the storage system. Delete: they go with it.",
    )


class SnapshotStatus(Model):
    """Observed state, written only by the operator."""

    model_config = ConfigDict(extra="ignore")

    phase: SnapshotPhase | None = Field(default=None, description="A summary for people.")
    observed_generation: int | None = Field(
        default=None, description="The spec generation this status was computed from."
    )
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready always; Quiesced when spec.quiesce is set."
    )
    volume_snapshot_name: str | None = Field(
        default=None, description="The CSI VolumeSnapshot holding the data."
    )
    volume_snapshot_content_name: str | None = Field(
        default=None, description="Its VolumeSnapshotContent (cluster-scoped)."
    )
    ready_to_use: bool | None = Field(default=None, description="Restorable now.")
    restore_size: str | None = Field(
        default=None, description="The smallest workspace that can hold it."
    )
    creation_time: str | None = Field(default=None, description="When the snapshot was cut.")
    source_sandbox: str | None = Field(default=None, description="The Sandbox it was taken of.")
    lineage: list[str] | None = Field(
        default=None,
        description=(
            "The Snapshot the source sandbox's workspace was restored from, then the one"
            " that Snapshot's source came from, and so on (nearest first)."
        ),
    )
    volume_snapshot_class_name: str | None = Field(
        default=None, description="The VolumeSnapshotClass used."
    )
    quiesced_executions: int | None = Field(
        default=None, description="Running executions paused while the snapshot was cut."
    )
