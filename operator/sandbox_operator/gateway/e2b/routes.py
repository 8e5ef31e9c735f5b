"""The routes of the E2B listener, as each part of the adapter lists them.

Apart from app.py, which collects the parts' endpoints: the parts import
this module, and app.py imports the parts, with no cycle between them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from sandbox_operator.gateway.e2b.core import Target

ControlHandler = Callable[[web.Request, dict[str, str]], Awaitable[web.StreamResponse]]
DataHandler = Callable[[web.Request, Target, dict[str, str]], Awaitable[web.StreamResponse]]
CONTROL = 0  # Endpoint.port of a control-plane endpoint


@dataclass(frozen=True)
class Endpoint:
    """One route: `port` 0 for the control plane, else the sandbox port it serves
    (core.ENVD_PORT, core.INTERPRETER_PORT); `path` a regular expression whose
    named groups are passed to the handler."""

    port: int
    method: str
    path: str
    handler: ControlHandler | DataHandler

    def match(self, method: str, path: str) -> dict[str, str] | None:
        if method != self.method and not (self.method == "GET" and method == "HEAD"):
            return None
        found = re.fullmatch(self.path, path)
        return found.groupdict() if found else None


def json_response(body: object, status: int = 200) -> web.Response:
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")
