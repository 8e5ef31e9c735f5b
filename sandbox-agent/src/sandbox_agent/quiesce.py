"""Quiesce: stop what runs in the sandbox from writing while a volume snapshot is cut.

Every running execution, terminal and code context gets SIGSTOP, on every process that
carries its mark (its process group, a shell's jobs, what left the group),
until ``resume`` or a bound of the caller's choosing, whichever comes first:
a caller (the operator) that never comes back must not leave commands
frozen. While quiesced, requests that would write the workspace wait (see
``Op.writes``).
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Protocol

from .contexts import ContextManager
from .errors import Unavailable
from .executions import ExecutionManager
from .terminals import TerminalManager


class Running(Protocol):
    """An execution or a terminal: its runner channel, and whether it still runs."""

    id: str
    channel: int

    @property
    def running(self) -> bool: ...


class Quiesce:
    def __init__(
        self, executions: ExecutionManager, terminals: TerminalManager, contexts: ContextManager
    ) -> None:
        self.executions = executions
        self.terminals = terminals
        self.contexts = contexts
        self.stopped: list[Running] = []
        self.resume_at: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()

    def _running(self) -> list[Running]:
        terminals = [t for t in self.terminals.terminals.values() if t.running]
        return [*self.executions.running(), *terminals, *self.contexts.kernels()]

    def stop(self, seconds: float) -> list[Running]:
        """SIGSTOP everything running until `resume` or `seconds` from now.

        Refuses when the runner cannot relay signals: a snapshot taken then
        would not be the consistent one asked for.
        """
        runner = self.executions.runner
        running = self._running()
        if running and not runner.connected:
            raise Unavailable(
                "runner_unavailable",
                "cannot pause running executions: the runner is not connected",
            )
        for what in running:
            if what not in self.stopped:
                runner.signal(what.channel, signal.SIGSTOP, everywhere=True)
                self.stopped.append(what)
        if self._timer is not None:
            self._timer.cancel()
        self._resumed.clear()
        self.resume_at = time.time() + seconds
        self._timer = asyncio.get_running_loop().call_later(seconds, self.resume)
        return list(self.stopped)

    def resume(self) -> int:
        """SIGCONT what `stop` stopped; idempotent. Returns how many were continued."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.resume_at = None
        self._resumed.set()
        resumed = 0
        for what in self.stopped:
            if what.running:
                self.executions.runner.signal(what.channel, signal.SIGCONT, everywhere=True)
                resumed += 1
        self.stopped = []
        return resumed

    async def wait_resumed(self) -> None:
        """Return at once unless quiesced; then when resumed (bounded by the timer)."""
        await self._resumed.wait()
