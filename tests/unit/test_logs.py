from __future__ import annotations

import logging

from sandbox_operator.logs import RoutineSuccesses


def _record(level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord("kopf.objects", level, __file__, 1, msg, None, None)


def test_routine_successes_are_left_out_and_the_rest_is_kept() -> None:
    quiet = RoutineSuccesses()
    assert not quiet.filter(_record(logging.INFO, "Timer 'sandbox_tick' succeeded."))
    assert not quiet.filter(_record(logging.INFO, "Handler 'pod_event' succeeded."))
    kept = [
        (logging.INFO, "Creation is processed: 1 succeeded; 0 failed."),
        (logging.INFO, "max lifetime reached; deleting"),
        (logging.ERROR, "Handler 'sandbox_changed' failed temporarily: 429"),
        (logging.WARNING, "Timer 'sandbox_tick' succeeded."),  # not at INFO: not Kopf's line
    ]
    for level, msg in kept:
        assert quiet.filter(_record(level, msg)), msg
