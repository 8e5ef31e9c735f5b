"""Replica priorities for Kopf peering (sandbox_operator/peering.py)."""

from __future__ import annotations

import asyncio

import kopf
import pytest
from kopf._cogs.aiokits.aiotoggles import ToggleSet

from sandbox_operator import peering


def test_a_later_start_never_outranks_an_earlier_one() -> None:
    earlier = peering.priority(1_700_000_000_000, 999)
    later = peering.priority(1_700_000_000_001, 0)
    assert later < earlier


def test_replicas_started_in_the_same_millisecond_differ() -> None:
    # Kopf pauses every peer of equal priority: a tie would stop both.
    assert peering.priority(1_700_000_000_000, 1) != peering.priority(1_700_000_000_000, 2)
    # Large nonces are folded into range, never spilling into the next millisecond.
    assert peering.priority(1_700_000_000_000, 10**9 - 1) > peering.priority(1_700_000_000_001, 0)


def test_configure_sets_a_fresh_priority_and_the_lifetime() -> None:
    first, second = kopf.OperatorSettings(), kopf.OperatorSettings()
    peering.configure(first, 10)
    peering.configure(second, 10)
    assert first.peering.lifetime == 10
    assert first.peering.priority < 0
    assert first.peering.priority != second.peering.priority


def test_standalone_is_left_alone() -> None:
    settings = kopf.OperatorSettings()
    settings.peering.standalone = True
    peering.configure(settings, 10)
    assert (settings.peering.priority, settings.peering.lifetime) == (0, 60)


def test_the_pause_state_is_kopfs_own_once_kopf_has_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Sandboxes' clock pauses with Kopf only if follow_pauses sees the set
    of toggles Kopf's own tasks use: start Kopf's tasks (no cluster needed to
    make them) and look, then stop them. Fails for a Kopf that no longer hands
    the set to its daemon killer."""
    monkeypatch.setattr(peering, "_PAUSES", [])
    peering.follow_pauses()
    peering.follow_pauses()  # twice: one wrapper, not two
    settings = kopf.OperatorSettings()
    with pytest.raises(RuntimeError, match="pause state is unknown"):
        peering.pause(settings)

    async def started() -> list[str | None]:
        tasks = await kopf.spawn_tasks(
            registry=kopf.OperatorRegistry(),
            settings=settings,
            peering_name="unit",
            clusterwide=True,
        )
        try:
            paused = peering.pause(settings)
            assert isinstance(paused, ToggleSet)
            # The very set Kopf's orchestrator pauses the operator with: the
            # first toggle it makes there (before it needs a cluster) shows up.
            for _ in range(3000):
                if len(paused):
                    break
                await asyncio.sleep(0.01)
            return [toggle.name for toggle in paused]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    assert asyncio.run(started()) == ["peering CRD is missing"]


def test_a_standalone_operator_needs_no_pause_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peering, "_PAUSES", [])
    settings = kopf.OperatorSettings()
    settings.peering.standalone = True
    assert peering.pause(settings) is None
