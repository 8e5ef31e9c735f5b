"""E2B's code interpreter (sandbox port 49999) on the agent's code contexts.

E2B's code-interpreter SDKs call a server in the sandbox: `POST /execute`
streams NDJSON lines, and `/contexts` creates, lists, restarts and removes
kernels. Here every call becomes the agent's (`/v1/code/run`,
`/v1/contexts`), and the agent's events become E2B's lines as they come:

    agent event             E2B line(s)
    started                 (none: E2B has no such line)
    stdout, stderr          {"type": "stdout"|"stderr", "text", "timestamp"}
    result                  {"type": "result", "text", "html", "png", ...,
                             "extra": {other MIME types}, "is_main_result"}
    error                   {"type": "error", "name", "value", "traceback": str}
    finished                number_of_executions (the kernel's count), an error
                            for a run that ended without one (aborted,
                            timed out), then end_of_execution
    (5 s of quiet)          {"type": "keepalive"} (the SDKs skip it)

Contexts live in the agent, none in the gateway (its replicas share no
state, and a caller's next request may reach another). E2B's server starts a
default context per language at boot and lists them; the agent starts its
default contexts (`default-python`, `default-javascript`) on first use. So
the list shows both defaults whether or not they started yet, and a run, a
restart or a removal that names one is the language's default context.

E2B speaks absolute working directories; the agent's are relative to the
workspace. A context's cwd is translated both ways against the workspace's
mount path, and one outside the workspace is refused.

A caller that leaves mid-run (the SDK's `timeout` closes the connection)
cancels the handler, which closes the agent's stream: the agent interrupts
the run and the context's state stays. The run's own time limit is the
caller's, so the agent gets the longest one it takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import posixpath
import re
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from sandbox_operator.gateway.e2b import core
from sandbox_operator.gateway.e2b.core import Adapter, E2BError, Endpoint, Target, json_response

JSON = dict[str, Any]
NDJSON = "application/x-ndjson"
# The agent's bounds (sandbox-agent models.CodeRequest, ContextRequest): code
# of at most 1 MiB characters, a context id of its pattern, env names and values.
MAX_CODE = 1 << 20
CONTEXT_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]{0,1023}")
MAX_ENV_VALUE = 128 << 10
MAX_ENV = 256
# A request body: a cell's code JSON-escaped can be several times its length.
MAX_BODY = 8 << 20
MAX_SMALL_BODY = 64 << 10
# The longest run the agent takes: the caller's deadline is the one that counts.
RUN_SECONDS = 86400.0
# An event line of the agent, at most (a result holds an image; the agent's
# bridge bounds a line to 32 MiB).
MAX_EVENT = 40 << 20
# Seconds of quiet before a keepalive line: it keeps idle proxies from closing
# the stream, and finds a caller that left without a word.
KEEPALIVE_SECONDS = 5.0
KEEPALIVE = b'{"type": "keepalive"}\n'
# How long the end of the agent's stream may take after its last event.
DRAIN_SECONDS = 2.0
# The languages of the agent's kernels, and E2B's names for them.
LANGUAGES = {"python": "python", "javascript": "javascript", "js": "javascript"}
DEFAULT_PREFIX = "default-"
DEFAULTS = tuple(DEFAULT_PREFIX + language for language in ("python", "javascript"))
# The MIME types that E2B's result has a field for; the rest go to `extra`.
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}
# What a run that ended without an error of its own reports as one.
ENDINGS = {
    "timed_out": ("TimeoutError", "the run passed its time limit and was interrupted"),
    "interrupted": ("KeyboardInterrupt", "the run was interrupted"),
    "aborted": ("ExecutionAborted", "the run was aborted"),
}


class InterpreterError(E2BError):
    """An answer of the interpreter's port: E2B's server answers errors in plain
    text, which its SDKs put in the exception they raise (404: NotFoundException,
    502: the sandbox is not running, others: SandboxException)."""

    def response(self) -> web.Response:
        return web.Response(status=self.status, text=self.message, content_type="text/plain")


def _shown(text: str) -> str:
    """A caller's string, bounded, for a message."""
    return repr(text[:100] + ("..." if len(text) > 100 else ""))


def context_not_found(context_id: str) -> InterpreterError:
    return InterpreterError(404, f"Context {_shown(context_id)} not found")


# -- requests -----------------------------------------------------------------------


def language_of(value: Any) -> str | None:
    """The agent's language for E2B's `language` (None: not given)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise InterpreterError(400, "language must be a string")
    language = LANGUAGES.get(value.strip().lower())
    if language is None:
        raise InterpreterError(
            400,
            f"language {_shown(value)} is not available: the sandbox runs python and "
            "javascript (js) code",
        )
    return language


def run_body(body: Any) -> JSON:
    """The agent's code run for an E2B `/execute` body (fields code, context_id,
    language, env_vars; others are ignored, as E2B's server does)."""
    if not isinstance(body, dict):
        raise InterpreterError(400, "the body must be a JSON object")
    code = body.get("code")
    if not isinstance(code, str):
        raise InterpreterError(400, "code must be a string")
    if len(code) > MAX_CODE:
        raise InterpreterError(413, f"code is at most {MAX_CODE} characters")
    context_id = body.get("context_id")
    if context_id is not None and not isinstance(context_id, str):
        raise InterpreterError(400, "context_id must be a string")
    language = language_of(body.get("language"))
    if context_id and language:
        raise InterpreterError(400, "Only one of context_id or language can be provided")
    run: JSON = {"code": code, "timeoutSeconds": RUN_SECONDS}
    if context_id:
        if not re.fullmatch(CONTEXT_ID, context_id):
            raise context_not_found(context_id)
        if context_id in DEFAULTS:
            # The language's default context, which the agent starts on first use.
            run["language"] = context_id.removeprefix(DEFAULT_PREFIX)
        else:
            run["contextId"] = context_id
    else:
        run["language"] = language or "python"
    env = env_of(body.get("env_vars"))
    if env:
        run["env"] = env
    return run


def env_of(value: Any) -> dict[str, str]:
    """E2B's `env_vars`: variables for this run only."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InterpreterError(400, "env_vars must be an object of strings")
    if len(value) > MAX_ENV:
        raise InterpreterError(400, f"env_vars holds at most {MAX_ENV} variables")
    for name, text in value.items():
        if not ENV_NAME.fullmatch(name):
            raise InterpreterError(400, f"env_vars: {_shown(name)} is not a variable name")
        if not isinstance(text, str) or "\0" in text or len(text) > MAX_ENV_VALUE:
            raise InterpreterError(
                400,
                f"env_vars: the value of {name} must be a string without NUL, "
                f"at most {MAX_ENV_VALUE} characters",
            )
    return dict(value)


def context_body(body: Any, workspace: str) -> JSON:
    """The agent's context for an E2B `POST /contexts` body (language, cwd)."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise InterpreterError(400, "the body must be a JSON object")
    out: JSON = {"language": language_of(body.get("language")) or "python"}
    cwd = body.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise InterpreterError(400, "cwd must be a string")
    if cwd:
        out["cwd"] = relative_cwd(cwd, workspace)
    return out


def relative_cwd(cwd: str, workspace: str) -> str:
    """An E2B working directory as the agent's: relative to the workspace. An
    absolute one must be the workspace or inside it, and canonical."""
    if "\0" in cwd or len(cwd) > 4096:
        raise InterpreterError(400, "cwd must be a path")
    path = cwd.rstrip("/") or "/"
    if posixpath.normpath(path) != path or path == ".." or path.startswith("../"):
        raise InterpreterError(400, f"cwd {_shown(cwd)} is not a canonical path")
    if not path.startswith("/"):
        return path  # relative to the workspace already (the agent checks it too)
    root = workspace.rstrip("/")
    if path == (root or "/"):
        return "."
    if not path.startswith(root + "/"):
        raise InterpreterError(
            400,
            f"cwd {_shown(cwd)} is outside the sandbox's workspace ({workspace}): "
            "code contexts run inside it",
        )
    return path[len(root) + 1 :]


def absolute_cwd(cwd: Any, workspace: str) -> str:
    """The agent's context directory (relative to the workspace) as E2B's."""
    if not isinstance(cwd, str) or cwd in ("", "."):
        return workspace
    return posixpath.join(workspace, cwd)


def e2b_context(view: Any, workspace: str) -> JSON | None:
    """E2B's context for the agent's view of one (None when it is not one)."""
    if not isinstance(view, dict) or not isinstance(view.get("id"), str):
        return None
    language = view.get("language")
    return {
        "id": view["id"],
        "language": language if isinstance(language, str) else "python",
        "cwd": absolute_cwd(view.get("cwd"), workspace),
    }


def e2b_contexts(listing: Any, workspace: str) -> list[JSON]:
    """E2B's context list for the agent's: the default contexts first, listed
    before their first use as E2B's server (which starts them at boot) lists
    them, then every context in the order the agent made them."""
    views = listing.get("contexts") if isinstance(listing, dict) else None
    found = [c for c in (e2b_context(v, workspace) for v in views or []) if c is not None]
    ids = {c["id"] for c in found}
    defaults = [
        {"id": cid, "language": cid.removeprefix(DEFAULT_PREFIX), "cwd": workspace}
        for cid in DEFAULTS
        if cid not in ids
    ]
    return defaults + found


# -- the events of a run -------------------------------------------------------------


def _timestamp() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()


def strip_quotes(text: str) -> str:
    """E2B's server shows a string result without the quotes of its repr
    (`'abc'` -> `abc`), and its SDKs' users compare against that."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def result_line(data: Mapping[str, Any], is_main: bool) -> JSON:
    """E2B's result for a MIME bundle: a field per known type, the others in extra."""
    line: JSON = {"type": "result"}
    extra: JSON = {}
    for mime, value in data.items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        elif value is not None:
            line[field] = value
    if isinstance(line.get("text"), str):
        line["text"] = strip_quotes(line["text"])
    line["extra"] = extra
    line["is_main_result"] = is_main
    return line


def error_line(name: str, value: str, traceback: str = "") -> JSON:
    return {"type": "error", "name": name, "value": value, "traceback": traceback}


class Translation:
    """One run's agent events into E2B's lines (pure: no I/O)."""

    def __init__(self) -> None:
        self.errored = False
        self.finished = False

    def line(self, raw: bytes) -> list[JSON]:
        """E2B's lines for one of the agent's (an empty or unreadable line: none)."""
        if not raw.strip():
            return []
        try:
            event = json.loads(raw)
        except (ValueError, RecursionError):
            return []
        return self.event(event) if isinstance(event, dict) else []

    def event(self, event: JSON) -> list[JSON]:
        if self.finished:
            return []
        kind = event.get("type")
        if kind in ("stdout", "stderr"):
            text = event.get("text")
            if not isinstance(text, str):
                return []
            return [{"type": kind, "text": text, "timestamp": _timestamp()}]
        if kind == "result":
            data = event.get("data")
            if not isinstance(data, dict):
                return []
            return [result_line(data, event.get("isMain") is True)]
        if kind == "error":
            self.errored = True
            traceback = event.get("traceback")
            lines = (
                [t for t in traceback if isinstance(t, str)] if isinstance(traceback, list) else []
            )
            return [
                error_line(
                    _str(event.get("name")) or "Error", _str(event.get("value")), "\n".join(lines)
                )
            ]
        if kind == "finished":
            return self._finished(event)
        return []  # started, and what a newer agent may add

    def _finished(self, event: JSON) -> list[JSON]:
        self.finished = True
        out: list[JSON] = []
        count = event.get("executionCount")
        if isinstance(count, int) and not isinstance(count, bool):
            out.append({"type": "number_of_executions", "execution_count": count})
        status = event.get("status")
        if status in ENDINGS and not self.errored:
            name, value = ENDINGS[status]
            message = _str(event.get("message"))
            if event.get("restarted") is True:
                value += ", and its kernel was started again: its state is gone"
            out.append(error_line(name, f"{value} ({message})" if message else value))
            self.errored = True
        out.append({"type": "end_of_execution"})
        return out

    def broken(self, why: str) -> list[JSON]:
        """The lines that end a run whose stream ended before its last event."""
        if self.finished:
            return []
        self.finished = True
        return [error_line("UnexpectedEndOfExecution", why), {"type": "end_of_execution"}]


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def encode(lines: list[JSON]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


# -- the port -----------------------------------------------------------------------


class Interpreter:
    """The interpreter port's endpoints."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter

    def endpoints(self) -> list[Endpoint]:
        port = core.INTERPRETER_PORT
        one = f"/contexts/(?P<id>{CONTEXT_ID})"
        return [
            Endpoint(port, "POST", "/execute", self.execute),
            Endpoint(port, "POST", "/contexts", self.create),
            Endpoint(port, "GET", "/contexts", self.list),
            Endpoint(port, "DELETE", one, self.remove),
            Endpoint(port, "POST", one + "/restart", self.restart),
            Endpoint(port, "GET", "/health", self.health),
        ]

    # -- /execute ---------------------------------------------------------------------

    async def execute(
        self, request: web.Request, target: Target, params: dict[str, str]
    ) -> web.StreamResponse:
        run = run_body(await self._body(request, MAX_BODY))
        upstream = await self.adapter.agent(
            target, "POST", "code/run", json_body=run, headers={"Accept": NDJSON}
        )
        try:
            if upstream.status >= 500 and await self.adapter.leaving(target):
                return self._cut(request)
            if upstream.status != 200:
                raise await self._refusal(upstream, run.get("contextId"))
            response = web.StreamResponse(
                status=200, headers={"Content-Type": NDJSON, "Cache-Control": "no-store"}
            )
            await response.prepare(request)
            translation = Translation()
            why = await self._relay(upstream, response, translation)
            if why is not None and not translation.finished and await self.adapter.leaving(target):
                # The run died with its sandbox: the SDK hears a broken connection,
                # asks whether the sandbox runs, and says it was killed.
                return self._cut(request, response)
            with contextlib.suppress(ConnectionResetError):
                last = translation.broken(why) if why is not None else []
                if last:
                    await response.write(encode(last))
                await response.write_eof()
            return response
        finally:
            # A run not read to its end (the caller left) closes the connection,
            # so the agent sees the disconnect and interrupts the run.
            if upstream.content.at_eof():
                upstream.release()
            else:
                upstream.close()

    async def _relay(
        self,
        upstream: aiohttp.ClientResponse,
        response: web.StreamResponse,
        translation: Translation,
    ) -> str | None:
        """The agent's events, translated as they come; the caller's departure
        cancels this (the gateway's handler cancellation). Why the stream ended
        short of its last events, or None when there is nobody left to tell."""
        streams = self.adapter.gateway.upstreams
        task = asyncio.current_task()
        assert task is not None
        streams.streams.add(task)
        pending = bytearray()
        why = "the sandbox's stream ended before the run did"
        try:
            while True:
                # After the last event, the rest of the agent's stream (its end)
                # is read too, so that the connection goes back to the pool.
                wait = KEEPALIVE_SECONDS if not translation.finished else DRAIN_SECONDS
                try:
                    async with asyncio.timeout(wait):
                        chunk = await upstream.content.readany()
                except TimeoutError:
                    if translation.finished:
                        break
                    await response.write(KEEPALIVE)
                    continue
                if not chunk:
                    break
                start = len(pending)
                pending += chunk
                lines: list[JSON] = []
                while (end := pending.find(b"\n", start)) >= 0:
                    lines += translation.line(bytes(pending[:end]))
                    del pending[: end + 1]
                    start = 0
                if len(pending) > MAX_EVENT:
                    why = f"an event of the sandbox's was over {MAX_EVENT >> 20} MiB"
                    break
                if lines:
                    await response.write(encode(lines))
        except ConnectionResetError:
            return None  # the caller left: nobody to tell
        except asyncio.CancelledError:
            if not streams.closing:
                raise  # the caller left
            why = "the gateway replica is shutting down"
        except (aiohttp.ClientError, OSError):
            why = "the connection to the sandbox broke off"
        finally:
            streams.streams.discard(task)
        return why

    @staticmethod
    def _cut(
        request: web.Request, response: web.StreamResponse | None = None
    ) -> web.StreamResponse:
        """End the caller's connection without an answer (or mid-answer)."""
        if request.transport is not None:
            request.transport.abort()
        return response if response is not None else web.Response(status=502)

    # -- /contexts --------------------------------------------------------------------

    async def create(
        self, request: web.Request, target: Target, params: dict[str, str]
    ) -> web.Response:
        workspace = target.route.workspace
        wanted = context_body(await self._body(request, MAX_SMALL_BODY), workspace)
        async with await self.adapter.agent(
            target, "POST", "contexts", json_body=wanted
        ) as upstream:
            if upstream.status not in (200, 201):
                raise await self._refusal(upstream, None)
            made = e2b_context(await _json(upstream), workspace)
        if made is None:
            raise InterpreterError(
                502, f"The sandbox {target.id} answered a context it did not describe"
            )
        return json_response(made)

    async def list(
        self, request: web.Request, target: Target, params: dict[str, str]
    ) -> web.Response:
        async with await self.adapter.agent(target, "GET", "contexts") as upstream:
            if upstream.status != 200:
                raise await self._refusal(upstream, None)
            listing = await _json(upstream)
        return json_response(e2b_contexts(listing, target.route.workspace))

    async def remove(
        self, request: web.Request, target: Target, params: dict[str, str]
    ) -> web.Response:
        return await self._one(target, "DELETE", params["id"], "")

    async def restart(
        self, request: web.Request, target: Target, params: dict[str, str]
    ) -> web.Response:
        return await self._one(target, "POST", params["id"], "/restart")

    async def _one(self, target: Target, method: str, context_id: str, tail: str) -> web.Response:
        async with await self.adapter.agent(
            target, method, f"contexts/{context_id}{tail}"
        ) as upstream:
            if upstream.status in (200, 204):
                return web.Response(status=204)
            if upstream.status == 404 and context_id in DEFAULTS:
                # A default context not started yet: nothing to stop, and its
                # first run starts it fresh.
                return web.Response(status=204)
            raise await self._refusal(upstream, context_id)

    async def health(
        self, request: web.Request, target: Target, params: dict[str, str]
    ) -> web.Response:
        return json_response("OK")

    # -- helpers ----------------------------------------------------------------------

    async def _body(self, request: web.Request, limit: int) -> Any:
        """The request's JSON body (None when it has none), read within the
        gateway's body deadline."""
        if request.content_length is not None and request.content_length > limit:
            raise InterpreterError(413, f"the body is at most {limit} bytes")
        data = bytearray()
        try:
            async with asyncio.timeout(self.adapter.gateway.upstreams.body_seconds):
                while chunk := await request.content.read(limit + 1 - len(data)):
                    data += chunk
                    if len(data) > limit:
                        raise InterpreterError(413, f"the body is at most {limit} bytes")
        except TimeoutError as exc:
            raise InterpreterError(408, "the body did not arrive in time") from exc
        except RequestPayloadError as exc:  # a Content-Encoding that does not decode
            raise InterpreterError(400, f"the body could not be read: {exc}") from None
        if not data.strip():
            return None
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise InterpreterError(400, f"the body is not JSON: {exc}") from exc

    async def _refusal(
        self, upstream: aiohttp.ClientResponse, context_id: str | None
    ) -> InterpreterError:
        """The agent's refusal in E2B's words (its status; a missing context: 404)."""
        status = upstream.status
        if status == 404 and context_id is not None:
            return context_not_found(context_id)
        body = await _json(upstream, limit=64 << 10)
        error = body.get("error") if isinstance(body, dict) else None
        message = _str(error.get("message")) if isinstance(error, dict) else ""
        return InterpreterError(status, message[:2000] or f"the sandbox answered {status}")


async def _json(upstream: aiohttp.ClientResponse, limit: int = 4 << 20) -> Any:
    """An answer of the agent's as JSON (None when it is not, or is too long)."""
    data = bytearray()
    try:
        while chunk := await upstream.content.read(limit + 1 - len(data)):
            data += chunk
            if len(data) > limit:
                return None
        return json.loads(data)
    except (ValueError, RecursionError, aiohttp.ClientError, OSError):
        return None
