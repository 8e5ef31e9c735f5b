"""One canonical form of a request path, checked before any decision.

The gateway decides who may do what from the path, and the agent (or a
sandbox's own server, for preview ports) acts on the path it receives. If the
two could read one path differently, a caller could pass the check for one
operation and reach another (`files/%2e%2e/executions`). So the gateway
never normalises: a path that is not already in canonical form is refused
with 400 before it is routed, authenticated or forwarded, and the path it
forwards is the one it decided on.

Canonical, for the gateway's own API (everything up to a preview port):
segments of unreserved characters only (RFC 3986: letters, digits, `-._~`),
none empty, none `.` or `..`, no trailing slash. Every name in that part is a
Kubernetes name, an execution id or a literal, so nothing there ever needs
percent-encoding: any `%`, `;`, `\\` or other character is refused.

The rest of a preview path belongs to the sandbox's own server, which may
use any characters; only what changes the path's structure is refused: dot
segments, empty segments (but a trailing slash), `;` parameters,
backslashes and control characters, raw or percent-encoded (in any number of
layers), and encoded slashes.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

_API_SEGMENT = re.compile(r"[A-Za-z0-9._~-]+")
# /v1/namespaces/{ns}/sandboxes/{name}/ports/{port}: the API part of a preview path.
_PREVIEW_DEPTH = 7
# Decoding layers tried on a preview segment: a third layer of encoding is as
# suspicious as a second, and more than that is refused outright.
_LAYERS = 3


class NotCanonical(ValueError):
    """The path is not in canonical form; the message says what is wrong."""


def _api_segments(segments: list[str]) -> None:
    for segment in segments:
        if segment == "":
            raise NotCanonical("empty path segments ('//' or a trailing '/') are not allowed")
        if segment in (".", ".."):
            raise NotCanonical("'.' and '..' path segments are not allowed")
        if not _API_SEGMENT.fullmatch(segment):
            raise NotCanonical(
                "path segments may hold only letters, digits and '-._~' (no percent-encoding,"
                f" ';', '\\' or other characters): {segment[:80]!r}"
            )


def _decoded_layers(segment: str) -> list[str]:
    """The segment and each layer of percent-decoding under it (invalid UTF-8
    kept as surrogates: it cannot hide a structural character)."""
    layers = [segment]
    for _ in range(_LAYERS):
        decoded = unquote(layers[-1], errors="surrogateescape")
        if decoded == layers[-1]:
            return layers
        layers.append(decoded)
    raise NotCanonical(f"too many layers of percent-encoding in {segment[:80]!r}")


def _preview_segments(segments: list[str]) -> None:
    for index, segment in enumerate(segments):
        if segment == "":
            if index == len(segments) - 1:
                continue  # a trailing slash: `/app/` is the app's own business
            raise NotCanonical("empty path segments ('//') are not allowed")
        for layer in _decoded_layers(segment):
            if layer in (".", ".."):
                raise NotCanonical("'.' and '..' path segments are not allowed (nor encoded)")
            if any(c in layer for c in "/\\;") or any(c < " " or c == "\x7f" for c in layer):
                raise NotCanonical(
                    "'\\', ';', control characters and encoded '/' are not allowed in paths,"
                    " in any encoding"
                )


def check(raw_path: str, *, preview_host: bool = False) -> None:
    """Raise NotCanonical unless `raw_path` (the request target as sent, without
    its query) is canonical. `preview_host`: the whole path is a preview port's
    (a request to `{port}-{name}-{namespace}.{preview domain}`)."""
    if not raw_path.startswith("/"):
        raise NotCanonical("the request target must be a path starting with '/'")
    if raw_path == "/":
        return
    segments = raw_path[1:].split("/")
    if preview_host:
        _preview_segments(segments)
        return
    api, rest = segments, []
    if len(segments) > _PREVIEW_DEPTH and segments[:1] == ["v1"] and segments[5] == "ports":
        api, rest = segments[:_PREVIEW_DEPTH], segments[_PREVIEW_DEPTH:]
    _api_segments(api)
    if rest:
        _preview_segments(rest)
