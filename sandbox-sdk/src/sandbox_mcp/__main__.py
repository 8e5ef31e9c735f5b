"""`sandbox-mcp` (and `python -m sandbox_mcp`)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio

from sandbox_mcp.settings import Settings, parse
from sandbox_sdk.errors import ConfigError

SERVICEACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def _api_server(settings: Settings) -> tuple[str, str | None]:
    """Where callers' tokens go: the flag, else the pod's own API server."""
    if settings.api_server:
        return settings.api_server, settings.ca_file
    # In a pod: the API server's Service, as every pod sees it (no token needed:
    # the server mounts none, it uses its callers').
    host, port = (
        os.environ.get("KUBERNETES_SERVICE_HOST"),
        os.environ.get("KUBERNETES_SERVICE_PORT"),
    )
    if not host or not port:
        raise SystemExit(
            "sandbox-mcp --transport http needs --api-server (and --ca-file) outside a pod:"
            " callers' tokens are used against it"
        )
    if ":" in host:
        host = f"[{host}]"
    ca = SERVICEACCOUNT / "ca.crt"
    return f"https://{host}:{port}", settings.ca_file or (str(ca) if ca.exists() else None)


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse(argv)
    # stdout is the protocol's channel on stdio: logs go to stderr.
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )
    from sandbox_mcp import server

    if settings.transport == "stdio":
        try:
            anyio.run(server.serve_stdio, settings)
        except ConfigError as exc:
            raise SystemExit(f"sandbox-mcp: {exc}") from None
        return
    import uvicorn

    api_server, ca_file = _api_server(settings)
    uvicorn.run(
        server.http_app(settings, api_server, ca_file),
        host=settings.host,
        port=settings.port,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
