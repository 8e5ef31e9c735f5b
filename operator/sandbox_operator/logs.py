"""What the operator logs: Kopf's per-pass success lines are left out.

Kopf logs "Timer 'sandbox_tick' succeeded." on every timer pass and "Handler
'x' succeeded." on every event handled: at 10,000 Sandboxes that is over 300
lines a second from an operator with nothing to do. Failures, retries and
Kopf's summary of each change ("Creation is processed: 1 succeeded; 0
failed.") are still logged, and so is everything the handlers log themselves.
"""

from __future__ import annotations

import logging
import re

ROUTINE = re.compile(r"(Timer|Handler) '[^']+' succeeded\.")


class RoutineSuccesses(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO and ROUTINE.fullmatch(str(record.msg)))


def configure() -> None:
    logging.getLogger("kopf.objects").addFilter(RoutineSuccesses())
    # The liveness endpoint is probed every few seconds: its access log is noise.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
