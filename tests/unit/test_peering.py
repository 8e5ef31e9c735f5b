"""Replica priorities for Kopf peering (sandbox_operator/peering.py)."""

from __future__ import annotations

import kopf

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
