"""The operator's cycle-collector settings (collector.py), applied to this process
and put back afterwards."""

from __future__ import annotations

import gc

import pytest
from pydantic import ValidationError

from sandbox_operator import collector
from sandbox_operator.config import Settings


def test_configure_sets_the_thresholds_and_freezes_what_exists() -> None:
    before = gc.get_threshold()
    try:
        collector.configure((20_000, 20, 50))
        assert gc.get_threshold() == (20_000, 20, 50)
        # This test's own module is among what existed: out of every collection.
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_the_default_is_larger_than_the_interpreters_and_bad_values_are_refused() -> None:
    default = Settings().gc_thresholds
    assert default[0] > 700
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        Settings.model_validate({"gc_thresholds": [-1, 10, 10]})
