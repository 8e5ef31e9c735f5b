"""Execution records: lifecycle, captured output, on-disk logs, idempotency.

Output goes two places: an in-memory tail per stream (bounded, returned in
results) and an append-only log file per execution (bounded, read by cursor
and streamed). The log is a sequence of records ``0x1e, stream, u32 length,
data``; a cursor is a byte offset of a record boundary in that file.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import functools
import hashlib
import logging
import os
import signal as _signal
import struct
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from . import metrics, models
from .config import Settings
from .environment import Environment
from .errors import Busy, Conflict, Gone, Invalid, NotFound, TooLarge, Unavailable
from .journal import Journal
from .runner_client import SCRIPT_FD, RunnerClient, Spawn
from .runtime import RuntimeRestart

log = logging.getLogger("sandbox_agent.executions")

REC = struct.Struct(">BBI")
REC_MAGIC = 0x1E
STREAM_OUT, STREAM_ERR = 1, 2
StreamName = Literal["stdout", "stderr"]
_STREAM_NAME: dict[int, StreamName] = {STREAM_OUT: "stdout", STREAM_ERR: "stderr"}


_OUTPUT_METRIC = {s: metrics.EXEC_OUTPUT_BYTES.labels(n) for s, n in _STREAM_NAME.items()}
# How long a stream's `started` event waits for the runner to name the process
# (its pid), which comes a moment after the record exists.
PID_WAIT = 10.0


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _write_file(path: str, data: bytearray) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)


# Control characters JSON writes as six bytes (\u0001); \n, \t and the like
# take two, which the cap leaves alone (at most twice the tail).
_LONG_ESCAPES = bytes(c for c in range(0x20) if c not in b"\b\t\n\f\r")


def _escaped_size(view: memoryview) -> int:
    """About what `view` takes as a JSON string: its six-byte escapes counted."""
    raw = bytes(view)
    return len(raw) + 5 * (len(raw) - len(raw.translate(None, _LONG_ESCAPES)))


_encode_json = msgspec.json.Encoder().encode


def _text(data: bytearray | memoryview | bytes, cap: int) -> tuple[str, bool]:
    """Lossy UTF-8 text of the last ``cap`` bytes, decoded without a copy, and
    whether it was cut. A tail of control characters is cut further so that
    its JSON stays within the cap too (1.5 MiB of them would be 9 MiB)."""
    view = memoryview(data)
    cut = len(view) > cap
    if cut:
        view = view[-cap:]
    text = str(view, "utf-8", "replace")
    if len(view) * 6 <= cap:
        return text, cut  # cannot grow past the cap
    sample = bytes(view[-4096:])
    # No control character near the end: most likely none at all, and one
    # encoding (C speed, 0.4 ms a MiB) says so faster than counting them.
    if len(sample.translate(None, _LONG_ESCAPES)) == len(sample) and (
        len(_encode_json(text)) <= cap + 2
    ):
        return text, cut
    # Counted (no six-fold copy made): the cut that fits, if any is needed.
    if _escaped_size(view) > cap:
        lo, hi = 0, len(view)  # the shortest cut whose escaped rest fits
        while lo < hi:
            mid = (lo + hi) // 2
            if _escaped_size(view[mid:]) > cap:
                lo = mid + 1
            else:
                hi = mid
        view, cut = view[lo:], True
    return str(view, "utf-8", "replace"), cut


def signal_name(sig: int) -> str | None:
    try:
        return _signal.Signals(sig).name
    except ValueError:
        return None


# Journal key -> Execution attribute, written when a record is created (new)
# and when it ends (end), read back by Execution.restore.
_JOURNAL_NEW = {
    "key": "key",
    "fp": "fingerprint",
    "command": "command",
    "commandTruncated": "command_truncated",
    "commandBytes": "command_bytes",
    "argv": "argv",
    "cwd": "cwd",
    "timeout": "timeout",
    "background": "background",
    "combined": "combined",
    "created": "created",
}
_JOURNAL_END = {
    "status": "status",
    "pid": "pid",
    "exitCode": "exit_code",
    "signal": "signal",
    "timedOut": "timed_out",
    "cancelled": "cancelled",
    "userKilled": "user_killed",
    "started": "started",
    "finished": "finished",
    "usage": "usage",
    "logTruncated": "log_truncated",
}


# What a record keeps of its command: kept for up to max_records executions and
# written to the journal, a whole 4 MiB script each would be gigabytes.
COMMAND_KEPT = 4 << 10


def _kept(command: str | None) -> tuple[str | None, bool, int | None]:
    """The command a record keeps, whether it was cut, and its whole size."""
    if command is None:
        return None, False, None
    encoded = command.encode("utf-8", "surrogatepass")  # never raises (checked at spawn)
    if len(encoded) <= COMMAND_KEPT:
        return command, False, len(encoded)
    return encoded[:COMMAND_KEPT].decode("utf-8", "ignore"), True, len(encoded)


def _kept_argv(argv: list[str]) -> tuple[list[str], int]:
    """An argv cut to about COMMAND_KEPT characters in all, and its whole size."""
    kept: list[str] = []
    room = COMMAND_KEPT
    for arg in argv:
        if room <= 0:
            break
        kept.append(arg[:room])
        room -= len(arg)
    return kept, sum(len(a.encode("utf-8", "surrogatepass")) for a in argv)


# A script up to this size travels in the shell's argv (see _spawn_request):
# half of Linux's limit on one argument, and far below the spawn frame's 1 MiB.
ARGV_SCRIPT_MAX = 64 << 10
ARGV_ENV_MAX = 256 << 10  # with a larger environment the frame is left to it


def _fits_argv(command: str, script: bytes, env: dict[str, str]) -> bool:
    """Whether `command` can be `sh -c`'s argument: small, no NUL (argv strings
    end at one), valid UTF-8 (the spawn frame is JSON), beside a modest env."""
    if len(script) > ARGV_SCRIPT_MAX or "\0" in command:
        return False
    if sum(len(k) + len(v) for k, v in env.items()) > ARGV_ENV_MAX:
        return False
    try:
        command.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: bytes that were not UTF-8
        return False
    return True


# A page of output holds at most this many chunks (a command that alternates
# tiny writes to stdout and stderr makes one per write), whatever its bytes.
MAX_PAGE_CHUNKS = 4096
_READ_BLOCK = 256 << 10  # log bytes read at once while paging
# A write continues the log's last record (no new header) while nobody was
# handed a cursor at its end, up to this size.
_RECORD_MAX = 64 << 10


@dataclass
class Chunk:
    stream: int
    data: bytes | bytearray
    cursor: int  # just after this chunk


class Execution:
    """One command. Implements runner_client.Channel."""

    def __init__(
        self,
        mgr: ExecutionManager,
        req: models.ExecRequest,
        argv: list[str],
        timeout: float,
        fingerprint: str,
    ) -> None:
        self.mgr = mgr
        self.id = "ex-" + uuid.uuid4().hex
        self.key = req.idempotency_key
        self.fingerprint = fingerprint
        self.command, self.command_truncated, self.command_bytes = _kept(req.command)
        # [shell, -c, command] shows the kept command, not a second whole copy.
        self.argv = argv if req.command is None else [*argv[:-1], self.command or ""]
        if req.command is None and sum(len(a) for a in argv) > COMMAND_KEPT:
            self.argv, self.command_bytes = _kept_argv(argv)
            self.command_truncated = True
        self.cwd = req.cwd
        self.env = req.env
        self.timeout = timeout
        self.background = req.background
        self.combined = req.combined_output
        self.status: models.ExecutionStatus = "running"
        self.created = time.time()
        self.started: float | None = None
        self.finished: float | None = None
        self.pid: int | None = None
        self.exit_code: int | None = None
        self.signal: int | None = None
        self.timed_out = False
        self.cancelled = False
        self.user_killed = False
        self.error: models.RunError | None = None
        self.usage: dict[str, Any] = {}
        # Tails for results. While the whole log is in memory it is the only
        # copy of the output (tails are cut from it on demand); separate tail
        # buffers exist only once it spilled, was truncated or was dropped.
        self.capture: dict[int, bytearray] | None = None
        self.truncated = {STREAM_OUT: False, STREAM_ERR: False}
        self.totals = {STREAM_OUT: 0, STREAM_ERR: 0}
        self.log_fd = -1
        # Small logs stay in memory (no file, no disk I/O); past the per-execution
        # threshold, or when all in-memory logs together pass theirs, they spill.
        self.mem_log: bytearray | None = bytearray()
        self.spilling = False
        self.log_path = os.path.join(mgr.settings.log_dir, self.id + ".log")
        self.log_size = 0
        self.log_truncated = False
        self.log_pruned = False
        # The log's last record (offset, stream, data length), and the furthest
        # cursor handed out: records before it are never changed (see _log).
        self.last_rec = -1
        self.last_stream = 0
        self.last_len = 0
        self.sealed = 0
        self.stdin_open = False
        # Requests waiting to answer with this record's tails: the tail budget
        # never drops those (the answer is built after the exit).
        self.answering = 0
        self.tails_dropped = False
        self.channel = 0
        self.done = asyncio.Event()
        self._waiters: list[asyncio.Future[None]] = []
        self._timers: list[asyncio.TimerHandle] = []

    # -- runner events -----------------------------------------------------

    def on_started(self, pid: int) -> None:
        if self.pid is not None:
            return
        self.pid = pid
        self.started = time.time()
        self._notify()

    def on_output(self, stderr: bool, data: bytes | memoryview) -> None:
        if self.finished is not None:
            return
        stream = STREAM_ERR if stderr else STREAM_OUT
        n = len(data)
        self.totals[stream] += n
        _OUTPUT_METRIC[stream].inc(n)
        self._log(stream, data)
        if self.capture is not None:
            cap = self.mgr.settings.max_capture_bytes
            buf = self.capture[stream]
            before = len(buf)
            buf += data
            # Trim lazily (at twice the cap) so a flood costs O(n), not O(n^2).
            if len(buf) > 2 * cap or (len(buf) > cap and n >= cap):
                del buf[: len(buf) - cap]
                self.truncated[stream] = True
            self.mgr.capture_bytes += len(buf) - before
        self._notify()

    def _tails_from_log(self) -> dict[int, memoryview | bytes]:
        """Per-stream output tails, cut from the complete in-memory log (no copy
        when a stream is a single record, the common case for short commands)."""
        cap = self.mgr.settings.max_capture_bytes
        parts: dict[int, list[memoryview]] = {STREAM_OUT: [], STREAM_ERR: []}
        mem = self.mem_log
        if mem is not None:
            view = memoryview(mem)
            pos, end = 0, len(mem)
            while pos < end:
                _, stream, length = REC.unpack_from(view, pos)
                parts[stream].append(view[pos + REC.size : pos + REC.size + length])
                pos += REC.size + length
        tails: dict[int, memoryview | bytes] = {}
        for stream, chunks in parts.items():
            keep: list[memoryview] = []
            size = 0
            for chunk in reversed(chunks):
                if size >= cap:
                    break
                keep.append(chunk[-(cap - size) :])
                size += len(keep[-1])
            tails[stream] = keep[0] if len(keep) == 1 else b"".join(reversed(keep))
        return tails

    def _materialize_capture(self) -> None:
        """Switch to separate tail buffers (before the in-memory log goes away)."""
        if self.capture is None:
            self.capture = {k: bytearray(v) for k, v in self._tails_from_log().items()}
            self.mgr.capture_bytes += sum(len(b) for b in self.capture.values())
            cap = self.mgr.settings.max_capture_bytes
            for stream in (STREAM_OUT, STREAM_ERR):
                self.truncated[stream] = self.totals[stream] > cap

    def on_exit(
        self, exit_code: int | None, signal: int | None, usage: dict[str, Any], survivors: int = 0
    ) -> None:
        self.exit_code = exit_code
        self.signal = signal
        self.usage = usage
        if survivors:
            # The runner killed the command but not everything it started:
            # only a restart of the runtime ends those processes now.
            message = (
                f"{survivors} process(es) of the command were still alive after the runner "
                f"had swept for {self.mgr.sweep_seconds:g}s; the sandbox container is being "
                "restarted to end them"
            )
            self.mgr.demand_restart("kill_not_confirmed", message, [self])
            self.error = models.RunError(code="kill_incomplete", message=message)
        if self.cancelled:
            status: models.ExecutionStatus = "cancelled"
        elif self.timed_out:
            status = "timed_out"
        else:
            status = "completed"
        self._finish(status)

    def on_spawn_failed(self, message: str) -> None:
        self.error = models.RunError(code="spawn_failed", message=message)
        self._finish("failed")

    def on_stdin_closed(self) -> None:
        self.stdin_open = False  # further writes get 409 stdin_closed

    def on_lost(self, code: str, message: str) -> None:
        self.error = models.RunError(code=code, message=message)
        self._finish("lost")

    # -- output ------------------------------------------------------------

    def _log(self, stream: int, data: bytes | memoryview) -> None:
        if self.log_truncated:
            return
        # Many small writes to one stream become one record: a cursor handed
        # out is always at a record's end, so the last record may grow while
        # no cursor points at its end (and records cost 6 bytes each, in
        # memory, on disk and as objects of a page).
        extend = (
            stream == self.last_stream
            and self.sealed < self.log_size
            and self.last_len + len(data) <= _RECORD_MAX
        )
        need = len(data) if extend else REC.size + len(data)
        if self.log_size + need > self.mgr.settings.max_log_bytes or not self.mgr.reserve_log(
            self, need
        ):
            self._materialize_capture()  # the log stops being the whole output
            self.log_truncated = True
            return
        length = self.last_len + len(data) if extend else len(data)
        head = REC.pack(REC_MAGIC, stream, length)
        mem = self.mem_log
        if mem is not None and self.log_size + need <= self.mgr.settings.log_memory_bytes:
            if extend:
                mem[self.last_rec : self.last_rec + REC.size] = head
            else:
                mem += head
            mem += data
            self.mgr.mem_log_bytes += need
        else:
            try:
                if mem is not None:
                    self.spill()
                if extend:
                    os.pwrite(self.log_fd, head, self.last_rec)
                    _write_all(self.log_fd, data)
                else:
                    os.writev(self.log_fd, [head, data])
            except OSError:
                self._materialize_capture()
                self.mgr.release_log(need)
                self.log_truncated = True
                return
        if not extend:
            self.last_rec, self.last_stream = self.log_size, stream
        self.last_len = length
        self.log_size += need

    def spill(self) -> None:
        """Move the in-memory log to its file (which stays open while running)."""
        mem = self.mem_log
        if mem is None:
            return
        self._materialize_capture()
        # Not O_APPEND: a record's header is rewritten in place when it grows
        # (pwrite ignores the offset on an append-only descriptor).
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, mem)
        except OSError:
            os.close(fd)
            raise
        self.mem_log = None
        self.mgr.mem_log_bytes -= len(mem)
        if self.finished is None:
            self.log_fd = fd
        else:
            os.close(fd)

    def _read_at(self, fd: int, pos: int, n: int) -> bytes:
        mem = self.mem_log
        if mem is not None:
            return bytes(mem[pos : pos + n])
        return os.pread(fd, n, pos)

    def read_log(
        self, cursor: int, max_bytes: int, max_chunks: int = MAX_PAGE_CHUNKS
    ) -> list[Chunk]:
        """Records from ``cursor``, consecutive ones of a stream merged: at least
        one if any, then up to max_bytes of data and max_chunks chunks. The log
        is read in blocks, so tiny records cost no system call each."""
        if cursor < 0:
            raise Invalid("invalid_cursor", "cursor is outside the output log")
        # Before the range check: a reader's cursor from before an agent restart
        # lies past the restored (empty) log, and the answer is that it is gone.
        if self.log_pruned:
            raise Gone("log_pruned", "the output log was pruned to stay under the cap")
        if cursor > self.log_size:
            raise Invalid("invalid_cursor", "cursor is outside the output log")
        if cursor == self.log_size:
            return []
        out: list[Chunk] = []
        fd = -1 if self.mem_log is not None else os.open(self.log_path, os.O_RDONLY | os.O_CLOEXEC)
        block, at = b"", cursor  # log bytes [at, at + len(block))
        try:
            total = 0
            while cursor < self.log_size and (not out or total < max_bytes):
                off = cursor - at
                if off + REC.size > len(block):
                    block, at, off = self._read_at(fd, cursor, _READ_BLOCK), cursor, 0
                    if len(block) < REC.size:
                        break
                magic, stream, length = REC.unpack_from(block, off)
                if magic != REC_MAGIC or stream not in _STREAM_NAME:
                    raise Invalid("invalid_cursor", "cursor is not at a record boundary")
                merge = bool(out) and out[-1].stream == stream
                if not merge and len(out) >= max_chunks:
                    break
                start = off + REC.size
                if start + length <= len(block):
                    data: bytes | memoryview = memoryview(block)[start : start + length]
                else:  # a record larger than what the block holds of it
                    data = self._read_at(fd, cursor + REC.size, length)
                cursor += REC.size + len(data)
                total += len(data)
                if merge:
                    chunk = out[-1]
                    if not isinstance(chunk.data, bytearray):
                        chunk.data = bytearray(chunk.data)
                    chunk.data += data
                    chunk.cursor = cursor
                else:
                    out.append(Chunk(stream, bytes(data), cursor))
        finally:
            if fd >= 0:
                os.close(fd)
        if out:
            self.sealed = max(self.sealed, out[-1].cursor)
        return out

    @contextlib.asynccontextmanager
    async def answer(self) -> AsyncIterator[None]:
        """While a request waits to answer with this record, keep its tails."""
        self.answering += 1
        try:
            yield
        finally:
            self.answering -= 1
            if not self.answering:
                self.mgr._trim_captures()

    def _seal(self) -> int:
        """The log's end, as a cursor handed out: its last record stops growing."""
        self.sealed = self.log_size
        return self.log_size

    async def wait_change(self, wait: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(wait):
                await fut
        except TimeoutError:
            pass
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # -- control -----------------------------------------------------------

    def send_signal(self, sig: int, *, by_user: bool = True) -> None:
        if self.finished is not None:
            raise Conflict("not_running", f"execution {self.id} is not running")
        if by_user and sig == _signal.SIGKILL:
            self.user_killed = True
            self._expect_death("signal KILL")
        self.mgr.runner.signal(self.channel, sig, self.mgr.sweep_seconds)

    def kill(self, reason: str) -> None:
        """SIGKILL the process group; if the runner never confirms, give up on it."""
        if self.finished is not None:
            return
        self._expect_death(reason)
        self.mgr.runner.signal(self.channel, _signal.SIGKILL, self.mgr.sweep_seconds)

    def _expect_death(self, reason: str) -> None:
        self._later(self.mgr.settings.kill_grace, self._unconfirmed_kill, reason)

    def _unconfirmed_kill(self, reason: str) -> None:
        """The runner did not confirm a kill in time: it cannot act (a fork bomb
        starves it, or it is stopped). Only a restart of the whole runtime ends
        the command now; ask for one, and end the record as what it was."""
        if self.finished is not None:
            return
        message = (
            f"the runner did not confirm the kill ({reason}) within "
            f"{self.mgr.settings.kill_grace:g}s; the sandbox container is being restarted "
            "to end the command"
        )
        self.mgr.runner.forget(self.channel)  # a late word from the runner is dropped
        self.mgr.demand_restart("kill_not_confirmed", message, [self])
        self.error = models.RunError(code="runner_unresponsive", message=message)
        self._finish("timed_out" if self.timed_out else "cancelled" if self.cancelled else "lost")

    def on_timeout(self) -> None:
        if self.finished is None:
            self.timed_out = True
            self.kill("timeout")

    def cancel(self, grace: float) -> None:
        if self.finished is not None:
            raise Conflict("not_running", f"execution {self.id} is not running")
        self.cancelled = True
        if grace > 0:
            self.mgr.runner.signal(self.channel, _signal.SIGTERM, self.mgr.sweep_seconds)
            self._later(grace, self.kill, "cancel")
        else:
            self.kill("cancel")

    def write_stdin(self, data: bytes, close: bool) -> None:
        if self.finished is not None or not self.stdin_open:
            raise Conflict("stdin_closed", "stdin of this execution is not open")
        if data:
            self.mgr.runner.stdin(self.channel, data)
        if close:
            self.mgr.runner.close_stdin(self.channel)
            self.stdin_open = False

    def _later(self, delay: float, fn: Any, *args: Any) -> None:
        self._timers.append(asyncio.get_running_loop().call_later(delay, fn, *args))

    def _finish(self, status: models.ExecutionStatus) -> None:
        if self.finished is not None:
            return
        self.finished = time.time()
        self.status = status
        self.stdin_open = False
        for t in self._timers:
            t.cancel()
        self._timers.clear()
        if self.log_fd >= 0:
            os.close(self.log_fd)
            self.log_fd = -1
        self.mgr.finished(self)
        self.done.set()
        self._notify()

    # -- journal -------------------------------------------------------------

    def _journal(self, fields: dict[str, str]) -> dict[str, Any]:
        return {"id": self.id, **{key: getattr(self, attr) for key, attr in fields.items()}}

    def journal_new(self) -> dict[str, Any]:
        new = self._journal(_JOURNAL_NEW)
        if self.command is not None:
            new["argv"] = None  # [shell, -c, command]: no second copy of a long script
        return new

    def journal_end(self) -> dict[str, Any]:
        return {
            **self._journal(_JOURNAL_END),
            "error": msgspec.to_builtins(self.error) if self.error else None,
            "totals": [self.totals[STREAM_OUT], self.totals[STREAM_ERR]],
            "logSize": self.log_size if self.mem_log is None and not self.log_pruned else 0,
        }

    @classmethod
    def restore(cls, mgr: ExecutionManager, d: dict[str, Any]) -> Execution:
        """A record from before an agent restart (output only if it was on disk)."""
        ex = cls(mgr, models.ExecRequest(), [], 0.0, "")
        ex.id = d["id"]
        ex.log_path = os.path.join(mgr.settings.log_dir, ex.id + ".log")
        ex.mem_log = None
        ex.capture = {STREAM_OUT: bytearray(), STREAM_ERR: bytearray()}
        for key, attr in (_JOURNAL_NEW | _JOURNAL_END).items():
            if d.get(key) is not None:  # keys of older agents may be missing
                setattr(ex, attr, d[key])
        if not ex.argv and ex.command is not None:
            ex.argv = [mgr.settings.shell, "-c", ex.command]
        if "status" not in d:
            # It was running when the agent went away; the runner killed it then.
            ex.status = "lost"
            ex.finished = ex.created
            ex.error = models.RunError(
                code="agent_restarted",
                message="the agent restarted while the command was running",
            )
            ex.log_pruned = True
        else:
            err = d.get("error")
            if isinstance(err, dict):
                ex.error = models.RunError(
                    code=str(err.get("code")), message=str(err.get("message"))
                )
            ex.finished = ex.finished or ex.created
            totals = d.get("totals") or [0, 0]
            ex.totals = {STREAM_OUT: int(totals[0]), STREAM_ERR: int(totals[1])}
            size = int(d.get("logSize") or 0)
            try:
                on_disk = os.path.getsize(ex.log_path) if size else -1
            except OSError:
                on_disk = -1
            if size and on_disk == size:
                ex.log_size = size
            else:
                ex.log_pruned = True  # it lived in memory (or is gone): tails are lost
        # output kept in memory before the restart is gone
        for stream in (STREAM_OUT, STREAM_ERR):
            ex.truncated[stream] = ex.totals[stream] > 0
        ex.done.set()
        return ex

    # -- views -------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.finished is None

    @property
    def oom_killed(self) -> bool:
        return (
            self.signal == _signal.SIGKILL
            and not self.timed_out
            and not self.cancelled
            and not self.user_killed
        )

    def view(self, output: bool = True) -> models.Execution:
        end = self.finished
        start = self.started
        cap = self.mgr.settings.max_capture_bytes
        tails: dict[int, bytearray] | dict[int, memoryview | bytes] | None = None
        texts: dict[int, tuple[str, bool]] = {}
        if output:
            tails = self.capture if self.capture is not None else self._tails_from_log()
            texts = {stream: _text(tail, cap) for stream, tail in tails.items()}
        # (field order on the wire is the model's, not this call's)
        return models.Execution(
            id=self.id,
            idempotency_key=self.key,
            status=self.status,
            created_at=models.rfc3339(self.created),
            started_at=models.rfc3339(start) if start else None,
            finished_at=models.rfc3339(end) if end else None,
            duration_seconds=round(end - (start or self.created), 6) if end else None,
            command=self.command,
            command_truncated=self.command_truncated,
            command_bytes=self.command_bytes,
            argv=self.argv,
            cwd=self.cwd,
            timeout_seconds=self.timeout,
            background=self.background,
            stdout=texts[STREAM_OUT][0] if texts else None,
            stderr=texts[STREAM_ERR][0] if texts else None,
            combined_output=self.combined,
            pid=self.pid,
            exit_code=self.exit_code,
            signal=self.signal,
            signal_name=signal_name(self.signal) if self.signal else None,
            timed_out=self.timed_out,
            cancelled=self.cancelled,
            oom_killed=self.oom_killed,
            error=self.error,
            tails_dropped=self.tails_dropped and output,
            stdout_truncated=self.truncated[STREAM_OUT]
            or self.totals[STREAM_OUT] > cap
            or (STREAM_OUT in texts and texts[STREAM_OUT][1]),
            stderr_truncated=self.truncated[STREAM_ERR]
            or self.totals[STREAM_ERR] > cap
            or (STREAM_ERR in texts and texts[STREAM_ERR][1]),
            stdout_bytes=self.totals[STREAM_OUT],
            stderr_bytes=self.totals[STREAM_ERR],
            output_cursor=self._seal(),
            log_truncated=self.log_truncated,
            stdin_open=self.stdin_open,
            user_cpu_seconds=self.usage.get("user"),
            system_cpu_seconds=self.usage.get("system"),
            max_rss_kib=self.usage.get("maxrss"),
        )

    def chunk_view(self, c: Chunk, b64: bool, decoder: Any = None) -> models.OutputChunk:
        name = _STREAM_NAME[c.stream]
        if b64:
            return models.OutputChunk(
                stream=name, data_base64=base64.b64encode(c.data).decode(), cursor=c.cursor
            )
        text = decoder.decode(c.data) if decoder else c.data.decode("utf-8", "replace")
        return models.OutputChunk(stream=name, data=text, cursor=c.cursor)


class ExecutionManager:
    def __init__(
        self,
        settings: Settings,
        runner: RunnerClient,
        on_activity: Any,
        restart: RuntimeRestart,
        environment: Environment,
    ) -> None:
        self.settings = settings
        self.runner = runner
        # How long the runner may sweep for a killed command's processes: half
        # the kill grace, so that its report (done, or who survived) arrives
        # before the agent gives up on it.
        self.sweep_seconds = settings.kill_grace / 2
        self.on_activity = on_activity
        self.restart = restart
        self.environment = environment
        runner.on_change.append(self._runner_changed)
        self._closing_reason()
        self.records: dict[str, Execution] = {}
        self.by_key: dict[str, Execution] = {}
        self.active = 0
        self.log_bytes = 0
        self.mem_log_bytes = 0
        self.spilling_bytes = 0
        self.capture_bytes = 0  # separate tail buffers (records whose log spilled)
        self.journal = Journal(settings.log_dir, settings.max_records)

    def restore(self) -> int:
        """Reload records from the journal (call once, at start-up)."""
        for d in self.journal.load():
            try:
                ex = Execution.restore(self, d)
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("skipping unreadable journal record: %s", exc)
                continue
            self.records[ex.id] = ex
            if ex.key is not None:
                self.by_key[ex.key] = ex
            self.log_bytes += ex.log_size
        # logs that no record refers to any more (pruned before a crash, etc.)
        keep = {f"{ex.id}.log" for ex in self.records.values() if ex.log_size}
        with contextlib.suppress(OSError):
            for name in os.listdir(self.settings.log_dir):
                if name.endswith(".log") and name not in keep:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.settings.log_dir, name))
        self.journal.open()
        self._compact()
        self._prune_records()
        return len(self.records)

    def _compact(self) -> None:
        entries: list[tuple[str, dict[str, Any]]] = []
        for ex in self.records.values():
            entries.append(("new", ex.journal_new()))
            if ex.finished is not None:
                entries.append(("end", ex.journal_end()))
        self.journal.rewrite(entries)

    def fingerprint(self, req: models.ExecRequest, argv: list[str], timeout: float) -> str:
        what: list[Any] = [argv, req.cwd, sorted(req.env.items()), req.stdin, req.stdin_base64]
        what.append(timeout)
        if req.combined_output:
            what.append("combined")  # (absent otherwise: fingerprints of old records hold)
        return hashlib.sha256(msgspec.json.encode(what)).hexdigest()

    def _spawn_request(
        self, req: models.ExecRequest, argv: list[str], cwd: str, want_stdin: bool
    ) -> Spawn:
        env = {**self.environment.env, **req.env}
        spawn = Spawn(argv, env, self.environment.unset, cwd, want_stdin, req.combined_output)
        if req.command is not None:
            shell = argv[0]
            try:
                script = req.command.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                raise Invalid("invalid_request", "command is not valid Unicode") from None
            if _fits_argv(req.command, script, env):
                # `sh -c command sh`, as a person types it: errors read as a shell
                # reports them ("/bin/sh: 1: x: not found"); a script sourced from
                # a descriptor has the shell name the file in each one
                # ("/bin/sh: 1: /dev/fd/3: x: not found").
                spawn.argv = [shell, "-c", req.command, shell]
            else:
                # Too long for argv (Linux refuses one argument over 128 KiB, and
                # the spawn frame holds 1 MiB): the script goes to the shell on a
                # descriptor. `sh -c '. file' sh` keeps $0 and the positional
                # parameters as `sh -c command` has them.
                spawn.argv = [shell, "-c", f". /dev/fd/{SCRIPT_FD}", shell]
                spawn.script = script
        return spawn

    def submit(
        self, req: models.ExecRequest, argv: list[str], cwd_rel: str, stdin: bytes | None
    ) -> tuple[Execution, bool]:
        """Start (or, for a known idempotency key, find) an execution."""
        timeout = req.timeout_seconds or self.settings.default_timeout
        if timeout > self.settings.max_timeout:
            raise Invalid(
                "timeout_too_large",
                f"timeoutSeconds may be at most {self.settings.max_timeout:g} "
                "(SANDBOX_AGENT_MAX_TIMEOUT)",
                maximum=self.settings.max_timeout,
            )
        fp = self.fingerprint(req, argv, timeout)
        if req.idempotency_key is not None:
            existing = self.by_key.get(req.idempotency_key)
            if existing is not None:
                if existing.fingerprint != fp:
                    raise Conflict(
                        "idempotency_key_reused",
                        "this idempotency key was used for a different command",
                        id=existing.id,
                    )
                return existing, True
        if self.active >= self.settings.max_concurrent_executions:
            raise Busy(
                "too_many_executions",
                f"at most {self.settings.max_concurrent_executions} executions may run at once",
            )
        if self.restart.request is not None:
            raise Unavailable(
                "runtime_restarting",
                "the sandbox container is to be restarted (see GET /livez/runtime): "
                "a command started now would be killed with it",
            )
        if not self.runner.connected:
            raise Unavailable("runner_unavailable", self.runner.last_error or "no runner")
        want_stdin = stdin is not None or req.stdin_open
        spawn = self._spawn_request(req, argv, cwd_rel, want_stdin)
        ex = Execution(self, req, argv, timeout, fp)
        spawn.mark = ex.id
        ex.cwd = cwd_rel
        try:
            ex.channel = self.runner.spawn(ex, spawn)
        except ConnectionError as exc:
            raise Unavailable("runner_unavailable", str(exc)) from None
        except ValueError as exc:
            raise TooLarge("command_too_large", str(exc)) from None
        self.records[ex.id] = ex
        if ex.key is not None:
            self.by_key[ex.key] = ex
        self.journal.append("new", ex.journal_new())
        self.active += 1
        metrics.ACTIVE.set(self.active)
        self.on_activity()
        ex.stdin_open = want_stdin
        if stdin:
            self.runner.stdin(ex.channel, stdin)
        if want_stdin and not req.stdin_open:
            self.runner.close_stdin(ex.channel)
            ex.stdin_open = False
        ex._later(timeout, ex.on_timeout)
        return ex, False

    def running(self) -> list[Execution]:
        return [ex for ex in self.records.values() if ex.finished is None]

    # -- a runtime the runner cannot control any more -------------------------

    def demand_restart(
        self, reason: models.RestartReason, message: str, executions: list[Execution]
    ) -> None:
        self.restart.demand(reason, message, [ex.id for ex in executions], self.runner.instance)
        self._closing_reason()

    def _runner_changed(self) -> None:
        if self.runner.connected:
            self.restart.runner_connected(self.runner.instance)
        else:
            self.restart.runner_gone(self.runner.instance)
        self._closing_reason()

    def _closing_reason(self) -> None:
        # What the executions of a connection that closes while a restart is
        # requested are told (the runtime went down, and they with it).
        self.runner.closing_reason = (
            (
                "runtime_restarted",
                "the runtime was restarted to kill a command that would not die "
                f"({self.restart.request.message}); this command ended with it",
            )
            if self.restart.request is not None
            else None
        )

    async def watch_runner(self) -> None:
        """Ask for a runtime restart when the runner answers no ping for
        runner_stall_seconds while commands run: nothing could stop them."""
        stall = self.settings.runner_stall_seconds
        if stall <= 0:
            return
        while True:
            await asyncio.sleep(min(1.0, stall))
            if not self.active or not self.runner.connected or self.restart.requested:
                continue
            instance = self.runner.instance
            if await self.runner.ping(wait=stall):
                continue
            running = self.running()
            if running and self.runner.connected and self.runner.instance == instance:
                self.demand_restart(
                    "runner_unresponsive",
                    f"the runner answered no ping for {stall:g}s while {len(running)} "
                    "command(s) ran",
                    running,
                )

    def get(self, ex_id: str) -> Execution:
        ex = self.records.get(ex_id)
        if ex is None:
            raise NotFound("not_found", f"execution {ex_id!r} not found")
        return ex

    def finished(self, ex: Execution) -> None:
        self.journal.append("end", ex.journal_end())
        self.active -= 1
        metrics.ACTIVE.set(self.active)
        metrics.EXECUTIONS.labels(ex.status).inc()
        if ex.finished is not None:
            metrics.DURATION.observe(ex.finished - (ex.started or ex.created))
        self.on_activity()
        self._prune_records()
        self._spill_memory_logs()
        self._trim_captures()
        if self.journal.needs_compaction():
            self._compact()

    def remove(self, ex: Execution) -> None:
        if ex.finished is None:
            raise Conflict("still_running", "cancel the execution before deleting it")
        self._drop(ex)

    def _drop(self, ex: Execution) -> None:
        if self.records.pop(ex.id, None) is not None:
            self.journal.append("del", {"id": ex.id})
        self._release_capture(ex)
        if ex.key is not None and self.by_key.get(ex.key) is ex:
            del self.by_key[ex.key]
        self._drop_log(ex)

    def _drop_log(self, ex: Execution) -> None:
        if ex.log_size and not ex.log_pruned:
            if ex.mem_log is not None:
                ex._materialize_capture()
                self.mem_log_bytes -= len(ex.mem_log)
                ex.mem_log = None
            else:
                with contextlib.suppress(OSError):
                    os.unlink(ex.log_path)
            self.log_bytes -= ex.log_size
            ex.log_pruned = True

    def _release_capture(self, ex: Execution) -> None:
        if ex.capture is not None:
            self.capture_bytes -= sum(len(b) for b in ex.capture.values())
            ex.capture = {STREAM_OUT: bytearray(), STREAM_ERR: bytearray()}

    def _trim_captures(self) -> None:
        """Bound the tails that finished records keep in memory (oldest go first).

        A record whose tails were dropped still reports its status, exit code
        and byte counts; stdout/stderr come back empty, marked truncated and
        `tailsDropped`, and the full output stays readable by cursor while its
        log exists. Records a request is waiting to answer with are skipped
        (at most one per request: bounded by the connections).
        """
        budget = self.settings.capture_memory_total_bytes
        if self.capture_bytes <= budget:
            return
        for ex in list(self.records.values()):  # oldest first
            if self.capture_bytes <= budget:
                break
            if (
                ex.finished is not None
                and not ex.answering
                and ex.capture
                and any(ex.capture.values())
            ):
                self._release_capture(ex)
                ex.truncated = {STREAM_OUT: True, STREAM_ERR: True}
                ex.tails_dropped = True

    def _spill_memory_logs(self) -> None:
        """Keep finished in-memory logs together under their budget.

        Finished logs are written out in a worker thread: the event loop
        (and the response being built) does not wait for the disk. The log
        stays readable from memory until its file is complete.
        """
        budget = self.settings.log_memory_total_bytes
        if self.mem_log_bytes - self.spilling_bytes <= budget:
            return
        loop = asyncio.get_running_loop()
        for ex in list(self.records.values()):  # oldest first
            if self.mem_log_bytes - self.spilling_bytes <= budget:
                break
            mem = ex.mem_log
            if ex.finished is None or not mem or ex.spilling:
                continue
            ex.spilling = True
            self.spilling_bytes += len(mem)
            fut = loop.run_in_executor(None, _write_file, ex.log_path, mem)
            fut.add_done_callback(functools.partial(self._spilled, ex, len(mem)))

    def _spilled(self, ex: Execution, size: int, fut: asyncio.Future[None]) -> None:
        ex.spilling = False
        self.spilling_bytes -= size
        failed = fut.exception() is not None
        if ex.log_pruned or ex.mem_log is None or failed:
            # dropped meanwhile (or the write failed): no file must stay behind
            with contextlib.suppress(OSError):
                os.unlink(ex.log_path)
            if failed and not ex.log_pruned:
                self._drop_log(ex)
            return
        ex._materialize_capture()
        self.mem_log_bytes -= len(ex.mem_log)
        ex.mem_log = None
        self._trim_captures()

    def _prune_records(self) -> None:
        excess = len(self.records) - self.active - self.settings.max_records
        if excess <= 0:
            return
        victims = []
        for ex in self.records.values():  # insertion order: oldest first
            if ex.finished is not None:
                victims.append(ex)
                if len(victims) >= excess:
                    break
        for ex in victims:
            self._drop(ex)

    def reserve_log(self, ex: Execution, need: int) -> bool:
        """Account for log bytes, pruning the oldest finished logs to make room."""
        # The journal shares the log directory and its budget.
        cap = self.settings.max_log_dir_bytes - self.journal.size
        if self.log_bytes + need > cap:
            for other in list(self.records.values()):
                if self.log_bytes + need <= cap:
                    break
                if other.finished is not None and other.log_size and not other.log_pruned:
                    self._drop_log(other)
        if self.log_bytes + need > cap:
            return False
        self.log_bytes += need
        return True

    def release_log(self, n: int) -> None:
        self.log_bytes -= n

    def fail_all_running(self) -> None:
        for ex in list(self.records.values()):
            if ex.finished is None:
                ex.on_lost("agent_stopping", "the agent is shutting down")


async def stream_events(
    ex: Execution, cursor: int, b64: bool, *, started_event: bool
) -> AsyncGenerator[models.StreamEvent, None]:
    """Events from ``cursor`` until the execution ends and all output was sent."""
    if started_event:
        # The event names the process: a client that addresses it by pid (the
        # E2B adapter) needs the pid before anything else. It comes once the
        # runner spawned the command, or never for one that did not start.
        deadline = time.monotonic() + PID_WAIT
        while ex.pid is None and ex.finished is None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await ex.wait_change(left)
        yield models.StreamEvent(type="started", execution=ex.view(output=False))
    decoders = {
        s: codecs.getincrementaldecoder("utf-8")("replace") for s in (STREAM_OUT, STREAM_ERR)
    }
    while True:
        if ex.log_pruned and ex.finished is not None:
            # Its output is gone (an agent restart, the log cap); how it ended
            # is not. A replayed POST of a lost command gets here at cursor 0.
            yield models.StreamEvent(type="truncated", cursor=cursor)
            yield models.StreamEvent(
                type="finished", execution=ex.view(output=False), cursor=cursor
            )
            return
        chunks = ex.read_log(cursor, 1 << 20)
        for c in chunks:
            v = ex.chunk_view(c, b64, decoders[c.stream])
            yield models.StreamEvent(
                type="output",
                stream=v.stream,
                data=v.data,
                data_base64=v.data_base64,
                cursor=v.cursor,
            )
            cursor = c.cursor
        if not chunks:
            if ex.finished is not None and cursor >= ex.log_size:
                break
            await ex.wait_change(15.0)
    if not b64:
        for s, d in decoders.items():
            tail = d.decode(b"", final=True)
            if tail:
                yield models.StreamEvent(
                    type="output",
                    stream=_STREAM_NAME[s],
                    data=tail,
                    cursor=cursor,
                )
    if ex.log_truncated:
        yield models.StreamEvent(type="truncated", cursor=cursor)
    yield models.StreamEvent(type="finished", execution=ex.view(output=False), cursor=cursor)
