"""The OpenAPI 3.1 document of a route table (``document(ops)``).

Like Starlette's schema generator, it takes the table as an argument and
imports neither the app nor the handlers, so routes and docs cannot disagree
and never import each other. ``python -m sandbox_agent.openapi > openapi.json``
refreshes the checked-in copy from ``routes.OPS``; a test fails when it is stale.
"""

from __future__ import annotations

import inspect
import json
import sys
from typing import Any

import msgspec

from . import __version__, errors, models
from .routing import Op, Param, public_paths

_REF = "#/components/schemas/{name}"
_BINARY = {"type": "string", "format": "binary"}
# Raw (non-JSON-schema) bodies: kind -> {media type: schema}
_RAW: dict[str, dict[str, Any]] = {
    "binary": {"application/octet-stream": _BINARY},
    "tar": {"application/x-tar": _BINARY},
    "prometheus": {"text/plain": {"type": "string"}},
    "object": {"application/json": {"type": "object"}},
}
# Event streams: kind -> the model of one event.
_STREAMS: dict[str, type[Any]] = {
    "events": models.StreamEvent,
    "watch": models.WatchEvent,
    "code": models.CodeEvent,
}
_RAW_RESPONSES: dict[str, tuple[str, dict[str, Any]]] = {
    "tar": (
        "tar (gzip=false) or tar.gz (gzip=true)",
        {"application/x-tar": _BINARY, "application/gzip": _BINARY},
    ),
}


def _param(p: Param) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": p.type}
    for key, value in (
        ("enum", list(p.enum) if p.enum else None),
        ("minimum", p.minimum),
        ("maximum", p.maximum),
        ("pattern", p.pattern),
        ("default", p.default),
    ):
        if value is not None:
            schema[key] = value
    return {
        "name": p.name,
        "in": p.location,
        "required": p.required or p.location == "path",
        "description": p.description,
        "schema": schema,
    }


def _content(typ: Any, ref_of: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    if isinstance(typ, str):
        return {media: {"schema": schema} for media, schema in _RAW[typ].items()}
    return {"application/json": {"schema": ref_of[typ]}}


def _response(status: int, typ: Any, ref_of: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    if typ is None:
        return {"description": "No content"}
    if typ == "error":
        return {"description": "Error", **_error(ref_of)}
    if typ == "websocket":
        return {"description": "Switching Protocols: a WebSocket (see the description)"}
    if typ in _STREAMS:
        model = _STREAMS[typ]
        return {
            "description": f"One {model.__name__} per line (ndjson) or per SSE event",
            "content": {
                "application/x-ndjson": {"schema": ref_of[model]},
                "text/event-stream": {"schema": {"type": "string"}},
            },
        }
    if isinstance(typ, str) and typ in _RAW_RESPONSES:
        desc, media = _RAW_RESPONSES[typ]
        return {"description": desc, "content": {m: {"schema": s} for m, s in media.items()}}
    return {"description": "OK" if status < 300 else "Error", "content": _content(typ, ref_of)}


def _error(ref_of: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": ref_of[models.ErrorBody]}}}


def _error_code() -> dict[str, Any]:
    """The schema of ``ErrorDetail.code``: every code of ``errors.CODES`` as an
    enum, with its status and meaning (a table for readers, x-enum-descriptions
    in the enum's order for generators: the SDK's and the gateway's names)."""
    listed = sorted(errors.CODES.items())
    rows = "".join(f"\n| `{code}` | {e.status} | {e.meaning} |" for code, e in listed)
    return {
        "type": "string",
        "description": "Stable machine-readable code: what went wrong. A client branches on"
        " it, not on the message.\n\n| code | status | meaning |\n|---|---|---|" + rows,
        "enum": [code for code, _ in listed],
        "x-enum-descriptions": [f"{e.status}: {e.meaning}" for _, e in listed],
    }


def _operation(op: Op, ref_of: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "operationId": op.handler.__name__,
        "summary": op.summary,
        "tags": [op.tag],
        # Read by the gateway's generator: the permission it demands, or
        # "operator"/"public"/"metrics" for what it never forwards.
        "x-access-class": op.access_class,
    }
    if op.description:
        entry["description"] = op.description
    if op.params:
        entry["parameters"] = [_param(p) for p in op.params]
    if op.body is not None:
        entry["requestBody"] = {
            "required": op.body_required,
            "content": _content(op.body, ref_of),
        }
    responses = {str(s): _response(s, t, ref_of) for s, t in sorted(op.responses().items())}
    public = op.access == "public"
    if not public:
        responses.setdefault(
            "401", {"description": "Missing or wrong bearer token", **_error(ref_of)}
        )
    if op.body is not None or op.params:
        responses.setdefault("400", {"description": "Invalid request", **_error(ref_of)})
    if not public:
        # Any other client error (404, 409, 413, ...) has the same error body.
        responses.setdefault(
            "4XX", {"description": "Client error (see error.code)", **_error(ref_of)}
        )
    entry["responses"] = responses
    if public:
        entry["security"] = []
    return entry


def _clean_descriptions(node: Any) -> Any:
    """Every `description` taken from a docstring, with its indentation removed
    (inspect.cleandoc): msgspec 0.23 does this itself and 0.22 did not, so the
    document is the same whichever one is installed."""
    if isinstance(node, dict):
        return {
            key: inspect.cleandoc(value)
            if key == "description" and isinstance(value, str)
            else _clean_descriptions(value)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_clean_descriptions(item) for item in node]
    return node


def document(ops: tuple[Op, ...]) -> dict[str, Any]:
    """The OpenAPI document of ``ops`` (pure: same table, same document)."""
    types: list[Any] = [models.ErrorBody, *_STREAMS.values()]
    for op in ops:
        if isinstance(op.body, type):
            types.append(op.body)
        types.extend(t for t in op.responses().values() if isinstance(t, type))
    uniq = list(dict.fromkeys(types))
    refs, components = msgspec.json.schema_components(uniq, ref_template=_REF)
    components = _clean_descriptions(components)
    ref_of = dict(zip(uniq, refs, strict=True))
    components["ErrorDetail"]["properties"]["code"] = _error_code()

    paths: dict[str, dict[str, Any]] = {}
    for op in ops:
        paths.setdefault(op.path, {})[op.method.lower()] = _operation(op, ref_of)
    *others, last = sorted(public_paths(ops, metrics_auth=True))
    public = f"{', '.join(others)} and {last}" if others else last
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "sandbox-agent",
            "version": __version__,
            "description": "In-pod sidecar API of the sandbox operator: exec, files, activity. "
            f"All paths except {public} need 'Authorization: Bearer <token>'. "
            'Errors are {"error": {"code", "message", "details"?}}.',
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def render(ops: tuple[Op, ...]) -> str:
    return json.dumps(document(ops), indent=2, sort_keys=True) + "\n"


def main() -> int:
    # The command-line edge is the one place here that knows the table.
    from .routes import OPS

    sys.stdout.write(render(OPS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
