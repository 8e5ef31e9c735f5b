"""Which agent operations the gateway forwards, and the permission each needs.

The table (``agent_table.OPERATIONS``) is generated from the agent's OpenAPI
document, where every operation declares its access class
(``x-access-class``); ``python -m sandbox_operator.gateway.operations``
writes it again, and a unit test fails when it is stale. Only operations with
a gateway permission are in it: the operator's own controls (workspace
quiesce, the environment) and what probes read cannot be named through the
gateway at all. A request that matches no entry is answered 404 by the
gateway and never reaches an agent.

Matching is on a canonical path (see ``canonical.py``): literal segments
compare equal, a ``{param}`` segment must match the parameter's pattern.

The same generated module names the agent's error codes (``AgentErrorCode``,
the enum of ``ErrorDetail.code`` in the document): where the gateway reads an
agent's error answer (the E2B adapter), it compares codes with those names.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox_operator.gateway.access import Operation

# What the gateway demands for each access class of the agent's document.
GATEWAY_CLASSES = {
    op.value: op
    for op in (Operation.EXEC, Operation.FILES_READ, Operation.FILES_WRITE, Operation.VIEW)
}
# Classes the gateway never forwards.
NOT_FORWARDED = {"operator", "public", "metrics"}
GENERATED = Path(__file__).with_name("agent_table.py")
# The media type of the agent's event streams (its OpenAPI document says which
# operations answer with one).
EVENTS = "application/x-ndjson"


@dataclass(frozen=True)
class AgentOperation:
    """One operation of the agent: method, path template, permission, and the
    pattern each path parameter must match."""

    method: str
    path: str
    access: str
    params: tuple[tuple[str, str], ...] = ()
    # Answers with an event stream (ndjson or SSE: an execution's, a watch's):
    # passed on event by event, and never ended silently (proxy.py).
    streams: bool = False
    # A GET that upgrades to a WebSocket (a terminal's attachment): tunnelled
    # after the handshake (tunnel.py).
    websocket: bool = False

    @property
    def operation(self) -> Operation:
        return GATEWAY_CLASSES[self.access]

    def matches(self, method: str, segments: list[str]) -> bool:
        if method != self.method:
            return False
        template = self.path.split("/")[1:]
        if len(template) != len(segments):
            return False
        patterns = dict(self.params)
        for want, got in zip(template, segments, strict=True):
            if want.startswith("{") and want.endswith("}"):
                if not re.fullmatch(patterns[want[1:-1]], got):
                    return False
            elif want != got:
                return False
        return True


def find(table: tuple[AgentOperation, ...], method: str, agent_path: str) -> AgentOperation | None:
    """The entry for `method` on `agent_path` (`/v1/...`, canonical), or None.
    HEAD is the GET of the same path (the agent answers it so)."""
    segments = agent_path.split("/")[1:]
    wanted = "GET" if method == "HEAD" else method
    return next((op for op in table if op.matches(wanted, segments)), None)


# -- generation ---------------------------------------------------------------------


def entries(document: dict[str, Any]) -> list[AgentOperation]:
    """The forwarded operations of an agent OpenAPI document. Every operation
    must declare a known access class: a new one without it fails here, at
    generation, rather than being forwarded by guess."""
    out: list[AgentOperation] = []
    for path, methods in sorted(document["paths"].items()):
        for method, spec in sorted(methods.items()):
            access = spec.get("x-access-class")
            if access in NOT_FORWARDED:
                continue
            if access not in GATEWAY_CLASSES:
                raise ValueError(f"{method.upper()} {path}: unknown x-access-class {access!r}")
            params = tuple(
                (p["name"], p["schema"].get("pattern", "[^/]+").removeprefix("^").removesuffix("$"))
                for p in spec.get("parameters", ())
                if p["in"] == "path"
            )
            ok = spec.get("responses", {}).get("200", {}).get("content", {})
            streams = EVENTS in ok
            websocket = "101" in spec.get("responses", {})
            out.append(AgentOperation(method.upper(), path, access, params, streams, websocket))
    return out


def error_codes(document: dict[str, Any]) -> list[str]:
    """The agent's error codes, as its document lists them."""
    detail = document["components"]["schemas"]["ErrorDetail"]
    codes: list[str] = detail["properties"]["code"]["enum"]
    return codes


def render(document: dict[str, Any]) -> str:
    table = entries(document)
    patterns = sorted({(name, pattern) for op in table for name, pattern in op.params})
    if len({name for name, _ in patterns}) != len(patterns):
        raise ValueError(f"one path parameter name, two patterns: {patterns}")
    q = json.dumps  # a Python string literal in the quotes ruff prefers
    constants = "".join(f"PATTERN_{name.upper()} = {q(pattern)}\n" for name, pattern in patterns)
    rows = "".join(
        f"    AgentOperation({q(op.method)}, {q(op.path)}, {q(op.access)}, ("
        + "".join(f"({q(name)}, PATTERN_{name.upper()}), " for name, _ in op.params).rstrip(" ")
        + ")"
        + (", True" if op.streams else "")  # streams
        + (", websocket=True" if op.websocket else "")
        + "),\n"
        for op in table
    )
    codes = "".join(f"    {code.upper()} = {q(code)}\n" for code in error_codes(document))
    return (
        "# Generated by `python -m sandbox_operator.gateway.operations` from\n"
        "# sandbox-agent/openapi.json (x-access-class, ErrorDetail.code). Do not edit by hand.\n"
        "from enum import StrEnum\n\n"
        "from sandbox_operator.gateway.operations import AgentOperation\n\n"
        f"{constants}\n"
        "# fmt: off\n"
        f"OPERATIONS: tuple[AgentOperation, ...] = (\n{rows})\n"
        "# fmt: on\n\n\n"
        "class AgentErrorCode(StrEnum):\n"
        '    """The codes of the agent\'s error answers; their meanings are in its document."""\n\n'
        f"{codes}"
    )


def render_from(root: Path) -> str:
    return render(json.loads((root / "sandbox-agent" / "openapi.json").read_text()))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(__file__).resolve().parents[3]
    text = render_from(root)
    if "--check" in args:
        if not GENERATED.exists() or GENERATED.read_text() != text:
            print(f"{GENERATED} is stale: run `make openapi`", file=sys.stderr)
            return 1
        return 0
    GENERATED.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
