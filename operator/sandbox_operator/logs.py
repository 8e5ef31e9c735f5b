"""What the operator logs: per-pass lines are left out.

Kopf logs "Timer 'quota_tick' succeeded." on every timer pass and "Handler
'x' succeeded." on every event handled, and httpx one line per request to an
agent (every running sandbox's /v1/info on every pass): at 10,000 Sandboxes,
hundreds of lines a second from an operator with nothing to do. Failures,
retries, Kopf's summary of each change ("Creation is processed: 1 succeeded;
0 failed.") and the handlers' own lines are still logged; agent errors are
logged by the handlers that meet them.
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
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # The liveness endpoint is probed every few seconds: its access log is noise.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
