"""Kopf's own connection to the API server: Kopf's credentials, a bounded pool.

Kopf patches finalizers and its bookkeeping annotations through a client of its
own, whose connection pool has no limit: when every connection is busy it opens
another. At 10,000 Sandboxes that meant thousands of requests in flight at once
and as many TLS handshakes: the API server answered them with 429s and
10-second connection timeouts, each retried by Kopf after a backoff. With a
bounded pool the excess waits here, in order, for a connection to come free.

The same credentials as Kopf's default login (the kubernetes client's:
in-cluster, else the kubeconfig); on a 401 Kopf calls this again, which reads
them again (a rotated service-account token, say).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import kopf

from sandbox_operator import wirejson

# Each watch stream holds a connection for as long as it lasts: Kopf opens one
# per watched kind per namespace (a dozen kinds today, some cluster-wide), so
# the pool has room for this many streams per namespace besides `connections`.
STREAMS_PER_NAMESPACE = 24


def pool_size(connections: int, namespaces: int) -> int:
    """Connections for `connections` requests in flight beside the watch streams
    of `namespaces` watched namespaces (0: all of them, one stream per kind)."""
    return connections + STREAMS_PER_NAMESPACE * max(1, namespaces)


async def bounded_session(
    logger: kopf.Logger, connections: int, namespaces: int, **kwargs: Any
) -> kopf.AiohttpSession:
    info = kopf.login_via_client(logger=logger, **kwargs)
    if info is None:
        raise kopf.LoginError("no credentials: neither in-cluster nor a kubeconfig")
    # Created here, in the operator's event loop, which the session belongs to.
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=pool_size(connections, namespaces), ssl=info.as_ssl_context()
        ),
        headers=info.as_http_headers(),
        # Kopf's responses parsed as the operator's are (wirejson.py).
        response_class=wirejson.Response,
    )
    return kopf.AiohttpSession(
        server=info.server,
        default_namespace=info.default_namespace,
        priority=info.priority,
        expiration=info.expiration,
        aiohttp_session=session,
    )
