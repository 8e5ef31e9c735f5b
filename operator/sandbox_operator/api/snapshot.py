"""The Snapshot resource: a sandbox workspace captured as a CSI VolumeSnapshot."""

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

    sandbox_ref: LocalObjectReference
    tag: Annotated[str | None, Field(max_length=128, pattern=r"^[A-Za-z0-9][-._A-Za-z0-9]*$")] = (
        None
    )
    description: Annotated[str | None, Field(max_length=1024)] = None
    volume_snapshot_class_name: Annotated[
        str | None, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)
    ] = Field(default=None, description="Defaults to the operator's configured class.")
    quiesce: bool = Field(
        default=False, description="Pause running executions' writes while the snapshot is cut."
    )
    retain_policy: RetainPolicy = RetainPolicy.DELETE


class SnapshotStatus(Model):
    model_config = ConfigDict(extra="ignore")

    phase: str | None = None
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    volume_snapshot_name: str | None = None
    ready_to_use: bool | None = None
    restore_size: str | None = None
    creation_time: str | None = None
    source_sandbox: str | None = None
    lineage: list[str] = Field(
        default_factory=list,
        description=(
            "The Snapshot the source sandbox's workspace was restored from, then the one"
            " that Snapshot's source came from, and so on (nearest first)."
        ),
    )
    volume_snapshot_class_name: str | None = None
    quiesced_executions: int | None = Field(
        default=None, description="Running executions paused while the snapshot was cut."
    )
