"""The controllers' decisions, fast: the workspace plan, the claim wait, what to
do with the pod, the idle policy and an Execution's start, on an in-memory Api.

The integration tier runs the same decisions against the real API server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import pytest

from sandbox_operator import effective, identity
from sandbox_operator.agent_client import AgentClient, AgentInfo
from sandbox_operator.api.execution import ExecutionStatus
from sandbox_operator.api.sandbox import SandboxSpec, SandboxStatus
from sandbox_operator.builders import sandbox as build
from sandbox_operator.clock import iso
from sandbox_operator.config import Settings
from sandbox_operator.context import OperatorContext
from sandbox_operator.handlers import execution
from sandbox_operator.handlers.sandbox import lifecycle as idle
from sandbox_operator.handlers.sandbox import pod as pods
from sandbox_operator.handlers.sandbox import workspace
from sandbox_operator.handlers.sandbox.environment import sync_environment
from sandbox_operator.handlers.sandbox.lifecycle import IdleAction
from sandbox_operator.handlers.sandbox.pod import PodAction
from sandbox_operator.handlers.sandbox.status import spec_fields
from sandbox_operator.handlers.sandbox.view import read
from sandbox_operator.handlers.sandbox.workspace import ClaimState
from sandbox_operator.resources import (
    CLAIM_FROM_SNAPSHOT,
    CLAIM_RESTORE_REQUEST,
    CLAIMS,
    EVENTS,
    RESUME_ANNOTATION,
    SANDBOXES,
    SNAPSHOTS,
    STORAGE_CLASSES,
)
from tests.unit.memorykube import MemoryKube

T = TypeVar("T")
JSON = dict[str, Any]
# The controllers compare objects' timestamps with the clock (a queued Execution
# gives up after a bound): objects made by these tests are made now.
NOW = datetime.now(UTC).replace(microsecond=0)
SETTINGS = Settings()
REF = identity.SandboxRef(name="box", namespace="ns", uid="sandbox-uid")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


EVENTS_POSTED: list[tuple[str, str, str]] = []


def context(kube: MemoryKube) -> OperatorContext:
    def post(body: JSON, kind: str, reason: str, message: str) -> None:
        EVENTS_POSTED.append((kind, reason, message))

    return OperatorContext(settings=SETTINGS, kube=kube, agents=AgentClient(timeout=1), post=post)


def sandbox_body(
    spec: JSON | None = None, status: JSON | None = None, annotations: dict[str, str] | None = None
) -> JSON:
    return {
        "metadata": {
            "name": "box",
            "namespace": "ns",
            "uid": "sandbox-uid",
            "generation": 1,
            "creationTimestamp": iso(NOW - timedelta(hours=1)),
            "annotations": annotations or {},
        },
        "spec": spec or {},
        "status": status or {},
    }


# -- the workspace plan ------------------------------------------------------------


def _ready_snapshot(kube: MemoryKube, name: str) -> None:
    kube.put(
        SNAPSHOTS.path("ns", name),
        {
            "metadata": {"name": name},
            "status": {"phase": "Ready", "volumeSnapshotName": f"vs-{name}", "lineage": ["root"]},
        },
    )


def test_no_snapshot_no_plan() -> None:
    kube = MemoryKube()
    plan = run(workspace.plan_workspace(context(kube), sandbox_body(), SandboxSpec()))
    assert plan == workspace.WorkspacePlan()
    assert kube.calls == []


def test_a_restore_waits_for_its_snapshot_without_making_an_empty_claim() -> None:
    kube = MemoryKube()
    spec = SandboxSpec.model_validate({"workspace": {"fromSnapshot": "snap"}})
    plan = run(workspace.plan_workspace(context(kube), sandbox_body(), spec))
    assert plan.hold
    assert plan.busy
    assert plan.source is None
    assert plan.condition is not None
    assert (plan.condition.reason, "does not exist" in plan.condition.message) == (
        "SnapshotNotReady",
        True,
    )


def test_a_ready_snapshot_becomes_the_source_of_a_new_claim() -> None:
    kube = MemoryKube()
    _ready_snapshot(kube, "snap")
    spec = SandboxSpec.model_validate({"workspace": {"fromSnapshot": "snap"}})
    plan = run(workspace.plan_workspace(context(kube), sandbox_body(), spec))
    assert plan.source is not None
    assert (plan.source.volume_snapshot, plan.source.lineage) == ("vs-snap", ("snap", "root"))
    assert not plan.hold
    assert plan.replace is None


def test_a_claim_from_another_snapshot_is_rolled_back() -> None:
    kube = MemoryKube()
    _ready_snapshot(kube, "snap")
    claim = kube.put(
        CLAIMS.path("ns", "box-workspace"),
        {"metadata": {"name": "box-workspace", "annotations": {CLAIM_FROM_SNAPSHOT: "older"}}},
    )
    spec = SandboxSpec.model_validate({"workspace": {"fromSnapshot": "snap"}})
    plan = run(workspace.plan_workspace(context(kube), sandbox_body(), spec))
    assert plan.hold
    assert plan.replace is not None
    assert plan.replace["metadata"]["uid"] == claim["metadata"]["uid"]
    assert plan.condition is not None
    assert plan.condition.reason == "RollingBack"


def test_a_claim_made_for_this_request_is_the_restored_workspace() -> None:
    kube = MemoryKube()
    annotations = {CLAIM_FROM_SNAPSHOT: "snap", CLAIM_RESTORE_REQUEST: "r1"}
    kube.put(CLAIMS.path("ns", "box-workspace"), {"metadata": {"annotations": annotations}})
    spec = SandboxSpec.model_validate({"workspace": {"fromSnapshot": "snap"}})
    body = sandbox_body(annotations={"sandbox.dev/restore-requested-at": "r1"})
    plan = run(workspace.plan_workspace(context(kube), body, spec))
    assert not plan.hold
    assert plan.source is None
    assert plan.fields["workspace_snapshot"] == "snap"
    # A new request for the same snapshot means: roll back once more.
    again = sandbox_body(annotations={"sandbox.dev/restore-requested-at": "r2"})
    _ready_snapshot(kube, "snap")
    assert run(workspace.plan_workspace(context(kube), again, spec)).hold


# -- whether the pod waits for its claim --------------------------------------------


def _claim(class_name: str | None, phase: str = "Pending", age: float = 1) -> JSON:
    spec = {"storageClassName": class_name} if class_name else {}
    created = iso(NOW - timedelta(seconds=age))
    meta = {"name": "box-workspace", "creationTimestamp": created}
    return {"metadata": meta, "spec": spec, "status": {"phase": phase}}


def _class(kube: MemoryKube, name: str, mode: str) -> None:
    kube.put(
        STORAGE_CLASSES.path(name=name), {"metadata": {"name": name}, "volumeBindingMode": mode}
    )


def test_claim_state() -> None:
    kube = MemoryKube()
    ctx = context(kube)
    _class(kube, "fast", "Immediate")
    _class(kube, "local", "WaitForFirstConsumer")
    assert not run(workspace.claim_state(ctx, "ns", _claim(None), NOW)).wait
    assert not run(workspace.claim_state(ctx, "ns", _claim("fast", "Bound"), NOW)).wait
    assert not run(workspace.claim_state(ctx, "ns", _claim("local"), NOW)).wait
    pending = run(workspace.claim_state(ctx, "ns", _claim("fast"), NOW))
    assert pending.wait
    assert pending.problem is None
    missing = run(workspace.claim_state(ctx, "ns", _claim("nope"), NOW))
    assert missing.wait
    assert missing.problem == "StorageClass 'nope' does not exist"
    # Pending for a while: the newest Warning on the claim says why.
    kube.put(
        f"{EVENTS.path('ns')}/e1",
        {
            "metadata": {"name": "e1"},
            "involvedObject": {"kind": "PersistentVolumeClaim", "name": "box-workspace"},
            "type": "Warning",
            "reason": "ProvisioningFailed",
            "message": "disk quota exceeded",
            "lastTimestamp": iso(NOW),
        },
    )
    stuck = run(workspace.claim_state(ctx, "ns", _claim("fast", age=60), NOW))
    assert stuck.problem == "ProvisioningFailed: disk quota exceeded"


# -- what to do with the pod ------------------------------------------------------------

SPEC = SandboxSpec.model_validate({"runtime": "python"})


def _pod(spec: SandboxSpec = SPEC, **status: Any) -> JSON:
    pod = build.desired_pod(REF, spec, SETTINGS)
    pod["metadata"]["uid"] = "pod-uid"
    pod["status"] = {"phase": "Running", **status}
    return pod


def decide(pod: JSON | None, spec: SandboxSpec = SPEC, **kw: Any) -> pods.PodDecision:
    args: dict[str, Any] = {
        "paused": False,
        "hold": False,
        "claim": ClaimState(),
        "status": SandboxStatus(),
        "now": NOW,
        "agent_patience": timedelta(minutes=2),
    }
    args.update(kw)
    return pods.decide_pod(pod, spec, **args)


def test_pod_decisions() -> None:
    assert decide(None).action is PodAction.CREATE
    assert decide(None, claim=ClaimState(wait=True)).action is PodAction.KEEP
    assert decide(_pod(), paused=True).action is PodAction.DELETE
    assert decide(_pod(), hold=True).action is PodAction.DELETE
    assert decide(_pod()).action is PodAction.KEEP
    bigger = SandboxSpec.model_validate({"runtime": "python", "resources": {"cpu": "2"}})
    replaced = decide(_pod(), bigger)
    assert replaced.action is PodAction.REPLACE
    assert replaced.why == "spec.resources changed, which needs a new pod"
    env_only = SandboxSpec.model_validate(
        {"runtime": "python", "env": [{"name": "A", "value": "1"}]}
    )
    assert decide(_pod(), env_only).action is PodAction.KEEP


def test_an_ended_pod_is_replaced_saying_why() -> None:
    evicted = _pod(phase="Succeeded", reason="Evicted", message="ephemeral storage exceeded")
    decision = decide(evicted)
    assert decision.action is PodAction.REPLACE
    assert decision.why == "evicted by the kubelet: ephemeral storage exceeded"


def test_the_unbound_claim_workaround_needs_a_bound_claim() -> None:
    message = "0/1 nodes are available: pod has unbound immediate PersistentVolumeClaims."
    since = iso(NOW - timedelta(minutes=1))
    cond = {"type": "PodScheduled", "status": "False", "message": message}
    stuck = _pod(phase="Pending", conditions=[{**cond, "lastTransitionTime": since}])
    pending = ClaimState(claim={"status": {"phase": "Pending"}})
    bound = ClaimState(claim={"status": {"phase": "Bound"}})
    assert decide(stuck, claim=pending).action is PodAction.KEEP
    assert decide(stuck, claim=bound).action is PodAction.REPLACE


def _stalled_pod() -> JSON:
    return _pod(
        initContainerStatuses=[{"name": "agent", "ready": False, "state": {"running": {}}}],
        containerStatuses=[{"name": "sandbox", "ready": True, "state": {"running": {}}}],
    )


def _agent_not_ready_since(minutes: float, ready_pod: str | None) -> SandboxStatus:
    since = iso(NOW - timedelta(minutes=minutes))
    return SandboxStatus.model_validate(
        {
            "readyPodUID": ready_pod,
            "conditions": [
                {
                    "type": "AgentReady",
                    "status": "False",
                    "reason": "AgentNotReady",
                    "lastTransitionTime": since,
                }
            ],
        }
    )


def test_a_pod_whose_agent_stopped_serving_is_replaced_after_the_patience() -> None:
    pod = _stalled_pod()
    decision = decide(pod, status=_agent_not_ready_since(3, "pod-uid"))
    assert decision.action is PodAction.REPLACE
    assert "agent has not been ready for 180s" in decision.why
    assert decide(pod, status=_agent_not_ready_since(1, "pod-uid")).action is PodAction.KEEP
    # A pod that never served is not replaced in a loop.
    assert decide(pod, status=_agent_not_ready_since(3, None)).action is PodAction.KEEP


def test_a_pod_of_an_older_operator_is_adopted_or_replaced() -> None:
    legacy = build.build_pod(REF, SPEC, SETTINGS)
    legacy["metadata"]["uid"] = "pod-uid"
    legacy["status"] = {"phase": "Running"}
    legacy["metadata"]["annotations"]["sandbox.dev/pod-spec-hash"] = build.legacy_pod_hash(SPEC)
    assert decide(legacy).action is PodAction.ADOPT
    other = SandboxSpec.model_validate({"runtime": "node"})
    assert decide(legacy, other).action is PodAction.REPLACE


# -- the idle policy -------------------------------------------------------------------


def _info(idle_for: float, active: int = 0) -> AgentInfo:
    return AgentInfo(NOW - timedelta(seconds=idle_for), active, "v", True)


def lifecycle(spec: JSON, info: AgentInfo | None, **kw: Any) -> idle.LifecycleDecision:
    status = SandboxStatus.model_validate(kw.pop("status", {}))
    return idle.decide_lifecycle(
        SandboxSpec.model_validate(spec), status, info, kw.pop("resumed_at", None), NOW, SETTINGS
    )


def test_lifecycle_decisions() -> None:
    idle = {"lifecycle": {"idleTimeout": "10m"}}
    assert lifecycle(idle, _info(60)).action is IdleAction.NONE
    assert lifecycle(idle, _info(60)).fields["idle_deadline"] == iso(NOW + timedelta(minutes=9))
    assert lifecycle(idle, _info(3600)).action is IdleAction.IDLE
    # A running command is activity; an unknown activity is never idleness.
    assert lifecycle(idle, _info(3600, active=1)).action is IdleAction.NONE
    assert lifecycle(idle, None).action is IdleAction.NONE
    # A resume request counts as activity: a fresh pod is not paused before work arrives.
    assert lifecycle(idle, _info(3600), resumed_at=NOW).action is IdleAction.NONE
    expired = {"expiresAt": iso(NOW - timedelta(seconds=1))}
    assert lifecycle(idle, _info(0), status=expired).action is IdleAction.DELETE


def test_the_lease_ends_the_sandbox_as_on_expiry_says() -> None:
    ended = iso(NOW - timedelta(seconds=1))
    lease = {"lifecycle": {"expiresAt": ended}}
    assert lifecycle(lease, _info(0), status={"expiresAt": ended}).action is IdleAction.DELETE
    pause = {"lifecycle": {"expiresAt": ended, "onExpiry": "Pause"}}
    assert lifecycle(pause, _info(0), status={"expiresAt": ended}).action is (
        IdleAction.EXPIRE_PAUSE
    )
    # The max lifetime ended first: deleted, whatever the lease would have done.
    earlier = iso(NOW - timedelta(minutes=5))
    assert lifecycle(pause, _info(0), status={"expiresAt": earlier}).action is IdleAction.DELETE
    # Before its end a leased sandbox is not ended by the default idle timeout...
    later = {"lifecycle": {"expiresAt": iso(NOW + timedelta(hours=1))}}
    assert SETTINGS.default_idle_timeout
    assert lifecycle(later, _info(86400)).action is IdleAction.NONE
    # ...but by an idle timeout its spec sets.
    later["lifecycle"]["idleTimeout"] = "10m"
    assert lifecycle(later, _info(3600)).action is IdleAction.IDLE


def status_fields(body: JSON, spec: SandboxSpec) -> JSON:
    return spec_fields(body, spec, SETTINGS)


def test_status_expires_at_is_the_earlier_of_lease_and_max_lifetime() -> None:
    created = sandbox_body()
    created["metadata"]["creationTimestamp"] = iso(NOW)
    lease = iso(NOW + timedelta(minutes=5))
    spec = SandboxSpec.model_validate({"lifecycle": {"expiresAt": lease, "maxLifetime": "1h"}})
    assert status_fields(created, spec)["expires_at"] == lease
    spec = SandboxSpec.model_validate({"lifecycle": {"expiresAt": lease, "maxLifetime": "1m"}})
    assert status_fields(created, spec)["expires_at"] == iso(NOW + timedelta(minutes=1))


def test_idleness_counts_from_readiness_at_the_earliest() -> None:
    """A sandbox that just became Ready is not idle, however old its agent is."""
    spec = {"lifecycle": {"idleTimeout": "10s"}}
    just_ready = {
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "SandboxReady",
                "lastTransitionTime": iso(NOW),
            }
        ]
    }
    assert lifecycle(spec, _info(60)).action is IdleAction.IDLE
    decision = lifecycle(spec, _info(60), status=just_ready)
    assert decision.action is IdleAction.NONE
    assert decision.fields["idle_deadline"] == iso(NOW + timedelta(seconds=10))
    # So the pass that makes it Ready needs no word from the agent (a claim writes
    # Ready without that round trip), and the deadline is the same.
    assert idle.became_ready(SandboxStatus.model_validate(just_ready), NOW)
    asked = lifecycle(spec, None, status=just_ready)
    assert asked.action is IdleAction.NONE
    assert asked.fields == {
        "last_activity": iso(NOW),
        "idle_deadline": iso(NOW + timedelta(seconds=10)),
        "active_executions": 0,  # as the next pass hears from the agent: no second write
    }
    earlier = {
        "conditions": [
            {**just_ready["conditions"][0], "lastTransitionTime": iso(NOW - timedelta(seconds=5))}
        ]
    }
    assert not idle.became_ready(SandboxStatus.model_validate(earlier), NOW)
    assert lifecycle(spec, None, status=earlier).fields == {}


@pytest.mark.parametrize("on_idle", ["Pause", "Delete"])
def test_the_idle_snapshot_comes_first(on_idle: str) -> None:
    spec = {"lifecycle": {"idleTimeout": "1m", "onIdle": on_idle, "snapshotOnIdle": True}}
    assert lifecycle(spec, _info(3600)).action is IdleAction.SNAPSHOT
    # Deleting waits for it as pausing does: a delete cannot be taken back.
    taking = {"idleSnapshot": "box-idle-1"}
    assert lifecycle(spec, _info(3600), status=taking).action is IdleAction.WAIT_SNAPSHOT
    # Once taking it, the snapshot's own flush is not the user coming back.
    assert lifecycle(spec, _info(1), status=taking).action is IdleAction.WAIT_SNAPSHOT


# -- an Execution's start ---------------------------------------------------------------


class _Never:
    def is_set(self) -> bool:
        return False


def _execution(spec: JSON, name: str = "job") -> JSON:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"{name}-0000-uid",
            "generation": 1,
            # The real clock's now, not the module's NOW: the Execution controller
            # measures its wait bound against the real clock, and a test session
            # may start long after this module was imported (collection builds).
            "creationTimestamp": iso(datetime.now(UTC)),
        },
        "spec": spec,
    }


def start(
    kube: MemoryKube, body: JSON, sandboxes: dict[Any, Any], slots: dict[Any, Any] | None = None
) -> ExecutionStatus:
    kube.put(f"{execution_path()}/{body['metadata']['name']}", body)
    run_ = execution.Run(
        context(kube),
        execution.Scheduler(),
        body,  # type: ignore[arg-type]
        sandboxes,
        slots or {},
        _Never(),  # type: ignore[arg-type]
        logging.getLogger("test"),
        {},
    )
    from sandbox_operator.api.execution import ExecutionSpec

    run_.spec = ExecutionSpec.model_validate(body["spec"])
    run(run_.start())
    return run_.status


def execution_path() -> str:
    from sandbox_operator.resources import EXECUTIONS

    return EXECUTIONS.path("ns")


def _sandbox(status: JSON, spec: JSON | None = None) -> dict[Any, Any]:
    body = sandbox_body(spec or {"runtime": "python"}, status)
    return {("ns", "box"): [body]}


def test_a_one_shot_execution_creates_its_sandbox_and_waits() -> None:
    kube = MemoryKube()
    body = _execution({"sandboxTemplate": {"runtime": "python"}, "script": "true"}, "j" * 253)
    status = start(kube, body, {})
    assert (status.phase, status.reason) == ("Queued", "SandboxStarting")
    created = [path for verb, path in kube.writes() if verb == "POST"]
    assert created == [SANDBOXES.path("ns")]


def test_an_idle_paused_sandbox_is_resumed_and_a_paused_one_is_not() -> None:
    kube = MemoryKube()
    kube.put(SANDBOXES.path("ns", "box"), sandbox_body())
    ref = {"sandboxRef": {"name": "box"}, "script": "true"}
    idle = _sandbox({"phase": "Paused", "idlePausedAt": iso(NOW)})
    status = start(kube, _execution(ref), idle)
    assert (status.phase, status.reason, status.sandbox_resumed) == (
        "Queued",
        "SandboxResuming",
        True,
    )
    annotations = kube.objects[SANDBOXES.path("ns", "box")]["metadata"]["annotations"]
    assert RESUME_ANNOTATION in annotations

    kube = MemoryKube()
    paused = _sandbox({"phase": "Paused"}, {"runtime": "python", "paused": True})
    status = start(kube, _execution(ref), paused)
    assert status.reason == "SandboxPaused"
    assert not [c for c in kube.writes() if SANDBOXES.path("ns", "box") == c[1]]


def test_executions_beyond_the_limit_queue_and_a_failed_sandbox_fails_them() -> None:
    running = _sandbox({"phase": "Running", "agentEndpoint": "http://127.0.0.1:1", "podUID": "p"})
    slots = {
        ("ns", "box"): [
            {"name": f"r{i}", "created": "t0", "started": True, "done": False}
            for i in range(SETTINGS.max_executions_per_sandbox)
        ]
    }
    ref = {"sandboxRef": {"name": "box"}, "script": "true"}
    status = start(MemoryKube(), _execution(ref), running, slots)
    assert (status.phase, status.reason) == ("Queued", "ConcurrencyLimit")
    failed = _sandbox(
        {
            "phase": "Failed",
            "conditions": [
                {
                    "type": "Ready",
                    "status": "False",
                    "reason": "RuntimeMissingPython",
                    "message": "no python3",
                }
            ],
        }
    )
    status = start(MemoryKube(), _execution(ref), failed)
    assert (status.phase, status.reason) == ("Failed", "SandboxFailed")
    assert status.message == "sandbox box failed: no python3"


def test_effectively_paused() -> None:
    spec = SandboxSpec()
    idle = {"idlePausedAt": iso(NOW)}
    assert not effective.effectively_paused(sandbox_body(), spec)
    assert effective.effectively_paused(sandbox_body(status=idle), spec)
    later = {RESUME_ANNOTATION: iso(NOW + timedelta(seconds=1))}
    earlier = {RESUME_ANNOTATION: iso(NOW - timedelta(seconds=1))}
    assert not effective.effectively_paused(sandbox_body(status=idle, annotations=later), spec)
    assert effective.effectively_paused(sandbox_body(status=idle, annotations=earlier), spec)
    assert effective.effectively_paused(sandbox_body(), SandboxSpec(paused=True))


def test_an_eviction_recorded_only_in_an_event_is_still_named() -> None:
    """The pod ended Succeeded (its containers stopped cleanly); the kubelet's
    Evicted Event says what happened."""
    kube = MemoryKube()
    pod = _pod(phase="Succeeded")
    pod["metadata"]["namespace"] = "ns"
    assert run(pods.with_eviction(context(kube), pod)) == pod
    message = "Pod ephemeral local storage usage exceeds the total limit of containers 64Mi."
    kube.put(
        f"{EVENTS.path('ns')}/box.evicted",
        {
            "metadata": {"name": "box.evicted"},
            "involvedObject": {"kind": "Pod", "name": "box", "uid": "pod-uid"},
            "type": "Warning",
            "reason": "Evicted",
            "message": message,
        },
    )
    evicted = run(pods.with_eviction(context(kube), pod))
    assert evicted is not None
    assert decide(evicted).why == f"evicted by the kubelet: {message}"


def test_what_the_operator_remembers_of_a_sandbox_goes_with_it() -> None:
    """Per-Sandbox memory is keyed by the Sandbox and dropped by forget(): the
    environment given to its pod's agent was kept by pod UID, for ever."""
    ctx = context(MemoryKube())
    ctx.environments[("ns", "sandbox-uid")] = ("pod-1", "[]")
    ctx.environments[("ns", "other-uid")] = ("pod-2", "[]")
    ctx.pool_decisions[("ns", "sandbox-uid")] = {}
    ctx.forget("ns", "box", "sandbox-uid")
    assert ctx.environments == {("ns", "other-uid"): ("pod-2", "[]")}
    assert ctx.pool_decisions == {}


def test_a_claimer_starts_from_its_members_record_of_the_agents_env() -> None:
    """What the operator gave a pod's agent is kept by the Sandbox that owns the
    pod: a claimer without env of its own finds its member's record and asks
    neither the API server (the agent's token) nor the agent before it is Ready."""
    kube = MemoryKube()
    ctx = context(kube)
    member = identity.SandboxRef(name="member", namespace="ns", uid="member-uid")
    pod = build.desired_pod(member, SPEC, SETTINGS)
    pod["metadata"]["uid"] = "pod-uid"
    ctx.environments[("ns", "member-uid")] = ("pod-uid", "[]")
    pool = {
        "name": "warm",
        "outcome": "Claimed",
        "templateRef": {"name": "python"},
        "member": "member",
        "memberUid": "member-uid",
    }
    claimer = sandbox_body({"runtime": "python"}, {"pool": pool})
    view = read(claimer, SETTINGS, pod=pod, claim=None)
    assert view.served_by == member
    run(sync_environment(ctx, view, pod, "http://127.0.0.1:9"))
    assert kube.calls == []
    # A claimer with env of its own is not what the member's agent was given.
    with_env = sandbox_body(
        {"runtime": "python", "env": [{"name": "TASK", "value": "x"}]}, {"pool": pool}
    )
    run(
        sync_environment(
            ctx, read(with_env, SETTINGS, pod=pod, claim=None), pod, "http://127.0.0.1:9"
        )
    )
    assert ("GET", "/api/v1/namespaces/ns/secrets/member-agent-token") in kube.calls
