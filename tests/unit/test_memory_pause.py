"""pauseMode Memory: the spec's rules, the resumed pod's shape and MemoryKept,
as pure functions (the e2e test drives the whole on the gVisor node)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from sandbox_operator import identity
from sandbox_operator.api.sandbox import (
    MemoryImage,
    SandboxReason,
    SandboxSpec,
    SandboxStatus,
)
from sandbox_operator.builders import sandbox as build
from sandbox_operator.builders.conditions import FALSE, TRUE, Cond
from sandbox_operator.config import Settings
from sandbox_operator.handlers.execution import carried_on
from sandbox_operator.handlers.sandbox import memory
from sandbox_operator.handlers.sandbox.status import Blocked
from sandbox_operator.resources import RESTORE_FROM_ANNOTATION

REF = identity.SandboxRef(name="box", namespace="ns", uid="sandbox-uid")
SETTINGS = Settings()
IMAGE = MemoryImage(
    key="0f6e-pod",
    node="node-a",
    pod_uid="0f6e-pod",
    bytes=300 << 20,
    taken_at="2026-11-30T12:00:00Z",
)


def spec(**lifecycle: Any) -> SandboxSpec:
    return SandboxSpec.model_validate(
        {"runtimeClassName": "gvisor", "lifecycle": {"pauseMode": "Memory", **lifecycle}}
    )


def test_memory_needs_a_runtime_class_and_a_persistent_workspace() -> None:
    with pytest.raises(ValidationError, match="pauseMode: Memory needs runtimeClassName"):
        SandboxSpec.model_validate({"lifecycle": {"pauseMode": "Memory"}})
    with pytest.raises(ValidationError, match="needs a persistent workspace"):
        SandboxSpec.model_validate(
            {
                "runtimeClassName": "gvisor",
                "workspace": {"ephemeral": True},
                "lifecycle": {"pauseMode": "Memory"},
            }
        )
    assert SandboxSpec.model_validate({}).lifecycle.pause_mode == "Workspace"


def test_a_class_checkpointd_cannot_save_is_an_invalid_spec() -> None:
    memory.check_runtime(spec(), ["gvisor"])
    kata = SandboxSpec.model_validate(
        {"runtimeClassName": "kata", "lifecycle": {"pauseMode": "Memory"}}
    )
    with pytest.raises(Blocked) as refused:
        memory.check_runtime(kata, ["gvisor"])
    assert refused.value.reason == SandboxReason.INVALID_SPEC
    assert "memory_pause_runtime_classes" in str(refused.value.message)
    memory.check_runtime(SandboxSpec.model_validate({"runtimeClassName": "kata"}), ["gvisor"])


def test_a_resumed_pod_names_its_image_and_runs_on_its_node() -> None:
    fresh = build.desired_pod(REF, spec(), SETTINGS)
    restored = build.desired_pod(REF, spec(), SETTINGS, IMAGE)
    assert RESTORE_FROM_ANNOTATION not in fresh["metadata"]["annotations"]
    assert "affinity" not in fresh["spec"]
    assert restored["metadata"]["annotations"][RESTORE_FROM_ANNOTATION] == IMAGE.key
    terms = restored["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [
        {
            "matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-a"]}
            ]
        }
    ]
    # The same pod otherwise: the image restores into the shape it was taken from.
    del restored["metadata"]["annotations"][RESTORE_FROM_ANNOTATION]
    del restored["spec"]["affinity"]
    assert restored == fresh
    assert build.changed_fields(build.desired_pod(REF, spec(), SETTINGS, IMAGE), spec()) == []


def test_memory_kept_follows_the_image_and_the_verdicts() -> None:
    running = SandboxStatus()
    assert memory.condition(SandboxSpec.model_validate({}), running, None) is None
    assert memory.condition(spec(), running, None) is None  # never paused yet
    held = memory.condition(spec(), running.evolve(memory=IMAGE), None)
    assert held is not None
    assert (held.status, held.reason) == (TRUE, SandboxReason.CHECKPOINTED)
    assert "node node-a (300 MiB)" in held.message
    failed = Cond("MemoryKept", FALSE, SandboxReason.CHECKPOINT_FAILED, "no")
    assert memory.condition(spec(), running, failed) == failed
    # A verdict stays until the next pause says something else.
    after = running.evolve(
        conditions=[
            {
                "type": "MemoryKept",
                "status": "False",
                "reason": "MemoryLost",
                "message": "started afresh",
                "lastTransitionTime": "2026-11-30T12:00:00Z",
            }
        ]
    )
    kept = memory.condition(spec(), after, None)
    assert kept == Cond("MemoryKept", FALSE, SandboxReason.MEMORY_LOST, "started afresh")


def test_only_a_running_pod_on_a_node_is_worth_saving() -> None:
    pod: dict[str, Any] = {
        "metadata": {"uid": "u"},
        "spec": {"nodeName": "node-a"},
        "status": {"phase": "Running"},
    }
    assert memory.running_on(pod) == "node-a"
    assert memory.running_on(None) is None
    assert memory.running_on({**pod, "status": {"phase": "Pending"}}) is None
    assert memory.running_on({**pod, "spec": {}}) is None
    leaving = {**pod, "metadata": {"uid": "u", "deletionTimestamp": "2026-11-30T12:00:00Z"}}
    assert memory.running_on(leaving) is None


def test_the_agents_volumes_live_in_gvisors_memory_when_memory_is_kept() -> None:
    """A restore reopens the files its processes had open: the agent's journal
    and logs must come back with the image, not from a new pod's empty emptyDir."""
    kept = build.desired_pod(REF, spec(), SETTINGS)["metadata"]["annotations"]
    plain_spec = SandboxSpec.model_validate({"runtimeClassName": "gvisor"})
    plain = build.desired_pod(REF, plain_spec, SETTINGS)["metadata"]["annotations"]
    for volume in ("agent-logs", "agent-tmp"):
        assert kept[f"dev.gvisor.spec.mount.{volume}.type"] == "tmpfs"
        assert kept[f"dev.gvisor.spec.mount.{volume}.share"] == "container"
        assert f"dev.gvisor.spec.mount.{volume}.type" not in plain
    # Switching a sandbox to Memory takes a new pod (its volumes change).
    assert build.changed_fields(build.desired_pod(REF, plain_spec, SETTINGS), spec()) == [
        "pauseMode"
    ]


def test_an_execution_follows_its_processes_into_the_restored_pod() -> None:
    saved = IMAGE.pod_uid
    # Paused: the image of its pod is kept; so while the resumed pod is unconfirmed.
    assert carried_on(SandboxStatus(memory=IMAGE), saved) is False
    assert carried_on(SandboxStatus().evolve(memory=IMAGE, pod_uid="new-pod"), saved) is False
    # Restored from that image: the same processes, in the new pod.
    restored = SandboxStatus().evolve(pod_uid="new-pod", processes_from=saved)
    assert carried_on(restored, saved) is True
    # Gone: another pod's image, a fresh start, no image at all, nothing recorded.
    other = IMAGE.model_copy(update={"pod_uid": "other-pod"})
    assert carried_on(SandboxStatus().evolve(memory=other, pod_uid="new-pod"), saved) is None
    assert carried_on(SandboxStatus().evolve(pod_uid="new-pod"), saved) is None
    assert (
        carried_on(SandboxStatus().evolve(pod_uid="new-pod", processes_from="other-pod"), saved)
        is None
    )
    assert carried_on(restored, None) is None
