"""Terminals over HTTP and a WebSocket: create, list, attach, type, resize, kill.

The attachment (GET /v1/terminals/{id}/attach, a WebSocket) is what an
interactive client uses: binary messages are the terminal's output one way
and keystrokes the other, text messages are JSON control messages. The plain
HTTP operations (input, output by cursor, resize, signal) do the same for
clients that cannot hold a WebSocket.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.websockets import WebSocket, WebSocketDisconnect

from . import models
from .api_exec import checked_cwd, parse_signal
from .errors import AgentError, Invalid
from .routing import Args
from .state import AgentState, state_of
from .terminals import Slice, Terminal
from .web import body_as, ok, one_of

# Output sent in one WebSocket message at most (a burst becomes several).
MESSAGE_BYTES = 64 << 10
# A control message (text) from the client, at most.
MAX_CONTROL = 64 << 10


async def terminal_create(request: Request, args: Args) -> Response:
    """Start a program on a new pseudo-terminal (the login shell by default)

    The program is the leader of its own session with the terminal as its
    controlling terminal. It outlives every attachment: it ends when it
    exits, on DELETE, or after idleTimeoutSeconds with nobody attached.
    """
    st = state_of(request)
    req = await body_as(request, models.TerminalRequest)
    if req.command is not None and req.argv is not None:
        raise Invalid("invalid_request", "give at most one of 'command' and 'argv'")
    if req.argv is not None and (not req.argv[0] or any("\0" in a for a in req.argv)):
        raise Invalid("invalid_request", "arguments must be non-empty and contain no NUL")
    if req.command is not None and "\0" in req.command:
        raise Invalid("invalid_request", "command contains NUL")
    term = await st.terminals.create(req, checked_cwd(st.workspace, req.cwd))
    return ok(term.view(), 201)


async def terminal_list(request: Request, args: Args) -> Response:
    """Terminals, running and recently ended"""
    st = state_of(request)
    return ok(models.TerminalList(terminals=[t.view() for t in st.terminals.terminals.values()]))


async def terminal_get(request: Request, args: Args) -> Response:
    """One terminal"""
    return ok(state_of(request).terminals.get(args.need("id", str)).view())


async def terminal_delete(request: Request, args: Args) -> Response:
    """Kill a terminal's program (and what it started) and forget the terminal"""
    st = state_of(request)
    st.touch()
    st.terminals.remove(st.terminals.get(args.need("id", str)))
    return Response(status_code=204)


async def terminal_input(request: Request, args: Args) -> Response:
    """Type into a terminal (bytes as keys send them)"""
    st = state_of(request)
    term = st.terminals.get(args.need("id", str))
    req = await body_as(request, models.TerminalInput)
    data = one_of(req.data, req.data_base64, ("data", "dataBase64")) or b""
    st.touch()
    term.write(data)
    return Response(status_code=204)


async def terminal_output(request: Request, args: Args) -> Response:
    """Output from a cursor, waiting up to waitSeconds for some"""
    st = state_of(request)
    term = st.terminals.get(args.need("id", str))
    cursor = args.need("cursor", int)
    wait = args.need("waitSeconds", float)
    term.read(cursor, 0)  # a cursor past the end is refused now, not after the wait
    if wait > 0:
        await term.wait_beyond(cursor, wait)
    part = term.read(cursor, args.need("maxBytes", int))
    if part.data:
        st.touch()
    return ok(
        models.TerminalOutput(
            cursor=part.cursor,
            next_cursor=part.cursor + len(part.data),
            dropped=part.dropped,
            data_base64=base64.b64encode(part.data).decode(),
            status=term.status,
            exit_code=term.exit_code,
            signal=term.signal,
        )
    )


async def terminal_resize(request: Request, args: Args) -> Response:
    """Change a terminal's window size (its foreground job gets SIGWINCH)"""
    st = state_of(request)
    term = st.terminals.get(args.need("id", str))
    req = await body_as(request, models.TerminalResize)
    st.touch()
    term.resize(req.cols, req.rows)
    return ok(term.view())


async def terminal_signal(request: Request, args: Args) -> Response:
    """Signal a terminal's foreground job, as a key would (INT: Ctrl-C)"""
    st = state_of(request)
    term = st.terminals.get(args.need("id", str))
    req = await body_as(request, models.SignalRequest)
    st.touch()
    term.send_signal(parse_signal(req.signal))
    return ok(term.view())


# -- the attachment -------------------------------------------------------------------


async def terminal_attach(ws: WebSocket, args: Args) -> None:
    """Attach to a terminal over a WebSocket (output from `cursor`, then live)

    Server to client: binary messages are output, in order, from the
    `cursor` announced first; text messages are JSON:
    `{"type": "attached", "cursor", "dropped", "terminal"}` first (dropped:
    bytes before `cursor` the ring no longer holds), `{"type": "dropped",
    "bytes"}` when this viewer fell more than the ring behind, `{"type":
    "exit", "terminal"}` last, `{"type": "error", "code", "message"}` for a
    control message that failed. Client to server: binary messages are
    keystrokes; text messages are JSON `{"type": "input", "data"}`,
    `{"type": "resize", "cols", "rows"}` or `{"type": "signal", "signal"}`
    (to the foreground job). Closing the WebSocket detaches; the program
    goes on.
    """
    st: AgentState = ws.app.state.agent
    term = st.terminals.get(args.need("id", str))
    first = term.read(args.need("cursor", int), 0)  # a bad cursor is refused before the handshake
    await ws.accept()
    term.attach()
    st.touch()
    sender = asyncio.create_task(_send_output(ws, st, term, first))
    try:
        receiver = asyncio.create_task(_receive_input(ws, st, term))
        done, _ = await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
        receiver.cancel()
        if receiver in done and not sender.done():
            sender.cancel()  # the client went away: nobody to send to
        with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect, OSError):
            await sender
        with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect, OSError):
            await receiver
    finally:
        sender.cancel()
        term.detach()
    with contextlib.suppress(RuntimeError, OSError):
        await ws.close()


def _event(kind: str, **fields: Any) -> str:
    return msgspec.json.encode({"type": kind, **fields}).decode()


def _terminal(term: Terminal) -> Any:
    return msgspec.to_builtins(term.view())


async def _send_output(ws: WebSocket, st: AgentState, term: Terminal, first: Slice) -> None:
    """Output from `first` on, then live, until the terminal ends."""
    await ws.send_text(
        _event("attached", cursor=first.cursor, dropped=first.dropped, terminal=_terminal(term))
    )
    cursor = first.cursor
    while True:
        part = term.read(cursor, MESSAGE_BYTES)
        if part.dropped:
            await ws.send_text(_event("dropped", bytes=part.dropped, cursor=part.cursor))
        if part.data:
            await ws.send_bytes(part.data)
            st.touch()  # someone is watching it
            cursor = part.cursor + len(part.data)
            continue
        cursor = part.cursor
        if not term.running:
            await ws.send_text(_event("exit", terminal=_terminal(term)))
            return
        await term.wait_beyond(cursor)


async def _receive_input(ws: WebSocket, st: AgentState, term: Terminal) -> None:
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        data, text = message.get("bytes"), message.get("text")
        try:
            if data is not None:
                term.write(data)
            elif text is not None:
                _control(term, text)
            st.touch()
        except AgentError as exc:
            await ws.send_text(_event("error", code=exc.code, message=exc.message))


def _control(term: Terminal, text: str) -> None:
    if len(text) > MAX_CONTROL:
        raise Invalid("invalid_request", f"control messages are at most {MAX_CONTROL} bytes")
    try:
        msg = msgspec.json.decode(text)
    except msgspec.DecodeError:
        raise Invalid("invalid_request", "a text message must be a JSON object") from None
    if not isinstance(msg, dict):
        raise Invalid("invalid_request", "a text message must be a JSON object")
    kind = msg.get("type")
    if kind == "input" and isinstance(msg.get("data"), str):
        term.write(msg["data"].encode())
    elif kind == "resize":
        try:
            fields = {k: v for k, v in msg.items() if k != "type"}
            size = msgspec.convert(fields, models.TerminalResize, strict=True)
        except msgspec.ValidationError:
            pass
        else:
            term.resize(size.cols, size.rows)
            return
        raise Invalid("invalid_request", "resize takes cols and rows, 1..1000")
    elif kind == "signal" and isinstance(msg.get("signal"), str | int):
        term.send_signal(parse_signal(msg["signal"]))
    else:
        raise Invalid(
            "invalid_request", "type must be input (data), resize (cols, rows) or signal (signal)"
        )
