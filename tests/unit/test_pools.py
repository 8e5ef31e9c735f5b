"""Pure decisions of SandboxPool: member choice, refill plan, counts, Ready."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sandbox_operator.api.pool import PoolReason, SandboxPoolSpec, WhenEmpty
from sandbox_operator.builders.pool import (
    Member,
    MemberState,
    choose_member,
    counts,
    ready_condition,
    refill_plan,
)

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
