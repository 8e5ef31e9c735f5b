"""The sandbox daemon's plain HTTP routes: `/files` (download, upload) and `/envs`.

    GET  /files?path=&username=     the file, streamed from the agent's
                                    files/content (gzip when Accept-Encoding asks)
    POST /files?path=&username=     multipart (one `file` part or many, each
                                    named by its filename, or by `path` when
                                    given) or octet-stream (`path` required);
                                    each file streamed to the agent's atomic
                                    write; answers [{path, name, type}]
    GET  /envs                      the variables commands start with beyond the
                                    image's: the Sandbox's env and the agent's
                                    environment overlay, with E2B_SANDBOX=true

Errors as envd answers them: `{"code": <status>, "message"}`, 400 for a bad
path, 401 for an unknown user or a bad signature, 404 for a missing file.
Nothing is held whole in memory: bodies pass through in chunks (a gzip body
is inflated in bounded chunks by the server before it gets here).

Signed URLs (E2B's `download_url`/`upload_url`): `signature` =
`v1_` + base64(sha256("path:operation:user:token[:expiration]")), computed by
the SDK from the access token. A request with a signature and no access token
is resolved here (`signed_target`): the access token of each sandbox with that
ID is recomputed (under every key that verifies) and the signature compared
in constant time; only then does anything about the sandbox matter.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import time
import zlib
from collections.abc import AsyncIterator, Awaitable
from email.message import Message
from typing import Any, TypeVar
from urllib.parse import quote

import aiohttp
from aiohttp import BodyPartReader, web
from aiohttp.web_protocol import RequestPayloadError

from sandbox_operator.effective import sandbox_spec
from sandbox_operator.gateway.agent_table import AgentErrorCode
from sandbox_operator.gateway.e2b import core, paths
from sandbox_operator.gateway.e2b.core import Adapter, E2BError, Endpoint, Target
from sandbox_operator.gateway.e2b.entries import agent_message
from sandbox_operator.kube import KubeError
from sandbox_operator.resources import SANDBOXES

JSON = dict[str, Any]
T = TypeVar("T")
CHUNK = 256 << 10
OCTET = "application/octet-stream"


def signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    """E2B's v1 signature of a file URL."""
    raw = f"{path}:{operation}:{user}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).decode().rstrip("=")


def wants_gzip(accept: str) -> bool | None:
    """Whether to gzip a download for `Accept-Encoding: accept`; None when neither
    gzip nor identity is acceptable (406)."""
    quality: dict[str, float] = {}
    for item in accept.split(","):
        name, _, rest = item.strip().partition(";")
        q = 1.0
        for param in rest.split(";"):
            key, _, value = param.strip().partition("=")
            if key.lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if name.strip():
            quality[name.strip().lower()] = q
    gzip = quality.get("gzip", quality.get("*", 0.0))
    identity = quality.get("identity", quality.get("*", 1.0) if "*" in quality else 1.0)
    if gzip > 0 and gzip >= identity:
        return True
    return False if identity > 0 else None


def media_type(header: str | None) -> str:
    """The media type of a Content-Type header, lowercased, without parameters;
    octet-stream when there is none. Not aiohttp's `request.content_type`: that
    runs the email package's header parser, a quarter of a millisecond per
    multipart upload (its cache never hits: each body has a boundary of its own)."""
    if header is None:
        return OCTET
    return header.split(";", 1)[0].strip().lower()


def disposition(name: str) -> str:
    if name.isascii() and name.isprintable() and '"' not in name and "\\" not in name:
        return f'inline; filename="{name}"'
    return f"inline; filename*=utf-8''{quote(name, safe='')}"


def _refusal(exc: paths.Refused) -> E2BError:
    return E2BError(exc.status, exc.message)


async def _agent_failure(response: aiohttp.ClientResponse, shown: str) -> E2BError:
    """An envd-shaped error for the agent's error answer."""
    code, message = agent_message(await response.read())
    status = response.status
    if status == 404:
        return E2BError(404, f"path '{shown}' does not exist")
    if code == AgentErrorCode.IS_A_DIRECTORY:
        return E2BError(400, f"path '{shown}' is a directory")
    if code == AgentErrorCode.NOT_A_FILE:
        return E2BError(400, f"path '{shown}' is not a regular file")
    if status == 507:
        return E2BError(507, f"not enough disk space available: {message}")
    sentence = message.split(": ", 1)[0] if ": " in message else message
    if status >= 500:
        return E2BError(502 if status in (502, 503) else 500, f"{sentence}: {shown}")
    return E2BError(status, f"{sentence}: {shown}")


class Files:
    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter

    @property
    def _stall(self) -> float:
        """How long an upload may go without a byte: a body that stops arriving
        must not hold a handler and a connection to the agent for ever (the
        connection guard's deadlines wait while a request is served)."""
        return self.adapter.gateway.settings.idle_seconds

    def endpoints(self) -> list[Endpoint]:
        return [
            Endpoint(core.ENVD_PORT, "GET", "/files", self.download, signed=self.signed_target),
            Endpoint(core.ENVD_PORT, "POST", "/files", self.upload, signed=self.signed_target),
            Endpoint(core.ENVD_PORT, "GET", "/envs", self.envs),
        ]

    # -- signed URLs --------------------------------------------------------------------

    async def signed_target(self, request: web.Request, sandbox_id: str) -> Target:
        """The sandbox a request without an access token reaches by its signature:
        401 unless the signature is one of that sandbox's access token."""
        given = request.query.get("signature", "")
        raw_expiration = request.query.get("signature_expiration")
        expiration = None
        if raw_expiration is not None:
            negative = raw_expiration.startswith("-")
            expiration = core.whole(raw_expiration[negative:], 18)
            if expiration is None:
                raise E2BError(400, "signature_expiration must be a Unix time in seconds")
            expiration = -expiration if negative else expiration
        operation = "write" if request.method == "POST" else "read"
        path = request.query.get("path", "")
        user = request.query.get("username", "")
        found: str | None = None
        if core.is_id(sandbox_id) and len(given) <= 100:
            # The ID names one Sandbox in one namespace as a rule, but nothing
            # stops two namespaces from holding namesakes: each is tried.
            table = self.adapter.gateway.table
            for route in [r for key, r in list(table.routes.items()) if key[1] == sandbox_id]:
                for token in self.adapter.access_tokens(route.namespace, route.name, route.uid):
                    expected = signature(path, operation, user, token, expiration)
                    if hmac.compare_digest(expected.encode(), given.encode()):
                        found = token
        if found is None:
            raise E2BError(401, "invalid signature")
        if expiration is not None and expiration < time.time():
            raise E2BError(401, "signature is already expired")
        return await self.adapter.target(sandbox_id, found)

    # -- download -----------------------------------------------------------------------

    async def download(
        self, request: web.Request, target: Target, params: dict[str, str]
    ) -> web.StreamResponse:
        home = target.route.workspace
        try:
            paths.check_user(request.query.get("username"))
            rel = paths.agent_path(request.query.get("path", ""), home)
        except paths.Refused as exc:
            raise _refusal(exc) from None
        shown = paths.e2b_path(rel, home)
        if rel == ".":
            raise E2BError(400, f"path '{shown}' is a directory")
        gzip = wants_gzip(request.headers.get("Accept-Encoding", ""))
        if gzip is None:
            raise E2BError(406, "no acceptable encoding found, supported: [identity, gzip]")
        upstream = await self.adapter.agent(target, "GET", "files/content", params={"path": rel})
        async with upstream:
            if upstream.status >= 400:
                raise await _agent_failure(upstream, shown)
            headers = {
                "Content-Type": OCTET,
                "Content-Disposition": disposition(shown.rsplit("/", 1)[-1]),
                "Vary": "Accept-Encoding",
                "Cache-Control": "no-store",
            }
            if gzip:
                headers["Content-Encoding"] = "gzip"
            elif "Content-Length" in upstream.headers:
                headers["Content-Length"] = upstream.headers["Content-Length"]
            response = web.StreamResponse(headers=headers)
            await response.prepare(request)
            if request.method == "HEAD":
                return response
            # wbits 31: a gzip stream; level 1: a download is bandwidth the
            # caller asked to save, not CPU the gateway should spend freely.
            packer = zlib.compressobj(1, zlib.DEFLATED, 31) if gzip else None
            async for chunk in upstream.content.iter_chunked(CHUNK):
                await response.write(packer.compress(chunk) if packer else chunk)
            if packer is not None:
                await response.write(packer.flush())
            await response.write_eof()
            return response

    # -- upload -------------------------------------------------------------------------

    async def upload(
        self, request: web.Request, target: Target, params: dict[str, str]
    ) -> web.StreamResponse:
        home = target.route.workspace
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("identity", "gzip", "x-gzip", ""):
            raise E2BError(400, f"unsupported Content-Encoding: {encoding[:50]}, supported: [gzip]")
        try:
            paths.check_user(request.query.get("username"))
        except paths.Refused as exc:
            raise _refusal(exc) from None
        if any(name.lower().startswith("x-metadata-") for name in request.headers):
            # E2B keeps these as extended attributes of the file: not kept here,
            # and better refused than dropped without a word.
            raise E2BError(400, "file metadata (X-Metadata-* headers) is not supported here")
        given = request.query.get("path")
        kind = media_type(request.headers.get("Content-Type"))
        written: list[JSON] = []
        if kind == OCTET:
            if given is None:
                raise E2BError(400, "path query parameter is required for raw body upload")
            rel, shown = self._resolve(given, home)
            written.append(
                await self._write(target, rel, shown, request.content.iter_chunked(CHUNK))
            )
        elif kind.startswith("multipart/"):
            reader = await _unbroken(request.multipart())
            while True:
                part = await _unbroken(reader.next(), self._stall)
                if part is None:
                    break
                if not isinstance(part, BodyPartReader) or part.name != "file":
                    await _unbroken(part.release(), self._stall)
                    continue
                name = given if given is not None else _filename(part)
                if name is None:
                    raise E2BError(400, "a file part needs a filename, or the path parameter")
                rel, shown = self._resolve(name, home)
                if any(w["path"] == shown for w in written):
                    raise E2BError(
                        400,
                        f"you cannot upload multiple files to the same path '{shown}' in one"
                        " upload request",
                    )
                written.append(await self._write(target, rel, shown, _part_chunks(part)))
        else:
            raise E2BError(
                400,
                f"unsupported content type: {kind[:100]}, expected multipart/form-data or"
                " application/octet-stream",
            )
        return web.json_response(written)

    @staticmethod
    def _resolve(name: str, home: str) -> tuple[str, str]:
        """(agent path, path shown) of a file to write."""
        try:
            rel = paths.agent_path(name, home)
        except paths.Refused as exc:
            raise _refusal(exc) from None
        shown = paths.e2b_path(rel, home)
        if rel == ".":
            raise E2BError(400, f"path '{shown}' is a directory")
        return rel, shown

    async def _write(
        self, target: Target, rel: str, shown: str, chunks: AsyncIterator[bytes]
    ) -> JSON:
        body = _Body(chunks, self._stall)
        try:
            upstream = await self.adapter.agent(
                target,
                "PUT",
                "files/content",
                params={"path": rel, "parents": "true"},
                data=body.__aiter__(),
                headers={"Content-Type": OCTET},
            )
        except E2BError:
            if isinstance(body.error, TimeoutError):
                raise E2BError(408, "the request body stopped arriving") from None
            if body.error is not None:
                raise E2BError(400, f"the request body could not be read: {body.error}") from None
            raise
        async with upstream:
            if upstream.status >= 400:
                raise await _agent_failure(upstream, shown)
            await upstream.read()
        return {"path": shown, "name": shown.rsplit("/", 1)[-1], "type": "file"}

    # -- environment --------------------------------------------------------------------

    async def envs(
        self, request: web.Request, target: Target, params: dict[str, str]
    ) -> web.StreamResponse:
        found: dict[str, str] = {"E2B_SANDBOX": "true"}
        try:
            body = await self.adapter.gateway.kube.get(
                SANDBOXES.path(target.namespace, target.route.name)
            )
        except KubeError as exc:
            raise E2BError(502, f"the sandbox's environment could not be read: {exc}") from None
        if body is not None:
            for var in sandbox_spec(body).env:
                if var.value is not None:
                    found[var.name] = var.value
        upstream = await self.adapter.agent(target, "GET", "environment")
        async with upstream:
            if upstream.status >= 400:
                raise await _agent_failure(upstream, "environment")
            overlay = await upstream.json()
        for name in overlay.get("unset") or []:
            found.pop(str(name), None)
        for name, value in (overlay.get("env") or {}).items():
            found[str(name)] = str(value)
        response = web.json_response(found)
        response.headers["Cache-Control"] = "no-store"
        return response


def _filename(part: BodyPartReader) -> str | None:
    """The filename of a multipart part as sent, a path as E2B's SDKs send it
    (aiohttp's own reading drops a leading '/', which would turn an absolute
    path into a relative one rather than refuse it)."""
    header = Message()
    header["Content-Disposition"] = part.headers.get("Content-Disposition", "")
    name = header.get_filename()
    return name if isinstance(name, str) else None


async def _unbroken(step: Awaitable[T], stall: float | None = None) -> T:
    """A step of reading a multipart body; 400 when the body is not one, 408
    when it stops arriving for `stall` seconds."""
    try:
        async with asyncio.timeout(stall):
            return await step
    except TimeoutError:
        raise E2BError(408, "the request body stopped arriving") from None
    except (RequestPayloadError, ValueError, AssertionError, KeyError) as exc:
        raise E2BError(400, f"the multipart body could not be read: {exc}") from None


class _Body:
    """The chunks of an upload on their way to the agent, and what stopped them:
    a body that cannot be read (a broken gzip or multipart stream) is the
    caller's fault, not the agent's being out of reach."""

    def __init__(self, chunks: AsyncIterator[bytes], stall: float | None = None) -> None:
        self.chunks = chunks
        self.stall = stall
        self.error: Exception | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            while True:
                # Each chunk within `stall` seconds: a body that stops arriving
                # is the caller's (408), not the agent's being out of reach.
                async with asyncio.timeout(self.stall):
                    try:
                        chunk = await anext(self.chunks)
                    except StopAsyncIteration:
                        return
                yield chunk
        except (RequestPayloadError, ValueError, AssertionError, TimeoutError) as exc:
            self.error = exc
            raise


async def _part_chunks(part: BodyPartReader) -> AsyncIterator[bytes]:
    while True:
        chunk = await part.read_chunk(CHUNK)
        if not chunk:
            return
        yield chunk
