"""When a Sandbox is looked at again: the pure `next_pass` and the `Timetable`
its daemon sleeps on (a real event loop and its clock, no fakes)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sandbox_operator import identity
from sandbox_operator.api.sandbox import SandboxPhase, SandboxStatus
from sandbox_operator.clock import iso
from sandbox_operator.config import Settings
from sandbox_operator.handlers.sandbox.deadlines import MARGIN, next_pass, resync_after
from sandbox_operator.timetable import Timetable

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
SETTINGS = Settings()
INTERVAL = timedelta(seconds=SETTINGS.reconcile_interval_seconds)
JSON = dict[str, Any]


def look(status: SandboxStatus, pod: JSON | None = None, **kw: Any) -> tuple[timedelta, str]:
    args: dict[str, Any] = {
        "uid": "u-1",
        "claim_wait": False,
        "restoring": False,
        "now": NOW,
        "settings": SETTINGS,
    }
    args.update(kw)
    found = next_pass(status, pod, **args)
    return found.at - NOW, found.why


def status(**fields: Any) -> SandboxStatus:
    return SandboxStatus.model_validate(fields)


def test_a_sandbox_that_waits_for_nothing_is_only_resynced() -> None:
    for phase in (SandboxPhase.PENDING, SandboxPhase.PAUSED, SandboxPhase.FAILED):
        after, why = look(status(phase=phase))
        assert why == "resync"
        assert after == resync_after("u-1", SETTINGS)


def test_resyncs_are_spread_by_uid_within_ten_percent() -> None:
    interval = SETTINGS.resync_interval_seconds
    seconds = {resync_after(f"uid-{i}", SETTINGS).total_seconds() for i in range(200)}
    assert min(seconds) >= interval * 0.9
    assert max(seconds) < interval * 1.1
    assert len(seconds) > 100  # spread, not one instant
    assert resync_after("uid-7", SETTINGS) == resync_after("uid-7", SETTINGS)


def test_deadlines_in_status_wake_it_just_after_they_pass() -> None:
    paused = status(
        phase="Paused",
        pausedDeadline=iso(NOW + timedelta(minutes=5)),
        expiresAt=iso(NOW + timedelta(hours=1)),
    )
    assert look(paused) == (timedelta(minutes=5) + MARGIN, "paused timeout")
    leased = status(phase="Pending", expiresAt=iso(NOW + timedelta(seconds=7)))
    assert look(leased) == (timedelta(seconds=7) + MARGIN, "expiry")


def test_a_deadline_already_past_does_not_spin() -> None:
    # Paused at the end of its lease: expiresAt stays in the past.
    expired = status(phase="Paused", expiresAt=iso(NOW - timedelta(minutes=1)))
    assert look(expired)[1] == "resync"


def test_a_running_sandbox_hears_from_its_agent_every_interval() -> None:
    running = status(phase="Running", idleDeadline=iso(NOW + timedelta(minutes=30)))
    assert look(running) == (INTERVAL, "agent report")
    soon = status(phase="Running", idleDeadline=iso(NOW + timedelta(seconds=3)))
    assert look(soon) == (timedelta(seconds=3) + MARGIN, "idle deadline")


def test_a_stale_idle_deadline_of_a_stopped_sandbox_is_not_a_reason() -> None:
    paused = status(phase="Paused", idleDeadline=iso(NOW + timedelta(seconds=3)))
    assert look(paused)[1] == "resync"


def test_waits_that_poll_something_else_look_every_interval() -> None:
    pending = status(phase="Pending")
    assert look(pending, claim_wait=True) == (INTERVAL, "claim binding")
    assert look(pending, restoring=True) == (INTERVAL, "workspace restore")
    snapshotting = status(phase="Paused", idleSnapshot="box-idle-1")
    assert look(snapshotting) == (INTERVAL, "idle snapshot")


def _pod(**status: Any) -> JSON:
    return {"metadata": {"uid": "pod-1"}, "status": status}


def test_patience_with_the_pod_runs_out_at_a_known_time() -> None:
    message = "0/1 nodes are available: pod has unbound immediate PersistentVolumeClaims."
    since = NOW - timedelta(seconds=5)
    unscheduled = _pod(
        phase="Pending",
        conditions=[
            {
                "type": "PodScheduled",
                "status": "False",
                "message": message,
                "lastTransitionTime": iso(since),
            }
        ],
    )
    assert look(status(phase="Pending"), unscheduled) == (
        timedelta(seconds=10) + MARGIN,
        "unscheduled on its claim",
    )
    gone = {**unscheduled, "metadata": {"uid": "pod-1", "deletionTimestamp": iso(NOW)}}
    assert look(status(phase="Pending"), gone)[1] == "resync"

    stalled_since = NOW - timedelta(seconds=20)
    serving = _pod(
        phase="Running",
        containerStatuses=[
            {"name": identity.AGENT_CONTAINER, "ready": False, "state": {"running": {}}},
            {"name": identity.SANDBOX_CONTAINER, "ready": True, "state": {"running": {}}},
        ],
    )
    unready = status(
        phase="Starting",
        readyPodUID="pod-1",
        conditions=[
            {
                "type": "AgentReady",
                "status": "False",
                "reason": "NotReady",
                "message": "",
                "lastTransitionTime": iso(stalled_since),
            }
        ],
    )
    patience = timedelta(minutes=2)  # Settings().agent_unready_patience
    assert look(unready, serving) == (patience - timedelta(seconds=20) + MARGIN, "agent not ready")


def test_the_earliest_reason_wins() -> None:
    both = status(
        phase="Running",
        expiresAt=iso(NOW + timedelta(seconds=4)),
        idleDeadline=iso(NOW + timedelta(seconds=9)),
    )
    assert look(both) == (timedelta(seconds=4) + MARGIN, "expiry")


# -- the timetable --------------------------------------------------------------------


def test_a_sleep_ends_at_the_time_set() -> None:
    async def scenario() -> float:
        table = Timetable(default_seconds=60)
        loop = asyncio.get_running_loop()
        table.set(("ns", "a"), 0.05)
        started = loop.time()
        # Well before the default of 60 s, however busy the machine.
        assert await asyncio.wait_for(table.sleep(("ns", "a")), 30)
        return loop.time() - started

    assert asyncio.run(scenario()) >= 0.05


def test_an_earlier_time_wakes_the_sleeper_a_later_one_holds_it() -> None:
    async def scenario() -> bool:
        table = Timetable(default_seconds=60)
        key = ("ns", "a")
        sleeper = asyncio.create_task(table.sleep(key))  # the default: 60 s
        await asyncio.sleep(0.01)
        table.set(key, 0.05)
        woke = await asyncio.wait_for(sleeper, 30)
        # Moved later while asleep: the sleeper does not return at the old time.
        table.set(key, 0.02)
        again = asyncio.create_task(table.sleep(key))
        await asyncio.sleep(0.005)
        table.set(key, 30)
        await asyncio.sleep(0.1)
        assert not again.done()
        table.set(key, 0)
        assert await asyncio.wait_for(again, 30)
        return woke

    assert asyncio.run(scenario())


def test_sooner_only_moves_a_time_earlier() -> None:
    async def scenario() -> None:
        table = Timetable(default_seconds=60)
        key = ("ns", "a")
        table.set(key, 10)
        table.sooner(key, 30)
        due = table.due_in(key)
        assert due is not None
        assert due <= 10
        table.sooner(key, 1)
        due = table.due_in(key)
        assert due is not None
        assert due <= 1
        table.sooner(("ns", "new"), 5)
        assert table.due_in(("ns", "new")) is not None

    asyncio.run(scenario())


def test_drop_ends_the_sleep_with_false_and_forgets_the_key() -> None:
    async def scenario() -> None:
        table = Timetable(default_seconds=60)
        key = ("ns", "a")
        sleeper = asyncio.create_task(table.sleep(key))
        await asyncio.sleep(0.01)
        assert len(table) == 1
        table.drop(key)
        assert await asyncio.wait_for(sleeper, 5) is False
        assert len(table) == 0
        assert table.due_in(key) is None
        table.drop(key)  # twice: nothing to do

    asyncio.run(scenario())


def test_a_cancelled_sleeper_leaves_no_timer_behind() -> None:
    async def scenario() -> None:
        table = Timetable(default_seconds=60)
        key = ("ns", "a")
        sleeper = asyncio.create_task(table.sleep(key))
        await asyncio.sleep(0.01)
        sleeper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sleeper
        # The key keeps its time for the daemon Kopf starts again (peering, restart).
        due = table.due_in(key)
        assert due is not None
        assert due > 50
        table.set(key, 0)  # no waiter left to wake: must not fail
        assert await table.sleep(key)

    asyncio.run(scenario())


def test_a_sleep_already_due_still_yields_to_the_event_loop() -> None:
    """A daemon that loops on a key whose time is past (a pass that set none)
    must not hold the event loop: every other task of the operator would stop."""

    async def scenario() -> int:
        table = Timetable(default_seconds=60)
        key = ("ns", "a")
        table.set(key, -1)
        others = 0

        async def other() -> None:
            nonlocal others
            while True:
                others += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        for _ in range(100):
            assert await table.sleep(key)
        task.cancel()
        return others

    assert asyncio.run(scenario()) >= 50
