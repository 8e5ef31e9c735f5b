"""Agent side of the runner socket.

The runner executes under the sandbox user's UID, so anything may be on the
other end of this socket. Every frame is bounded (runner.MAX_PAYLOAD), every
JSON payload is type-checked, unknown frames or channels end the connection,
and the hand-shake and pings have deadlines. Losing the connection ends every
in-flight execution with ``runner_lost`` instead of leaving it hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from . import runner as wire
from .errors import Busy

log = logging.getLogger("sandbox_agent.runner")

HELLO_TIMEOUT = 3.0
SCRIPT_FD = 3  # where a command's shell script is (`sh -c '. /dev/fd/3' sh`)
RECONNECT_DELAY = 0.1
# Bytes the runner has not read yet (our send buffer: stdin, scripts, spawns).
# The runner is user-replaceable: one that stops reading must not make us
# queue for ever.
MAX_UNSENT = 16 << 20
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


class ProtocolViolation(Exception):
    pass


@dataclass
class Spawn:
    """What to start: ``script`` (if any) reaches the command on SCRIPT_FD."""

    argv: list[str]
    env: dict[str, str]
    unset: list[str]
    cwd: str
    stdin: bool
    combined: bool = False
    script: bytes | None = None
    # SANDBOX_EXECUTION in the command's environment (the execution id): how
    # the runner finds the command's processes that left its process group.
    mark: str | None = None
    # (cols, rows): run on a new pseudo-terminal of this size (a terminal).
    pty: tuple[int, int] | None = None


class Channel(Protocol):
    """What an execution must accept from the runner connection."""

    def on_started(self, pid: int) -> None: ...
    def on_output(self, stderr: bool, data: memoryview) -> None: ...
    def on_exit(
        self, exit_code: int | None, signal: int | None, usage: dict[str, Any], survivors: int
    ) -> None: ...
    def on_spawn_failed(self, message: str) -> None: ...
    def on_lost(self, code: str, message: str) -> None: ...
    def on_stdin_closed(self) -> None: ...


def _obj(payload: bytes | memoryview) -> dict[str, Any]:
    try:
        value = _decode(payload)
    except msgspec.DecodeError as exc:
        raise ProtocolViolation(f"invalid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolViolation("expected a JSON object")
    return value


def _int(obj: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = obj.get(key)
    if v is None:
        return None
    if type(v) is not int or not lo <= v <= hi:
        raise ProtocolViolation(f"{key} out of range")
    return v


def _num(obj: dict[str, Any], key: str) -> float | None:
    v = obj.get(key)
    if v is None:
        return None
    if type(v) not in (int, float) or not 0 <= v < 1e12:
        raise ProtocolViolation(f"{key} out of range")
    return float(v)


def _str(obj: dict[str, Any], key: str, limit: int) -> str:
    v = obj.get(key, "")
    if not isinstance(v, str):
        raise ProtocolViolation(f"{key} must be a string")
    return v[:limit]


class _Wire(asyncio.Protocol):
    def __init__(self, client: RunnerClient) -> None:
        self.client = client
        self.parts: list[bytes] = []  # an incomplete frame, as received
        self.parts_len = 0
        self.need = 0  # bytes that complete it
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self.hello: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.channels: dict[int, Channel] = {}
        # Channels given up on (a kill the runner never confirmed): their late
        # frames are dropped, not taken for a protocol violation.
        self.forgotten: set[int] = set()
        # Pings and stats requests awaiting their answer, by the token they carry.
        self.asked: dict[bytes, asyncio.Future[Any]] = {}
        self.next_channel = 1

    def _answer(self, token: bytes, value: Any) -> None:
        fut = self.asked.pop(token, None)
        if fut is not None and not fut.done():
            fut.set_result(value)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; duck-type it.
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        if not self.hello.done():
            self.hello.set_exception(ConnectionError("runner closed the connection"))
        for waiter in self.asked.values():
            if not waiter.done():
                waiter.set_exception(ConnectionError("runner connection lost"))
        channels, self.channels = self.channels, {}
        reason = (
            self.client.lost_reason
            or self.client.closing_reason
            or (
                "runner_lost",
                "the runner connection closed while the command was running "
                "(runner exited, crashed or was replaced)",
            )
        )
        for ch in channels.values():
            ch.on_lost(*reason)
        self.client.connection_closed(self)

    def send(self, ftype: int, channel: int, payload: bytes = b"") -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("runner not connected")
        self.transport.write(wire.HEADER.pack(len(payload), ftype, channel) + payload)

    def abort(self, code: str, message: str) -> None:
        log.warning("dropping runner connection: %s", message)
        self.client.lost_reason = (code, message)
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        # A frame split over several reads is collected as a list and joined
        # once it is complete (no quadratic re-buffering of 1 MiB frames).
        # Complete frames are handed on as memoryview slices, so output bytes
        # are copied once (into the log); callees must not keep the views.
        if self.parts:
            self.parts.append(data)
            self.parts_len += len(data)
            if self.parts_len < self.need:
                return
            data = b"".join(self.parts)
            self.parts.clear()
            self.parts_len = 0
        view = memoryview(data)
        total = len(view)
        pos = 0
        size = wire.HEADER.size
        need = size
        try:
            while total - pos >= size:
                length, ftype, chan = wire.HEADER.unpack_from(view, pos)
                if length > wire.MAX_PAYLOAD:
                    raise ProtocolViolation(f"frame of {length} bytes exceeds the limit")
                end = pos + size + length
                if total < end:
                    need = size + length
                    break
                self._dispatch(ftype, chan, view[pos + size : end])
                pos = end
        except ProtocolViolation as exc:
            self.abort("runner_protocol_error", f"runner protocol violation: {exc}")
            return
        except Exception:
            # A bug on our side while handling a frame: the stream position is
            # unknown now, so start over with a fresh connection.
            log.exception("error while handling a runner frame")
            self.abort("agent_error", "internal error while handling runner output")
            return
        finally:
            view.release()
        if pos < total:
            rest = data[pos:]
            self.parts = [rest]
            self.parts_len = len(rest)
            self.need = need

    def _channel(self, chan: int, what: str, final: bool = False) -> Channel | None:
        """The channel a frame is for; None for a forgotten one (drop the frame)."""
        ch = self.channels.get(chan)
        if ch is None:
            if chan not in self.forgotten:
                raise ProtocolViolation(f"{what} for unknown channel {chan}")
            if final:
                self.forgotten.discard(chan)
        return ch

    def _dispatch(self, ftype: int, chan: int, payload: memoryview) -> None:
        if ftype == wire.T_STDOUT or ftype == wire.T_STDERR:
            ch = self._channel(chan, "output")
            if ch is not None:
                ch.on_output(ftype == wire.T_STDERR, payload)
        elif ftype == wire.T_STARTED:
            ch = self._channel(chan, "start")
            pid = _int(_obj(payload), "pid", 1, 1 << 31)
            if pid is None:
                raise ProtocolViolation("start without pid")
            if ch is not None:
                ch.on_started(pid)
        elif ftype == wire.T_EXIT:
            ch = self._channel(chan, "exit", final=True)
            obj = _obj(payload)
            code = _int(obj, "exitCode", 0, 255)
            sig = _int(obj, "signal", 1, 128)
            if (code is None) == (sig is None):
                raise ProtocolViolation("exit needs exactly one of exitCode and signal")
            usage = {
                "user": _num(obj, "userSeconds"),
                "system": _num(obj, "systemSeconds"),
                "maxrss": _int(obj, "maxRssKiB", 0, 1 << 50),
            }
            # Processes of a killed command the runner's sweep could not end.
            survivors = _int(obj, "survivors", 0, 1 << 31) or 0
            if ch is not None:
                del self.channels[chan]  # only once the frame proved valid
                ch.on_exit(code, sig, usage, survivors)
        elif ftype == wire.T_SPAWN_FAILED:
            ch = self._channel(chan, "spawn failure", final=True)
            message = _str(_obj(payload), "message", 1000)
            if ch is not None:
                del self.channels[chan]
                ch.on_spawn_failed(message)
        elif ftype == wire.T_STDIN_CLOSED:
            ch = self._channel(chan, "stdin state")
            if ch is not None:
                ch.on_stdin_closed()
        elif ftype == wire.T_PONG:
            self._answer(bytes(payload), None)
        elif ftype == wire.T_STATS_ACK:
            obj = _obj(payload)
            stats = obj.get("stats")
            if isinstance(stats, dict):
                with contextlib.suppress(ValueError):  # not a token of ours
                    self._answer(bytes.fromhex(_str(obj, "token", 64)), stats)
        elif ftype == wire.T_HELLO_ACK:
            if self.hello.done():
                raise ProtocolViolation("duplicate hello")
            obj = _obj(payload)
            if obj.get("protocol") != wire.PROTOCOL:
                raise ProtocolViolation(f"unsupported protocol {obj.get('protocol')!r}")
            info = {
                "version": _str(obj, "version", 64),
                "pid": _int(obj, "pid", 1, 1 << 31),
                "uid": _int(obj, "uid", 0, 1 << 32),
                "python": _str(obj, "python", 32),
                "executable": _str(obj, "executable", 4096),
                "instance": _str(obj, "instance", 64),
            }
            self.hello.set_result(info)
        else:
            raise ProtocolViolation(f"unknown frame type {ftype}")


class RunnerClient:
    """Keeps one connection to the runner, reconnecting while the agent lives."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.wire: _Wire | None = None
        self.info: dict[str, Any] | None = None
        self.last_error = "not connected yet"
        self.lost_reason: tuple[str, str] | None = None
        # The runner instance of the current (or else the last) connection.
        self.instance = ""
        # What to tell the executions of a connection that closes: set while
        # the agent has asked for the runtime to be restarted.
        self.closing_reason: tuple[str, str] | None = None
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self.on_change: list[Callable[[], None]] = []

    @property
    def connected(self) -> bool:
        return self.wire is not None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        # The agent is leaving: a connection it closes itself says nothing about
        # the runner, so nobody is told (a pending runtime restart stands).
        self.on_change.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.wire is not None and self.wire.transport is not None:
            self.wire.transport.close()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with asyncio.timeout(HELLO_TIMEOUT):
                    _, proto = await loop.create_unix_connection(
                        lambda: _Wire(self), self.socket_path
                    )
                proto.send(wire.T_HELLO, 0, _encode({"protocol": wire.PROTOCOL}))
                async with asyncio.timeout(HELLO_TIMEOUT):
                    info = await asyncio.shield(proto.hello)
            except (OSError, TimeoutError, ConnectionError) as exc:
                self.last_error = self._describe(exc)
                await asyncio.sleep(RECONNECT_DELAY)
                continue
            except asyncio.CancelledError:
                raise
            self.lost_reason = None
            self.wire = proto
            self.info = info
            self.instance = str(info.get("instance") or "")
            self.last_error = ""
            self._connected.set()
            log.info("runner connected: %s", info)
            self._notify()
            await proto.closed
            await asyncio.sleep(RECONNECT_DELAY)

    def _describe(self, exc: BaseException) -> str:
        if isinstance(exc, FileNotFoundError):
            return f"runner socket {self.socket_path} does not exist (runner not started?)"
        if isinstance(exc, ConnectionRefusedError):
            return f"nothing listens on {self.socket_path} (runner exited?)"
        if isinstance(exc, PermissionError):
            return f"permission denied on {self.socket_path} (check fsGroup / socket mode)"
        if isinstance(exc, TimeoutError):
            return "runner did not answer the hand-shake in time"
        return f"cannot connect to runner: {exc}"

    def connection_closed(self, proto: _Wire) -> None:
        if self.wire is proto:
            self.wire = None
            self.info = None
            self._connected.clear()
            self.last_error = (self.lost_reason or ("", "runner connection lost"))[1]
            log.warning("runner disconnected: %s", self.last_error)
            self._notify()

    def _notify(self) -> None:
        for cb in self.on_change:
            cb()

    async def wait_connected(self, wait: float) -> bool:
        """True once a runner is connected (at once if one is), False after ``wait`` s."""
        if not self.connected and wait > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._connected.wait()
        return self.connected

    # -- operations used by executions ------------------------------------

    def spawn(self, ch: Channel, req: Spawn) -> int:
        w = self.wire
        if w is None:
            raise ConnectionError(self.last_error)
        spec: dict[str, Any] = {
            "argv": req.argv,
            "env": req.env,
            "unset": req.unset,
            "cwd": req.cwd,
            "stdin": req.stdin,
            "combined": req.combined,
        }
        if req.script is not None:
            spec["scriptFd"] = SCRIPT_FD
        if req.mark is not None:
            spec["mark"] = req.mark
        if req.pty is not None:
            spec["pty"] = {"cols": req.pty[0], "rows": req.pty[1]}
        payload = _encode(spec)
        if len(payload) > wire.MAX_PAYLOAD:
            raise ValueError("arguments and environment exceed 1 MiB")
        unsent = 0 if w.transport is None else w.transport.get_write_buffer_size()
        if unsent and unsent + len(payload) + len(req.script or b"") > MAX_UNSENT:
            raise Busy(
                "runner_backlogged",
                "the runner is not reading: commands already waiting for it are at the"
                " limit; retry later",
            )
        chan = w.next_channel
        w.next_channel = (chan + 1) & 0xFFFFFFFF or 1
        w.channels[chan] = ch
        if req.script is not None:
            view = memoryview(req.script)
            for i in range(0, len(view), wire.MAX_PAYLOAD):
                w.send(wire.T_SCRIPT, chan, bytes(view[i : i + wire.MAX_PAYLOAD]))
        w.send(wire.T_SPAWN, chan, payload)
        return chan

    def forget(self, chan: int) -> None:
        """Stop expecting anything on ``chan``; whatever still comes for it is dropped."""
        if self.wire is not None and self.wire.channels.pop(chan, None) is not None:
            self.wire.forgotten.add(chan)

    def stdin(self, chan: int, data: bytes) -> None:
        w = self.wire
        if w is None or w.transport is None:
            raise ConnectionError(self.last_error)
        if w.transport.get_write_buffer_size() + len(data) > MAX_UNSENT:
            raise Busy(
                "stdin_backlogged",
                "the runner is not reading: stdin already waiting is at its limit; retry later",
            )
        step = wire.MAX_PAYLOAD
        for i in range(0, len(data), step):
            w.send(wire.T_STDIN, chan, data[i : i + step])

    def close_stdin(self, chan: int) -> None:
        if self.wire is not None:
            self.wire.send(wire.T_STDIN_CLOSE, chan)

    def signal(
        self,
        chan: int,
        sig: int,
        sweep: float | None = None,
        *,
        foreground: bool = False,
        everywhere: bool = False,
    ) -> None:
        """Signal a command's process group. For SIGKILL and SIGTERM the runner
        also ends the processes that left the group (``sweep``: for at most
        this many seconds, then it reports the survivors). ``foreground``: a
        terminal's foreground job instead, as a key would; ``everywhere``: every
        process that carries the command's mark (the group and those that left it)."""
        if self.wire is not None:
            msg: dict[str, Any] = {"signal": sig}
            if sweep is not None:
                msg["sweepSeconds"] = sweep
            if foreground:
                msg["foreground"] = True
            if everywhere:
                msg["everywhere"] = True
            self.wire.send(wire.T_SIGNAL, chan, _encode(msg))

    def resize(self, chan: int, cols: int, rows: int) -> None:
        """A terminal's window size (the runner tells its foreground job)."""
        if self.wire is not None:
            self.wire.send(wire.T_RESIZE, chan, _encode({"cols": cols, "rows": rows}))

    async def _ask(self, ftype: int, wait: float) -> tuple[bool, Any]:
        """Send `ftype` with a fresh token: (True, the runner's answer to it), or
        (False, None) when it does not answer within `wait` seconds."""
        w = self.wire
        if w is None:
            return False, None
        token = secrets.token_bytes(8)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        w.asked[token] = fut
        try:
            w.send(ftype, 0, token)
            async with asyncio.timeout(wait):
                return True, await fut
        except (TimeoutError, ConnectionError):
            return False, None
        finally:
            w.asked.pop(token, None)

    async def cgroup_stats(self, wait: float = 1.0) -> dict[str, Any] | None:
        """The sandbox container's PID and CPU counters (runner.cgroup_stats), or
        None when the runner does not answer in time."""
        answered, stats = await self._ask(wire.T_STATS, wait)
        return stats if answered else None

    async def ping(self, wait: float = 1.0) -> bool:
        answered, _ = await self._ask(wire.T_PING, wait)
        return answered
