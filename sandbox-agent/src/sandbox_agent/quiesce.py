"""Quiesce: stop running executions' writes while a volume snapshot is cut.

Every running execution's process group gets SIGSTOP until ``resume`` or a
bound of the caller's choosing, whichever comes first: a caller (the
operator) that never comes back must not leave commands frozen. While
quiesced, requests that would write the workspace wait (see ``Op.writes``).
"""

from __future__ import annotations

import asyncio
import signal
import time

from .errors import Unavailable
from .executions import Execution, ExecutionManager


class Quiesce:
    def __init__(self, executions: ExecutionManager) -> None:
        self.executions = executions
        self.stopped: list[Execution] = []
        self.resume_at: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()

    def stop(self, seconds: float) -> list[Execution]:
        """SIGSTOP every running execution until `resume` or `seconds` from now.

        Refuses when the runner cannot relay signals: a snapshot taken then
        would not be the consistent one asked for.
        """
        runner = self.executions.runner
        running = self.executions.running()
        if running and not runner.connected:
            raise Unavailable(
                "runner_unavailable",
                "cannot pause running executions: the runner is not connected",
            )
        for ex in running:
            if ex not in self.stopped:
                runner.signal(ex.channel, signal.SIGSTOP)
                self.stopped.append(ex)
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
        for ex in self.stopped:
            if ex.finished is None:
                self.executions.runner.signal(ex.channel, signal.SIGCONT)
                resumed += 1
        self.stopped = []
        return resumed

    async def wait_resumed(self) -> None:
        """Return at once unless quiesced; then when resumed (bounded by the timer)."""
        await self._resumed.wait()
