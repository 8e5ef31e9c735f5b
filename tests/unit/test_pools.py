"""Pure decisions of SandboxPool: member choice, refill plan, counts, Ready."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from sandbox_operator.api.pool import PoolReason, SandboxPoolSpec, WhenEmpty
from sandbox_operator.builders.pool import (
    Member,
    MemberState,
    choose_member,
    claim_patch,
    claimed_by,
    claimed_count,
    counts,
    member_of,
    members_of,
    owned_member,
    pod_alive,
    pool_links,
    ready_condition,
    refill_plan,
    stuck_member,
)
from sandbox_operator.handlers.sandbox.pool_claim import (
    Decisions,
    Reservations,
    release,
    remember,
    reserved_by_others,
    with_decision,
)
from sandbox_operator.identity import children_ref

JSON = dict[str, Any]

R, C, F, X = MemberState.READY, MemberState.CREATING, MemberState.FAILED, MemberState.CLAIMED


def m(name: str, state: MemberState = R, gen: int = 1, alive: bool = True, at: str = "") -> Member:
    return Member(name, state, gen, pod_alive=alive, created=at or name)


def test_spec_defaults_and_bounds() -> None:
    spec = SandboxPoolSpec.model_validate({"templateRef": {"name": "py"}})
    assert (spec.replicas, spec.max_creating, spec.when_empty) == (1, 5, WhenEmpty.COLD_START)
    with pytest.raises(ValidationError):
        SandboxPoolSpec.model_validate({"templateRef": {"name": "py"}, "replicas": -1})
    with pytest.raises(ValidationError):
        SandboxPoolSpec.model_validate({"templateRef": {"name": "py"}, "whenEmpty": "Later"})


def test_choose_takes_oldest_ready_of_current_template() -> None:
    members = [m("c", at="3"), m("a", C, at="1"), m("b", at="2"), m("old", gen=0, at="0")]
    chosen = choose_member(members, template_generation=1)
    assert chosen is not None
    assert chosen.name == "b"


def test_choose_skips_dead_pod_and_lost_races() -> None:
    members = [m("a", alive=False), m("b"), m("c")]
    chosen = choose_member(members, 1, skip=["b"])
    assert chosen is not None
    assert chosen.name == "c"


def test_choose_on_empty_pool_is_none() -> None:
    assert choose_member([m("a", C), m("b", X), m("c", F)], 1) is None


def test_refill_creates_up_to_pace() -> None:
    assert refill_plan([], replicas=10, max_creating=3, template_generation=1).create == 3
    plan = refill_plan([m("a", C), m("b")], replicas=10, max_creating=3, template_generation=1)
    assert (plan.create, plan.delete) == (2, ())


def test_claimed_members_do_not_count() -> None:
    plan = refill_plan([m("a", X), m("b", X), m("c")], 3, 5, 1)
    assert plan.create == 2


def test_failed_members_are_kept_and_pace_the_refill() -> None:
    # A failing member is not churned: its Sandbox retries its pod; it counts as in flight.
    plan = refill_plan([m("a", F), m("b", alive=False), m("c")], 5, 2, 1)
    assert plan.delete == ()
    assert plan.create == 1
    # One failed member of three is replaced; once maxCreating have failed, no more.
    assert refill_plan([m("a", F), m("b"), m("c")], 3, 5, 1).create == 1
    assert refill_plan([m("a", F), m("b", F)], 3, 2, 1).create == 0
    # The replacement of a failed member is not surplus (whatever the creation
    # order); the failed one goes once healthy members fill the pool.
    starting = refill_plan([m("x", F, at="1"), m("k", C, at="1")], 1, 5, 1)
    assert (starting.create, starting.delete) == (0, ())
    assert refill_plan([m("x", F), m("k")], 1, 5, 1).delete == ("x",)


def test_scale_down_removes_creating_then_newest_ready() -> None:
    members = [m("a", at="1"), m("b", at="2"), m("c", at="3"), m("d", C, at="4")]
    assert refill_plan(members, 2, 5, 1).delete == ("d", "c")


def test_template_change_rolls_one_stale_per_ready_replacement() -> None:
    old = [m("o1", gen=1, at="1"), m("o2", gen=1, at="2")]
    start = refill_plan(old, 2, 1, template_generation=2)
    assert (start.create, start.delete) == (1, ())
    one_new = [*old, m("n1", gen=2, at="3")]
    assert refill_plan(one_new, 2, 1, 2).delete == ("o1",)
    both_new = [*old, m("n1", gen=2, at="3"), m("n2", gen=2, at="4")]
    assert refill_plan(both_new, 2, 1, 2).delete == ("o1", "o2")


def test_counts() -> None:
    members = [m("a"), m("b", C), m("c", X), m("d", alive=False), m("e", gen=0)]
    got = counts(members, 1)
    # Unclaimed: a, b, d, e; claimable: a (d's pod is gone, e is of an old template).
    assert (got.replicas, got.ready, got.creating) == (4, 1, 1)


@pytest.mark.parametrize(
    ("kwargs", "status", "reason", "names"),
    [
        ({"template_found": False}, "False", PoolReason.TEMPLATE_NOT_FOUND, "py"),
        ({"template_has_python": False}, "False", PoolReason.TEMPLATE_WITHOUT_PYTHON, "python3"),
        (
            {"failing_member": "pool-x1", "failure": "ImagePullBackOff"},
            "False",
            PoolReason.MEMBER_FAILING,
            "pool-x1",
        ),
        ({"ready": 1}, "False", PoolReason.FILLING, "1/2"),
        (
            {"ready": 1, "stuck": "member w-1: Unschedulable: cpu"},
            "False",
            PoolReason.FILLING,
            "w-1",
        ),
        ({"ready": 2}, "True", PoolReason.FULL, "2/2"),
    ],
)
def test_ready_condition(kwargs: dict[str, object], status: str, reason: str, names: str) -> None:
    base: dict[str, object] = {
        "template_found": True,
        "template_name": "py",
        "template_has_python": True,
        "replicas": 2,
        "ready": 0,
    }
    cond = ready_condition(**{**base, **kwargs})  # type: ignore[arg-type]
    assert (cond.status, cond.reason) == (status, reason)
    assert names in cond.message


def member_body(
    name: str,
    *,
    ready: str | None = "True",
    reason: str = "SandboxReady",
    owner_kind: str = "SandboxPool",
    pinned: int | None = None,
    annotated: int = 4,
) -> JSON:
    status: JSON = {}
    if ready is not None:
        status["conditions"] = [{"type": "Ready", "status": ready, "reason": reason}]
    if pinned is not None:
        status["template"] = {"kind": "SandboxTemplate", "name": "py", "generation": pinned}
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "resourceVersion": "41",
            "creationTimestamp": "2026-11-26T00:00:00Z",
            "labels": {"sandbox.dev/pool": "warm"} if owner_kind == "SandboxPool" else {},
            "annotations": {"sandbox.dev/template-generation": str(annotated)},
            "ownerReferences": [
                {"kind": owner_kind, "name": "o", "uid": "uid-owner", "controller": True}
            ],
        },
        "status": status,
    }


def test_member_state_from_its_sandbox() -> None:
    assert member_of(member_body("a")).state is R
    assert member_of(member_body("b", ready=None)).state is C
    assert member_of(member_body("c", ready="False", reason="PodPending")).state is C
    failing = member_body("d", ready="False", reason="RuntimeMissingPython")
    assert member_of(failing).state is F
    assert member_of(member_body("e", owner_kind="Sandbox")).state is X
    # Pinned generation wins over the one the pool annotated at creation.
    assert member_of(member_body("f", pinned=7)).template_generation == 7
    assert member_of(member_body("g")).template_generation == 4


def test_the_claim_is_one_conditional_write_of_the_owner() -> None:
    member = member_body("warm-abc12")
    claimer = {"metadata": {"name": "agent-1", "namespace": "ns", "uid": "uid-agent"}}
    patch = claim_patch(member, claimer)
    assert patch["metadata"]["resourceVersion"] == "41"
    assert patch["metadata"]["labels"] == {"sandbox.dev/pool": None}
    (owner,) = patch["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("Sandbox", "uid-agent", True)
    assert set(patch) == {"metadata"}, "no spec or status change: no handler of the member runs"
    assert claimed_by({**member, **patch}) is not None


def test_children_ref_follows_the_claimed_member() -> None:
    body: JSON = {"metadata": {"name": "agent-1", "namespace": "ns", "uid": "uid-agent"}}
    assert children_ref(body).name == "agent-1"
    body["status"] = {"pool": {"name": "warm", "outcome": "ColdStart"}}
    assert children_ref(body).uid == "uid-agent"
    body["status"]["pool"] |= {"outcome": "Claimed", "member": "warm-abc12", "memberUid": "m"}
    assert (children_ref(body).name, children_ref(body).uid) == ("warm-abc12", "m")


def test_a_member_is_ready_to_claim_only_with_a_ready_pod() -> None:
    pods = {
        ("ns", "a"): [
            {"metadata": {}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
        ],
        ("ns", "b"): [{"metadata": {"deletionTimestamp": "x"}, "status": {}}],
        ("ns", "c"): [{"metadata": {}, "status": {"phase": "Pending"}}],
    }
    assert pod_alive(pods, "ns", "a")
    assert not pod_alive(pods, "ns", "b")
    assert not pod_alive(pods, "ns", "c")
    assert not pod_alive(pods, "ns", "missing")


def test_a_member_the_cluster_holds_back_is_named() -> None:
    """A member waiting on the node, a quota or a claim: Filling says which and why."""
    starting = member_body("w-1", ready="False", reason="AgentNotReady")
    assert stuck_member([member_body("w-0"), starting]) == ""
    held = member_body("w-2", ready="False", reason="Unschedulable")
    held["status"]["conditions"][0]["message"] = "0/1 nodes are available: 1 Insufficient cpu."
    assert stuck_member([member_body("w-0"), starting, held]) == (
        "member w-2: Unschedulable: 0/1 nodes are available: 1 Insufficient cpu."
    )


def test_a_claim_is_never_held_back_by_its_own_reservation() -> None:
    """A claim that lost a member (not ready yet) takes it on its next pass; other
    claims of the process keep skipping members still being taken."""
    reserved: Reservations = {("ns", "w-0"): (1.0, "me"), ("ns", "w-1"): (1.0, "other")}
    reserved[("elsewhere", "w-2")] = (1.0, "other")
    assert reserved_by_others(reserved, "ns", "me") == ["w-1"]
    release(reserved, ("ns", "w-1"), "me")  # another claim's: kept
    release(reserved, ("ns", "w-0"), "me")
    release(reserved, ("ns", "gone"), "me")
    assert reserved == {("ns", "w-1"): (1.0, "other"), ("elsewhere", "w-2"): (1.0, "other")}
    assert reserved_by_others(reserved, "ns", "other") == []


def test_a_pass_with_an_older_body_takes_up_the_decision_made() -> None:
    """A claim's outcome goes out with Kopf's patch after the handler; a pass that
    runs on a body from before it must not decide again (a cold start announced
    and a member claimed for one Sandbox)."""
    decisions: Decisions = {}
    old: JSON = {"metadata": {"namespace": "ns", "name": "s", "uid": "u1"}, "status": {}}
    cold = {"outcome": "ColdStart", "name": "warm", "message": "no ready member"}
    remember(decisions, {**old, "status": {"phase": "Pending", "pool": cold, "template": None}})
    assert decisions == {("ns", "u1"): {"pool": cold}}
    assert with_decision(decisions, old)["status"] == {"pool": cold}
    namesake = {"metadata": {**old["metadata"], "uid": "u2"}, "status": {}}
    assert with_decision(decisions, namesake) == namesake
    # Written: the status holds from then on, and the memory goes.
    written = {**old, "status": {"pool": {**cold, "message": "as written"}}}
    assert with_decision(decisions, written) == written
    assert decisions == {}


def _indexed(bodies: list[JSON]) -> tuple[dict[Any, list[JSON]], dict[Any, list[str]]]:
    """The Sandbox index and the pool-links index as Kopf would hold them."""
    sandboxes: dict[Any, list[JSON]] = {}
    links: dict[Any, list[str]] = {}
    for body in bodies:
        meta = body["metadata"]
        sandboxes.setdefault((meta["namespace"], meta["name"]), []).append(body)
        for key, name in (pool_links(body) or {}).items():
            links.setdefault(key, []).append(name)
    return sandboxes, links


def test_a_pools_members_and_claims_are_found_through_its_links() -> None:
    pool: JSON = {"metadata": {"name": "warm", "namespace": "ns", "uid": "uid-owner"}}
    free, deleting = member_body("free"), member_body("deleting")
    deleting["metadata"]["deletionTimestamp"] = "2026-11-26T00:00:01Z"
    elsewhere = member_body("elsewhere")
    elsewhere["metadata"]["namespace"] = "other"
    other_pool = member_body("other-pool")
    other_pool["metadata"]["labels"] = {"sandbox.dev/pool": "cold"}
    taken = member_body("taken", owner_kind="Sandbox")
    taken["metadata"]["ownerReferences"][0]["uid"] = "uid-agent"
    claimer: JSON = {
        "metadata": {"name": "agent", "namespace": "ns", "uid": "uid-agent"},
        "status": {"pool": {"name": "warm", "outcome": "Claimed", "member": "taken"}},
    }
    cold: JSON = {
        "metadata": {"name": "cold", "namespace": "ns", "uid": "uid-cold"},
        "status": {"pool": {"name": "warm", "outcome": "ColdStart"}},
    }
    unrelated: JSON = {"metadata": {"name": "plain", "namespace": "ns", "uid": "u"}}
    assert pool_links(unrelated) is None
    sandboxes, links = _indexed(
        [free, deleting, elsewhere, other_pool, taken, claimer, cold, unrelated]
    )

    assert [m["metadata"]["name"] for m in members_of(sandboxes, links, pool)] == ["free"]
    assert owned_member(sandboxes, links, claimer) is taken
    assert owned_member(sandboxes, links, cold) is None
    assert claimed_count(sandboxes, links, "ns", "warm") == 1
    assert claimed_count(sandboxes, links, "other", "warm") == 0
