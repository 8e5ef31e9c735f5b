"""The objects the handlers share, built once per agent (``build_app``)."""

from __future__ import annotations

import asyncio
import time
import weakref

from starlette.requests import Request

from . import metrics
from .config import Settings
from .contexts import ContextManager
from .environment import Environment
from .executions import ExecutionManager
from .paths import Workspace
from .quiesce import Quiesce
from .runner_client import RunnerClient
from .runtime import RuntimeRestart
from .terminals import TerminalManager
from .watch import Stream
from .watchers import Watchers


class AgentState:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.workspace = Workspace(settings.workspace)
        self.runner = RunnerClient(settings.socket_path)
        self.started = time.time()
        self.last_activity = self.started
        self.restart = RuntimeRestart(settings.log_dir)
        self.environment = Environment(settings.log_dir)
        self.executions = ExecutionManager(
            settings, self.runner, self.touch, self.restart, self.environment
        )
        self.terminals = TerminalManager(settings, self.runner, self.environment, self.touch)
        self.contexts = ContextManager(settings, self.runner, self.environment, self.touch)
        self.quiesce = Quiesce(self.executions, self.terminals, self.contexts)
        self.openapi = b"{}"  # the served document, rendered by build_app from the table
        # Readiness probes holding their answer (waitSeconds) right now: the
        # only way an unauthenticated client can keep a connection busy, so
        # their number is bounded (see api_health.readyz).
        self.probe_waits = 0
        # File operations that read whole files (search, find, patch, replace):
        # bounded, so that they neither pile up in memory nor take every thread
        # of the pool that stat, read and write run in.
        self.file_scans = asyncio.Semaphore(settings.max_file_scans)
        # Open directory watches (their streams): bounded by settings.max_watches.
        # Weak, so a watcher whose stream never started (the client left before
        # the answer) frees its slot when it is dropped.
        self.watchers: weakref.WeakSet[Stream] = weakref.WeakSet()
        # Watches kept between calls, fetched by polling (watchers.py).
        self.polled = Watchers(settings.max_watchers, settings.watcher_idle_timeout)
        self.runner.on_change.append(self._runner_changed)

    def touch(self) -> None:
        """Record user activity (exec and file calls; never probes or info)."""
        self.last_activity = time.time()

    def _runner_changed(self) -> None:
        metrics.RUNNER_CONNECTED.set(1 if self.runner.connected else 0)


def state_of(request: Request) -> AgentState:
    st: AgentState = request.app.state.agent
    return st
