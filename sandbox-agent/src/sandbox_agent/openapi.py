"""The OpenAPI 3.1 document, built from app.OPS and the msgspec models.

``python -m sandbox_agent.openapi > openapi.json`` refreshes the checked-in
copy; a test fails when it is stale.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

import msgspec

from . import __version__, models

_REF = "#/components/schemas/{name}"

_RAW_MEDIA = {
    "binary": ("application/octet-stream", {"type": "string", "format": "binary"}),
    "tar": ("application/x-tar", {"type": "string", "format": "binary"}),
    "prometheus": ("text/plain", {"type": "string"}),
    "object": ("application/json", {"type": "object"}),
}


def _param(p: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": p.type}
    if p.enum:
        schema["enum"] = list(p.enum)
    if p.minimum is not None:
        schema["minimum"] = p.minimum
    if p.maximum is not None:
        schema["maximum"] = p.maximum
    if p.name == "mode":
        schema["pattern"] = "^0?[0-7]{3,4}$"
    return {
        "name": p.name,
        "in": p.location,
        "required": p.required or p.location == "path",
        "description": p.description,
        "schema": schema,
    }


@functools.cache
def document() -> dict[str, Any]:
    from .app import OPS  # late: app imports this module's users

    types: list[Any] = [models.ErrorBody, models.StreamEvent]
    for op in OPS:
        if isinstance(op.body, type):
            types.append(op.body)
        types.extend(t for t in op.responses.values() if isinstance(t, type))
    uniq = list(dict.fromkeys(types))
    refs, components = msgspec.json.schema_components(uniq, ref_template=_REF)
    ref_of = dict(zip(uniq, refs, strict=True))

    paths: dict[str, dict[str, Any]] = {}
    for op in OPS:
        entry: dict[str, Any] = {
            "operationId": op.handler.__name__,
            "summary": op.summary,
            "tags": [op.tag],
        }
        if op.params:
            entry["parameters"] = [_param(p) for p in op.params]
        if op.body is not None:
            if isinstance(op.body, str):
                media, schema = _RAW_MEDIA[op.body]
                entry["requestBody"] = {"required": True, "content": {media: {"schema": schema}}}
            else:
                entry["requestBody"] = {
                    "required": op.body is not models.CancelRequest,
                    "content": {"application/json": {"schema": ref_of[op.body]}},
                }
        responses: dict[str, Any] = {}
        for status, typ in sorted(op.responses.items()):
            desc = "OK" if status < 300 else "Error"
            if typ is None:
                responses[str(status)] = {"description": "No content"}
            elif typ == "events":
                ev = ref_of[models.StreamEvent]
                responses[str(status)] = {
                    "description": "One StreamEvent per line (ndjson) or per SSE event",
                    "content": {
                        "application/x-ndjson": {"schema": ev},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                }
            elif typ == "tar":
                binary = {"type": "string", "format": "binary"}
                responses[str(status)] = {
                    "description": "tar (gzip=false) or tar.gz (gzip=true)",
                    "content": {
                        "application/x-tar": {"schema": binary},
                        "application/gzip": {"schema": binary},
                    },
                }
            elif isinstance(typ, str):
                media, schema = _RAW_MEDIA[typ]
                responses[str(status)] = {
                    "description": desc,
                    "content": {media: {"schema": schema}},
                }
            else:
                responses[str(status)] = {
                    "description": desc,
                    "content": {"application/json": {"schema": ref_of[typ]}},
                }
        err = {"content": {"application/json": {"schema": ref_of[models.ErrorBody]}}}
        if not op.public:
            responses.setdefault("401", {"description": "Missing or wrong bearer token", **err})
        if op.body is not None or op.params:
            responses.setdefault("400", {"description": "Invalid request", **err})
        if not op.public:
            # Any other client error (404, 409, 413, ...) has the same error body.
            responses.setdefault("4XX", {"description": "Client error (see error.code)", **err})
        entry["responses"] = responses
        if op.public:
            entry["security"] = []
        paths.setdefault(op.path, {})[op.method.lower()] = entry

    return {
        "openapi": "3.1.0",
        "info": {
            "title": "sandbox-agent",
            "version": __version__,
            "description": "In-pod sidecar API of the sandbox operator: exec, files, activity. "
            "All paths except /healthz and /readyz need 'Authorization: Bearer <token>'. "
            'Errors are {"error": {"code", "message", "details"?}}.',
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def render() -> str:
    return json.dumps(document(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
