"""`python -m sandbox_operator.gateway`: serve until SIGTERM.

On SIGTERM the replica drains for `drain_seconds`: `/readyz` answers 503 and
every answer closes its connection, while new connections are still served
(the Service's endpoints and kube-proxy's rules drop the pod only some time
after the kubelet's signal). Then the listener closes, execution event streams
end with an `interrupted` event (callers reattach through another replica),
other answers in progress get `SHUTDOWN_GRACE` seconds, then they are cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import start_http_server

from sandbox_operator.gateway import config
from sandbox_operator.gateway.app import Gateway
from sandbox_operator.gateway.e2b import app as e2b_app
from sandbox_operator.gateway.e2b.core import Adapter
from sandbox_operator.gateway.signing import Keys
from sandbox_operator.gateway.table import RouteTable
from sandbox_operator.kube import Kube

SHUTDOWN_GRACE = 10.0


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class CallerErrors(logging.Filter):
    """aiohttp logs a request it cannot parse (a header past its limit, say) as a
    server error with a traceback; the caller got its 400, so it is not ours. So
    is a body whose Content-Encoding does not decode: aiohttp reads the rest of
    it after the answer and logs the decoding error again."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, HttpProcessingError | RequestPayloadError)


async def serve(settings: config.GatewaySettings) -> None:
    kube = Kube.from_environment()
    table = RouteTable(kube, settings.namespaces)
    table.start()
    gateway = Gateway(settings, kube, table, Keys(settings.keys_dir))
    adapter = Adapter(gateway)
    main_app = gateway.app()
    if settings.e2b_port:
        # E2B-shaped API keys are minted and revoked on the main listener.
        adapter.api_keys.add_routes(main_app)
    # handler_cancellation: a caller that goes away cancels its handler, which
    # closes the upstream connection, so the agent sees the disconnect too.
    runner = web.AppRunner(
        main_app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=SHUTDOWN_GRACE,
    )
    await runner.setup()
    loop = asyncio.get_running_loop()
    # Our own listener rather than aiohttp's site: each connection goes through
    # the guard's limits and deadlines (connections.py).
    assert runner.server is not None  # set by setup()
    server = await loop.create_server(
        gateway.guard.factory(runner.server), settings.host, settings.port, reuse_address=True
    )
    e2b_runner, e2b_server = None, None
    if settings.e2b_port:
        # The E2B adapter on a listener of its own, through the same guard.
        e2b_runner = web.AppRunner(
            e2b_app.build(adapter),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=SHUTDOWN_GRACE,
        )
        await e2b_runner.setup()
        assert e2b_runner.server is not None
        e2b_server = await loop.create_server(
            gateway.guard.factory(e2b_runner.server),
            settings.host,
            settings.e2b_port,
            reuse_address=True,
        )
    if settings.metrics_port:
        start_http_server(settings.metrics_port)
    logging.getLogger("sandbox_gateway").info("serving on %s:%d", settings.host, settings.port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    gateway.draining = True
    logging.getLogger("sandbox_gateway").info("draining for %.0f s", settings.drain_seconds)
    await asyncio.sleep(settings.drain_seconds)
    server.close()
    if e2b_server is not None:
        e2b_server.close()
    gateway.upstreams.interrupt_streams()
    if e2b_runner is not None:
        await e2b_runner.cleanup()
    await runner.cleanup()
    await table.close()
    await kube.close()


def main() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("aiohttp.server").addFilter(CallerErrors())
    settings = config.load()
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
