"""Terminals: a program on a pseudo-terminal in the sandbox, kept apart from its viewers.

The runner starts the program (the user's login shell by default) as the
leader of its own session with a new pty as its controlling terminal. What
it writes goes into a ring buffer here, whoever is attached or not, so a
client that detaches (or loses its connection) and attaches again gets what
it missed, as far as the ring reaches back: offsets into the output are
absolute (a cursor), and a client that asks for bytes the ring no longer
holds is told how many it lost. Memory is the ring per terminal, a bounded
number of terminals; a viewer that reads nothing costs nothing (it pulls
from the ring at its own pace).

A terminal ends when its program exits, on an explicit kill, or after
``idle_timeout`` seconds without anybody attached. Ended terminals are kept
for a while (their last output and exit status), then forgotten. Nothing of a
terminal survives the agent: the runner ends what the agent started when the
agent's connection goes.
"""

from __future__ import annotations

import asyncio
import signal as _signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from . import metrics, models
from .config import Settings
from .environment import Environment
from .errors import Busy, Conflict, Invalid, NotFound, Unavailable
from .runner_client import RunnerClient, Spawn

TerminalStatus = Literal["starting", "running", "exited", "failed", "lost"]

# The user's login shell, as the sandbox's own /etc/passwd names it (the agent
# runs in another container and cannot read it), else sh; bash in place of a
# plain sh where the image has it (sh has no line editing, history or
# completion, and images give users /bin/sh more often than they mean it).
LOGIN_SHELL = (
    'shell=$(getent passwd "$(id -u)" 2>/dev/null | cut -d: -f7); '
    '[ -x "$shell" ] || shell=/bin/sh; '
    'case "$shell" in */sh) shell=$(command -v bash || echo "$shell");; esac; '
    'exec "$shell" -l'
)
# How long creating a terminal waits for the runner to say it started.
START_WAIT = 10.0
# How long an ended terminal stays listed (its output and exit status).
KEEP_ENDED = 600.0
# How often idle terminals and ended ones are looked at.
SWEEP_INTERVAL = 1.0


@dataclass(frozen=True)
class Slice:
    """Output from `cursor` on, as far as it is kept: `dropped` bytes before it are lost."""

    cursor: int
    data: bytes
    dropped: int


class Terminal:
    """One pty program and the ring of its output."""

    def __init__(self, mgr: TerminalManager, req: models.TerminalRequest, argv: list[str]) -> None:
        self.mgr = mgr
        self.id = "term-" + uuid.uuid4().hex[:16]
        self.argv = argv
        self.command = req.command
        self.cwd = req.cwd
        self.cols = req.cols
        self.rows = req.rows
        self.idle_timeout = (
            req.idle_timeout_seconds
            if req.idle_timeout_seconds is not None
            else mgr.settings.terminal_idle_timeout
        )
        self.status: TerminalStatus = "starting"
        self.pid: int | None = None
        self.exit_code: int | None = None
        self.signal: int | None = None
        self.message: str | None = None
        self.created = time.time()
        self.ended: float | None = None
        self.channel = 0
        self.attached = 0
        self.detached_since = time.monotonic()  # nobody attached since then
        self.cap = mgr.settings.terminal_buffer_bytes
        self.ring = bytearray()
        self.start = 0  # absolute offset of ring[0]
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiter: asyncio.Future[None] | None = None

    # -- the runner's side (runner_client.Channel) ----------------------------------

    def on_started(self, pid: int) -> None:
        self.pid = pid
        self.status = "running"
        if not self.started.done():
            self.started.set_result(None)

    def on_output(self, stderr: bool, data: memoryview) -> None:
        self.ring += data
        over = len(self.ring) - self.cap
        if over > 0:
            del self.ring[:over]  # cheap: a bytearray drops its head by moving its start
            self.start += over
        metrics.TERMINAL_OUTPUT_BYTES.inc(len(data))
        self._wake()

    def on_exit(
        self, exit_code: int | None, signal: int | None, usage: dict[str, Any], survivors: int
    ) -> None:
        self.exit_code, self.signal = exit_code, signal
        self._end("exited")

    def on_spawn_failed(self, message: str) -> None:
        self.message = message
        self._end("failed")

    def on_lost(self, code: str, message: str) -> None:
        self.message = f"{code}: {message}"
        self._end("lost")

    def on_stdin_closed(self) -> None:
        pass  # the program closed the terminal's input: nothing to tell anyone

    def _end(self, status: TerminalStatus) -> None:
        if self.ended is not None:
            return
        self.status = status
        self.ended = time.time()
        if not self.started.done():
            self.started.set_result(None)
        self.mgr.ended(self)
        self._wake()

    # -- viewers ----------------------------------------------------------------------

    @property
    def end(self) -> int:
        """Absolute offset after the last byte written."""
        return self.start + len(self.ring)

    @property
    def running(self) -> bool:
        return self.ended is None

    def read(self, cursor: int, limit: int) -> Slice:
        """Up to `limit` bytes from `cursor` (0: the oldest kept)."""
        dropped = max(0, self.start - cursor)
        at = max(cursor, self.start)
        if at > self.end:
            raise Invalid(
                "invalid_cursor", f"cursor {cursor} is past the end of the output ({self.end})"
            )
        offset = at - self.start
        return Slice(at, bytes(self.ring[offset : offset + limit]), dropped)

    async def wait_beyond(self, cursor: int, seconds: float | None = None) -> None:
        """Until output past `cursor` exists or the terminal ended (or `seconds` passed)."""
        if self.end > cursor or not self.running:
            return
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_future()
        # wait(), not await: a cancelled viewer must not cancel the others' future.
        await asyncio.wait([self._waiter], timeout=seconds)

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def attach(self) -> None:
        self.attached += 1

    def detach(self) -> None:
        self.attached -= 1
        if not self.attached:
            self.detached_since = time.monotonic()

    # -- the user's side --------------------------------------------------------------

    def _live(self) -> None:
        if not self.running:
            raise Conflict("terminal_ended", f"terminal {self.id} has ended ({self.status})")

    def write(self, data: bytes) -> None:
        self._live()
        if data:
            try:
                self.mgr.runner.stdin(self.channel, data)
            except ConnectionError as exc:
                raise Unavailable("runner_unavailable", str(exc)) from None
            except Busy:
                raise Busy(
                    "terminal_backlogged",
                    "the terminal is not taking input as fast as it is sent; retry later",
                ) from None

    def resize(self, cols: int, rows: int) -> None:
        self._live()
        self.cols, self.rows = cols, rows
        self.mgr.runner.resize(self.channel, cols, rows)

    def send_signal(self, sig: int) -> None:
        """To the terminal's foreground job, as a key would (Ctrl-C: SIGINT)."""
        self._live()
        self.mgr.runner.signal(self.channel, sig, foreground=True)

    def kill(self) -> None:
        if self.running:
            sweep = self.mgr.settings.kill_grace
            self.mgr.runner.signal(self.channel, _signal.SIGKILL, sweep=sweep)

    def view(self) -> models.Terminal:
        return models.Terminal(
            id=self.id,
            status=self.status,
            command=self.command,
            argv=self.argv if self.command is None else None,
            cwd=self.cwd,
            cols=self.cols,
            rows=self.rows,
            pid=self.pid,
            exit_code=self.exit_code,
            signal=self.signal,
            message=self.message,
            created_at=models.rfc3339(self.created),
            ended_at=models.rfc3339(self.ended) if self.ended is not None else None,
            attached=self.attached,
            output_cursor=self.end,
            output_start=self.start,
            idle_timeout_seconds=self.idle_timeout,
        )


class TerminalManager:
    def __init__(
        self,
        settings: Settings,
        runner: RunnerClient,
        environment: Environment,
        on_activity: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.runner = runner
        self.environment = environment
        self.on_activity = on_activity
        self.terminals: dict[str, Terminal] = {}
        self._sweeper: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for term in self.terminals.values():
            term.kill()

    @property
    def live(self) -> int:
        return sum(1 for t in self.terminals.values() if t.running)

    async def create(self, req: models.TerminalRequest, cwd: str) -> Terminal:
        if self.live >= self.settings.max_terminals:
            raise Busy(
                "too_many_terminals",
                f"at most {self.settings.max_terminals} terminals may run at once"
                " (SANDBOX_AGENT_MAX_TERMINALS); kill one first",
            )
        if not self.runner.connected:
            raise Unavailable("runner_unavailable", self.runner.last_error or "no runner")
        if req.command is not None:
            argv = [self.settings.shell, "-c", req.command, self.settings.shell]
        elif req.argv is not None:
            argv = list(req.argv)
        else:
            argv = [self.settings.shell, "-c", LOGIN_SHELL, self.settings.shell]
        term = Terminal(self, req, argv)
        env = {**self.environment.env, **req.env}
        spawn = Spawn(argv, env, self.environment.unset, cwd, True, pty=(req.cols, req.rows))
        spawn.mark = term.id
        try:
            term.channel = self.runner.spawn(term, spawn)
        except ConnectionError as exc:
            raise Unavailable("runner_unavailable", str(exc)) from None
        except ValueError as exc:
            raise Invalid("invalid_request", str(exc)) from None
        self._make_room()
        self.terminals[term.id] = term
        metrics.TERMINALS.set(self.live)
        self.on_activity()
        try:
            async with asyncio.timeout(START_WAIT):
                await asyncio.shield(term.started)
        except TimeoutError:
            term.kill()
            why = "the runner did not start the terminal"
            raise Unavailable("runner_unresponsive", why) from None
        if term.status == "failed":
            self.terminals.pop(term.id, None)
            raise Invalid("spawn_failed", term.message or "the terminal's program did not start")
        return term

    def get(self, term_id: str) -> Terminal:
        term = self.terminals.get(term_id)
        if term is None:
            raise NotFound("terminal_not_found", f"no terminal {term_id}")
        return term

    def remove(self, term: Terminal) -> None:
        term.kill()
        self.terminals.pop(term.id, None)
        metrics.TERMINALS.set(self.live)

    def ended(self, term: Terminal) -> None:
        metrics.TERMINALS.set(self.live)

    def _make_room(self) -> None:
        """Forget the oldest ended terminals beyond the cap (live ones are capped above)."""
        ended = sorted(
            (t for t in self.terminals.values() if not t.running), key=lambda t: t.ended or 0
        )
        while ended and len(self.terminals) >= self.settings.max_terminals:
            self.terminals.pop(ended.pop(0).id, None)

    def sweep(self, now_mono: float, now: float) -> None:
        """End terminals nobody attached to for their idle timeout; forget old ended ones."""
        for term in list(self.terminals.values()):
            if term.running:
                idle = term.idle_timeout
                if not term.attached and idle and now_mono - term.detached_since > idle:
                    term.message = f"nobody attached for {idle:g}s (idleTimeoutSeconds)"
                    term.kill()
            elif term.ended is not None and now - term.ended > KEEP_ENDED:
                self.terminals.pop(term.id, None)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            self.sweep(time.monotonic(), time.time())
