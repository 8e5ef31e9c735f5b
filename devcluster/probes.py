"""Readiness probes of the cluster's components: one quick check, never raising.

A `Component.ready` is called every 200 ms while the component starts and by
`status()`, so a probe answers within a few seconds and turns every failure
(refused, reset, timeout, TLS, garbage) into False. A few, not one or two: on
a node loaded far beyond its cores, an API server's /readyz (a TLS handshake
and its etcd check) took longer than 2 s, and `status` called a working
cluster not ready.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
from collections.abc import Callable
from pathlib import Path

LOOPBACK = "127.0.0.1"
_TIMEOUT = 5.0


def any_body(body: bytes) -> bool:
    """Status 200 is all that counts (e.g. a sidecar's /metrics)."""
    return True


def says_ok(body: bytes) -> bool:
    """The body of a Kubernetes health endpoint (/healthz, /readyz) that passes."""
    return body.strip() == b"ok"


def passes_check(name: str) -> Callable[[bytes], bool]:
    """The body of a verbose health endpoint (`/healthz?verbose`) lists the
    named check as passing: a check registered only once the component did
    something (a controller manager's controllers started)."""
    line = f"[+]{name} ok".encode()
    return lambda body: line in body.splitlines()


def json_body(check: Callable[[object], bool]) -> Callable[[bytes], bool]:
    """The body parses as JSON and `check` accepts it (e.g. etcd's /health)."""
    return lambda body: check(json.loads(body))


def http_ok(
    port: int,
    path: str,
    *,
    host: str = LOOPBACK,
    tls: ssl.SSLContext | None = None,
    body: Callable[[bytes], bool] = any_body,
) -> bool:
    """True when GET http(s)://host:port/path answers 200 and `body` accepts
    what came with it. HTTPS when `tls` (the context that verifies the server,
    and presents a client certificate where the endpoint wants one)."""
    # http.client rather than urllib: urllib would route loopback through an
    # HTTPS_PROXY from the environment.
    connection = (
        http.client.HTTPSConnection(host, port, timeout=_TIMEOUT, context=tls)
        if tls is not None
        else http.client.HTTPConnection(host, port, timeout=_TIMEOUT)
    )
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        data = response.read()
        return response.status == 200 and body(data)
    except (OSError, http.client.HTTPException, ValueError):
        return False
    finally:
        connection.close()


def unix_socket_accepts(path: Path) -> bool:
    """True when something accepts connections on the unix socket `path`
    (a gRPC server that listens there serves it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(_TIMEOUT)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True
