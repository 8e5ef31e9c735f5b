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

import aiohttp
import kopf

from sandbox_operator import metrics
from sandbox_operator.kube import KubeError, Refused

TRANSIENT_RETRY_SECONDS = 2.0
REFUSED_RETRY_SECONDS = 30.0


def refused_delay(retry: int) -> float:
    """1, 2, 4, ... seconds, up to REFUSED_RETRY_SECONDS, by the handler's retry count."""
    return min(REFUSED_RETRY_SECONDS, float(2 ** min(retry, 10)))


Report = Callable[[Refused], Awaitable[None]]


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
) -> AsyncIterator[None]:
    """Run one handler under the policy above (`retry`: Kopf's count of this
    handler's retries), and count it in the metrics."""
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
        delay = TRANSIENT_RETRY_SECONDS if exc.permanent else refused_delay(retry)
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
