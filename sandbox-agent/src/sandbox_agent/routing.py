"""What a route is, as data: the types of the route table and what is derived from it.

The table itself is ``routes.OPS``. Everything that used to be written twice
is read from it: the Starlette routes and the OpenAPI document (app.py,
openapi.py), the paths that need no token (``public_paths``), the requests
that wait while the workspace is quiesced (``Op.writes``), and the query and
path parameters with their defaults and bounds (``parse_args``), so the
documented bounds are the enforced ones.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from starlette.requests import HTTPConnection, Request
from starlette.responses import Response
from starlette.websockets import WebSocket

from .errors import Invalid

T = TypeVar("T")
ParamType = Literal["string", "integer", "number", "boolean"]
# "token": bearer token required; "public": never (probes); "metrics": public
# only when SANDBOX_AGENT_METRICS_AUTH=false lets a scraper in.
Access = Literal["token", "public", "metrics"]
# The permission the gateway demands before it forwards an operation (the names
# of its scoped-token operations; each maps to one RBAC check there). An
# operation without one is never forwarded: the operator's own controls and
# what only probes and scrapers read. The gateway's table is generated from the
# OpenAPI document's `x-access-class`, so this is the one place that decides.
GatewayAccess = Literal["exec", "files:read", "files:write", "view"]


@dataclass(frozen=True)
class Param:
    name: str
    type: ParamType
    description: str
    default: Any = None
    required: bool = False
    location: Literal["query", "path"] = "query"
    enum: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    pattern: str | None = None


class Args:
    """A request's parameters, parsed and checked against its route's ``Param``s."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = values

    def get(self, name: str, typ: type[T]) -> T | None:
        """The value, or None when absent and without a default."""
        value = self._values[name]  # KeyError: the route does not declare it
        if value is not None and not isinstance(value, typ):
            raise TypeError(f"parameter {name} is not {typ.__name__}")
        return value

    def need(self, name: str, typ: type[T]) -> T:
        """The value of a parameter that is required or has a default."""
        value = self.get(name, typ)
        if value is None:
            raise TypeError(f"parameter {name} needs a default or required=True")
        return value


Handler = Callable[[Request, Args], Awaitable[Response]]
# A WebSocket operation's handler (result "websocket"): it accepts and talks.
Attach = Callable[[WebSocket, Args], Awaitable[None]]


@dataclass(frozen=True)
class Op:
    """One operation. Routing, auth, docs and parameter checks all read it.

    The handler's docstring is the documentation: its first line is the
    summary, the rest the description; its module (``api_<tag>``) the tag.
    """

    method: str
    path: str
    handler: Handler | Attach
    # Success body: a msgspec type, a raw kind ("binary", "tar", "events", "watch", "code",
    # "prometheus", "object", "websocket": a GET that upgrades), or None for no content.
    result: Any
    status: int = 200
    errors: tuple[int, ...] = ()  # documented error statuses (ErrorBody)
    more: Mapping[int, Any] = field(default_factory=dict)  # other answers (202, 503, ...)
    body: Any = None  # request body: a msgspec type, "binary", "tar", or None
    body_required: bool = True  # False: an empty body means every field's default
    params: tuple[Param, ...] = ()
    access: Access = "token"
    # None: not forwarded by the gateway (see GatewayAccess).
    gateway: GatewayAccess | None = None
    # Changes the workspace: waits while it is quiesced (reads, signals and
    # stdin go through so a snapshot never waits for them).
    writes: bool = False

    @property
    def websocket(self) -> bool:
        return bool(self.result == "websocket")

    def responses(self) -> dict[int, Any]:
        """Status -> body type, as documented (errors: the ErrorBody kind "error")."""
        out: dict[int, Any] = {self.status: self.result, **self.more}
        out.update((code, "error") for code in self.errors)
        return out

    @property
    def access_class(self) -> str:
        """Who may call it: a gateway permission, "operator" (the agent token
        only) or "public"/"metrics" (no token)."""
        if self.access != "token":
            return self.access
        return self.gateway or "operator"

    @property
    def summary(self) -> str:
        return (inspect.getdoc(self.handler) or "").split("\n", 1)[0]

    @property
    def description(self) -> str | None:
        rest = (inspect.getdoc(self.handler) or "").partition("\n")[2].strip()
        return rest or None

    @property
    def tag(self) -> str:
        return self.handler.__module__.rsplit(".", 1)[-1].removeprefix("api_")


def public_paths(ops: tuple[Op, ...], *, metrics_auth: bool) -> frozenset[str]:
    """Paths served without a token."""
    open_access = {"public"} if metrics_auth else {"public", "metrics"}
    return frozenset(op.path for op in ops if op.access in open_access)


_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no")


def _convert(p: Param, raw: str) -> Any:
    if p.type == "integer":
        try:
            return int(raw)
        except ValueError:
            raise Invalid("invalid_request", f"{p.name} must be an integer") from None
    if p.type == "number":
        try:
            n = float(raw)
        except ValueError:
            raise Invalid("invalid_request", f"{p.name} must be a number") from None
        if not math.isfinite(n):
            raise Invalid("invalid_request", f"{p.name} must be a finite number")
        return n
    if p.type == "boolean":
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise Invalid("invalid_request", f"{p.name} must be true or false")
    if p.enum is not None and raw not in p.enum:
        raise Invalid("invalid_request", f"{p.name} must be one of {', '.join(p.enum)}")
    if p.pattern is not None and not re.fullmatch(p.pattern, raw):
        raise Invalid("invalid_request", f"{p.name} must match the pattern {p.pattern}")
    return raw


def _check_bounds(p: Param, value: float) -> None:
    lo, hi = p.minimum, p.maximum
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        if lo is not None and hi is not None:
            raise Invalid("invalid_request", f"{p.name} must be between {lo:g} and {hi:g}")
        if lo is not None:
            raise Invalid("invalid_request", f"{p.name} must be at least {lo:g}")
        raise Invalid("invalid_request", f"{p.name} must be at most {hi:g}")


def parse_args(params: tuple[Param, ...], request: HTTPConnection) -> Args:
    """Parse, default and bound the declared parameters; 400 on anything else."""
    values: dict[str, Any] = {}
    for p in params:
        source = request.path_params if p.location == "path" else request.query_params
        raw = source.get(p.name)
        if raw is None or raw == "":
            if p.required:
                raise Invalid("invalid_request", f"query parameter {p.name!r} is required")
            values[p.name] = p.default
            continue
        value = _convert(p, raw)
        if p.type in ("integer", "number"):
            _check_bounds(p, value)
        values[p.name] = value
    return Args(values)
