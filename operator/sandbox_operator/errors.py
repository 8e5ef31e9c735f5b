"""One error policy for every handler, applied where handlers are registered.

What each kind of failure costs (Kopf's docs/errors.rst has the vocabulary):
- the API server is busy or unreachable (5xx, 429, a connection error): retry
  soon (`TRANSIENT_RETRY_SECONDS`); nothing is wrong with the object;
- the API server refused to create a child (a 4xx: an invalid object, a quota,
  an admission policy, a namespace whose ServiceAccount is not made yet): the
  kind's controller writes the refusal into the object's status (a condition
  with the API server's message), then Kopf retries with a backoff from 1 s to
  `REFUSED_RETRY_SECONDS` (the cause is usually outside the object and passes)
  or, for an object the API server will never accept, not until it changes;
- any other 4xx (RBAC missing, say): retried slowly and logged, since the
  fix is outside the object;
- anything else is a bug: Kopf's default backoff, with the traceback logged.
Daemons never stop on an error: they are restarted, and pick up from status.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from sandbox_operator import metrics
from sandbox_operator.kube import KubeError, Refused

TRANSIENT_RETRY_SECONDS = 2.0
REFUSED_RETRY_SECONDS = 30.0


def refused_delay(retry: int) -> float:
    """1, 2, 4, ... seconds, up to REFUSED_RETRY_SECONDS, by the handler's retry count."""
    return min(REFUSED_RETRY_SECONDS, float(2 ** min(retry, 10)))


JSON = dict[str, Any]
Report = Callable[[Refused], Awaitable[None]]


@dataclass
class Backoffs:
    """Refusals by object: one streak per object UID and spec generation, shared
    by every trigger of that object. The change handler, the timer and child
    events each keep a retry count of their own in Kopf (a timer's is always 0),
    so without this an object the API server refuses was retried every second."""

    # UID -> (generation, refusals in a row, monotonic time of the next try)
    streaks: dict[str, tuple[int, int, float]] = field(default_factory=dict)

    @staticmethod
    def _key(body: JSON) -> tuple[str, int]:
        meta = body.get("metadata") or {}
        return str(meta.get("uid", "")), int(meta.get("generation") or 0)

    def remaining(self, body: JSON) -> float:
        """Seconds until this object may be tried again (0: now). A new spec
        generation is tried at once."""
        uid, generation = self._key(body)
        streak = self.streaks.get(uid)
        if streak is None or streak[0] != generation:
            return 0.0
        return max(0.0, streak[2] - time.monotonic())

    def refused(self, body: JSON) -> float:
        """Count a refusal; the delay before the next try."""
        uid, generation = self._key(body)
        previous = self.streaks.get(uid)
        count = previous[1] + 1 if previous and previous[0] == generation else 1
        delay = refused_delay(count - 1)
        self.streaks[uid] = (generation, count, time.monotonic() + delay)
        return delay

    def clear(self, body: JSON) -> None:
        self.streaks.pop(self._key(body)[0], None)


def transient(exc: BaseException) -> bool:
    """The API server could not answer now; the same request may well succeed soon."""
    if isinstance(exc, KubeError):
        return exc.status >= 500 or exc.status == 429
    return isinstance(exc, aiohttp.ClientError | TimeoutError | ConnectionError)


@asynccontextmanager
async def policy(
    kind: str,
    trigger: str,
    report: Report | None = None,
    *,
    daemon: bool = False,
    retry: int = 0,
    backoff: tuple[Backoffs, JSON] | None = None,
) -> AsyncIterator[None]:
    """Run one handler under the policy above (`retry`: Kopf's count of this
    handler's retries; `backoff`: where the controller counts the object's
    refusals, shared by all its triggers), and count it in the metrics."""
    started = time.perf_counter()
    result = "error"
    try:
        yield
        result = "ok"
    except (kopf.TemporaryError, asyncio.CancelledError):
        result = "retry"
        raise
    except kopf.PermanentError:
        result = "invalid"
        if daemon:
            return  # the status says why; the daemon has nothing left to do
        raise
    except Refused as exc:
        result = "refused"
        if report is not None:
            await report(exc)
        if exc.permanent and not daemon:
            raise kopf.PermanentError(str(exc)) from exc
        # A daemon whose object the report made final picks that up at once.
        if exc.permanent:
            delay = TRANSIENT_RETRY_SECONDS
        elif backoff is not None and (recorded := backoff[0].remaining(backoff[1])) > 0:
            delay = recorded  # the controller counted the refusal in the object's streak
        else:
            delay = refused_delay(retry)
        raise kopf.TemporaryError(str(exc), delay=delay) from exc
    except Exception as exc:
        if transient(exc):
            result = "retry"
            raise kopf.TemporaryError(
                f"API server: {exc!r}", delay=TRANSIENT_RETRY_SECONDS
            ) from exc
        if isinstance(exc, KubeError):
            raise kopf.TemporaryError(str(exc), delay=refused_delay(retry)) from exc
        raise
    finally:
        metrics.RECONCILES.labels(kind, trigger, result).inc()
        metrics.RECONCILE_SECONDS.labels(kind, trigger).observe(time.perf_counter() - started)
