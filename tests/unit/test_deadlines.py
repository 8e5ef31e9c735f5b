"""When a Sandbox is looked at again: the pure `next_pass` and the `Timetable`
whose clock starts the passes (a real event loop and its clock, no fakes)."""

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


# -- the timetable and its clock -----------------------------------------------------

Key = tuple[str, str, str]


class Passes:
    """Runs the clock over a Timetable and records each pass: which key, when
    (the loop's clock); a pass can be held open to see what the clock does meanwhile."""

    def __init__(self, table: Timetable) -> None:
        self.table = table
        self.ran: list[tuple[Key, float]] = []
        self.hold: dict[Key, asyncio.Event] = {}
        self.fail: set[Key] = set()
        self.arrived = asyncio.Event()
        self.seen = 0  # passes returned by next()

    async def run_pass(self, key: Key) -> None:
        self.ran.append((key, asyncio.get_running_loop().time()))
        self.arrived.set()
        if key in self.hold:
            await self.hold[key].wait()
        if key in self.fail:
            raise RuntimeError("the pass failed")

    async def next(self, within: float = 30) -> Key:
        """The key of the next pass not returned yet (waited for well within any
        default time, however busy the machine)."""
        while len(self.ran) == self.seen:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), within)
        self.seen += 1
        return self.ran[self.seen - 1][0]

    def keys(self) -> list[Key]:
        return [key for key, _ in self.ran]


def clocked(scenario: Any, **table: float) -> Any:
    """Run `scenario(table, passes)` beside the clock, then stop the clock."""

    async def main() -> Any:
        timetable = Timetable(
            default_seconds=table.get("default_seconds", 60),
            retry_seconds=table.get("retry_seconds", 60),
        )
        passes = Passes(timetable)
        clock = asyncio.create_task(timetable.run(passes.run_pass))
        try:
            return await scenario(timetable, passes)
        finally:
            clock.cancel()
            with pytest.raises(asyncio.CancelledError):
                await clock

    return asyncio.run(main())


A: Key = ("ns", "a", "uid-a")
B: Key = ("ns", "b", "uid-b")


def test_a_pass_starts_at_the_time_set_not_before() -> None:
    async def scenario(table: Timetable, passes: Passes) -> float:
        started = asyncio.get_running_loop().time()
        table.set(A, 0.05)
        assert await passes.next() == A
        return passes.ran[0][1] - started

    assert clocked(scenario) >= 0.05


def test_an_earlier_time_wakes_the_clock_a_later_one_holds_the_pass() -> None:
    async def scenario(table: Timetable, passes: Passes) -> None:
        table.set(A, 60)
        await asyncio.sleep(0.01)  # the clock sleeps until A's time
        table.set(B, 0.02)
        assert await passes.next() == B
        table.set(A, 0.02)
        table.set(A, 30)  # moved later before it came: no pass at the old time
        await asyncio.sleep(0.2)
        assert passes.keys() == [B]
        table.set(A, 0)
        assert await passes.next() == A

    clocked(scenario)


def test_sooner_only_moves_a_time_earlier() -> None:
    async def scenario() -> None:
        table = Timetable(default_seconds=60, retry_seconds=60)
        table.set(A, 10)
        table.sooner(A, 30)
        due = table.due_in(A)
        assert due is not None
        assert due <= 10
        table.sooner(A, 1)
        due = table.due_in(A)
        assert due is not None
        assert due <= 1
        table.sooner(B, 5)
        assert table.due_in(B) is not None

    asyncio.run(scenario())


def test_ensure_gives_a_key_without_a_time_the_default_and_keeps_one_set() -> None:
    async def scenario() -> None:
        table = Timetable(default_seconds=60, retry_seconds=60)
        table.ensure(A)
        due = table.due_in(A)
        assert due is not None
        assert 50 < due <= 60
        table.set(B, 1)
        table.ensure(B)
        due = table.due_in(B)
        assert due is not None
        assert due <= 1

    asyncio.run(scenario())


def test_a_dropped_key_has_no_pass() -> None:
    async def scenario(table: Timetable, passes: Passes) -> None:
        table.set(A, 0.05)
        table.set(B, 0.1)
        assert len(table) == 2
        table.drop(A)
        assert len(table) == 1
        assert table.due_in(A) is None
        assert await passes.next() == B
        await asyncio.sleep(0.1)
        assert passes.keys() == [B]
        table.drop(A)  # twice: nothing to do

    clocked(scenario)


def test_never_two_passes_of_one_key_and_a_time_set_meanwhile_comes_after() -> None:
    async def scenario(table: Timetable, passes: Passes) -> None:
        passes.hold[A] = asyncio.Event()
        table.set(A, 0)
        assert await passes.next() == A
        table.set(A, 0)  # due again while its pass is still at work
        table.set(B, 0)  # another key is not held up by it
        assert await passes.next() == B
        await asyncio.sleep(0.1)
        assert passes.keys() == [A, B]
        passes.hold.pop(A).set()
        assert await passes.next() == A  # right after the first ended

    clocked(scenario)


def test_a_failed_pass_is_retried_and_the_clock_goes_on() -> None:
    async def scenario(table: Timetable, passes: Passes) -> None:
        passes.fail.add(A)
        table.set(A, 0)
        assert await passes.next() == A
        assert await passes.next() == A  # after retry_seconds, not the 60 s default
        table.set(B, 0)
        passes.fail.clear()
        assert B in [await passes.next(), await passes.next()]

    clocked(scenario, retry_seconds=0.05)


def test_settle_waits_for_a_pass_in_flight_and_cancels_it_after_the_timeout() -> None:
    async def scenario(table: Timetable, passes: Passes) -> None:
        await table.settle(A, 5)  # none in flight: returns at once
        passes.hold[A] = asyncio.Event()
        table.set(A, 0)
        await passes.next()
        loop = asyncio.get_running_loop()
        release = loop.call_later(0.05, passes.hold[A].set)
        await asyncio.wait_for(table.settle(A, 30), 30)  # ends when the pass does
        release.cancel()
        passes.hold[B] = asyncio.Event()  # never set: cancelled by settle
        table.set(B, 0)
        await passes.next()
        await asyncio.wait_for(table.settle(B, 0.05), 30)
        table.set(B, 0)
        assert await passes.next() == B  # the key still has its pass after that

    clocked(scenario)


def paused_clock(scenario: Any, default_seconds: float = 60) -> Any:
    """Run `scenario(table, passes, conflict)` beside a clock that pauses with
    Kopf's own kind of toggle set (`conflict` turns the pause on and off)."""
    from kopf._cogs.aiokits.aiotoggles import ToggleSet

    async def main() -> Any:
        table = Timetable(default_seconds=default_seconds, retry_seconds=60)
        passes = Passes(table)
        pauses = ToggleSet(any)
        conflict = await pauses.make_toggle(False, name="a peer of higher priority")
        clock = asyncio.create_task(table.run(passes.run_pass, pauses))
        try:
            return await scenario(table, passes, conflict)
        finally:
            clock.cancel()
            with pytest.raises(asyncio.CancelledError):
                await clock

    return asyncio.run(main())


def test_no_pass_starts_while_paused_and_a_confirmed_one_starts_when_it_ends() -> None:
    async def scenario(table: Timetable, passes: Passes, conflict: Any) -> None:
        table.set(A, 0)
        assert await passes.next() == A
        await conflict.turn_to(True)
        await asyncio.sleep(0.05)  # the clock sees the pause
        table.set(B, 0.01)  # a pass in flight at the pause set this: B exists
        await asyncio.sleep(0.3)
        assert passes.keys() == [A]
        await conflict.turn_to(False)
        assert await passes.next() == B
        assert passes.keys() == [A, B]

    paused_clock(scenario)


def test_after_a_pause_a_key_runs_once_an_event_confirms_it_and_a_ghost_is_dropped() -> None:
    async def scenario(table: Timetable, passes: Passes, conflict: Any) -> None:
        table.set(A, 0)
        table.set(B, 0)
        assert sorted([await passes.next(), await passes.next()]) == [A, B]
        # Their next passes (default_seconds after these) come due during the pause.
        await conflict.turn_to(True)
        await asyncio.sleep(0.8)
        ran = len(passes.ran)
        await conflict.turn_to(False)
        await asyncio.sleep(0.1)
        assert len(passes.ran) == ran, "a pass before any event confirmed its Sandbox"
        table.ensure(A)  # the listing after the pause shows A, not B (deleted meanwhile)
        assert await passes.next() == A
        await asyncio.sleep(1.0)  # past default_seconds since the pause ended
        assert table.due_in(B) is None, "a Sandbox no event showed kept its time"
        assert table.due_in(A) is not None
        assert {key for key, _ in passes.ran[ran:]} == {A}

    paused_clock(scenario, default_seconds=0.5)


def test_waiting_keys_cost_no_task_and_stopping_the_clock_cancels_passes() -> None:
    async def scenario(table: Timetable, passes: Passes) -> int:
        before = len(asyncio.all_tasks())
        for n in range(2000):
            table.set(("ns", f"s{n}", f"u{n}"), 3600)
        await asyncio.sleep(0.01)
        return len(asyncio.all_tasks()) - before

    assert clocked(scenario) == 0

    async def stopped() -> None:
        table = Timetable(default_seconds=60, retry_seconds=60)
        passes = Passes(table)
        passes.hold[A] = asyncio.Event()
        clock = asyncio.create_task(table.run(passes.run_pass))
        table.set(A, 0)
        await passes.next()
        clock.cancel()
        with pytest.raises(asyncio.CancelledError):
            await clock
        # The held pass was cancelled with it: nothing of the clock is left.
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    asyncio.run(stopped())


def test_times_set_again_and_again_do_not_grow_the_heap_without_bound() -> None:
    async def scenario() -> int:
        table = Timetable(default_seconds=60, retry_seconds=60)
        for n in range(20_000):
            table.set(A, 3600 + n)
        return len(table._heap)

    assert asyncio.run(scenario()) <= 2 * 1 + 1024 + 1
