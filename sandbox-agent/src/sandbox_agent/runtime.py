"""Whether the sandbox container (the runtime) must be restarted, and why.

The agent cannot kill the sandbox container's processes itself (another UID,
no capabilities, no shared PID namespace); only the runner can, and a runner
that is wedged (a fork bomb starves it, or it is stopped) cannot. So the
agent asks the kubelet instead: ``GET /livez/runtime`` answers 503 once a
restart is requested, the sandbox container's liveness probe fails, the
kubelet restarts that container, and the death of the runner (PID 1 of the
container's PID namespace) makes the kernel kill every process in it.

A request is about one runner *instance* (each runner start draws a random
id; the pid is 1 every time). It is withdrawn when that instance's
connection closes (the runtime is gone: no probe may fail during the next
container's start-up, or the restarts would loop) or when another instance
says hello. Should the same instance come back, the request stands again.
It is kept in the log dir, so an agent restart does not forget it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Any

import msgspec

from . import metrics, models

log = logging.getLogger("sandbox_agent.runtime")

NAME = "runtime-restart.json"


class RuntimeRestart:
    def __init__(self, log_dir: str) -> None:
        self.path = os.path.join(log_dir, NAME)
        self.request: models.RuntimeRestart | None = None
        self.instance = ""  # the runner instance the request is about
        self.suspect = ""  # the last instance a request was about, once withdrawn
        self._load()

    @property
    def requested(self) -> bool:
        return self.request is not None

    def demand(
        self, reason: models.RestartReason, message: str, execution_ids: list[str], instance: str
    ) -> None:
        """Request a restart of the runtime running ``instance`` (kept if one stands)."""
        if self.request is None:
            log.warning("requesting a restart of the runtime: %s", message)
            metrics.RUNTIME_RESTARTS.labels(reason).inc()
            self.request = models.RuntimeRestart(
                reason=reason, message=message, since=models.rfc3339(time.time()), executions=[]
            )
            self.instance = instance
        self.request.executions += [i for i in execution_ids if i not in self.request.executions]
        self._save()

    def runner_connected(self, instance: str) -> None:
        if not instance:
            return  # a runner that does not say which it is: nothing to compare
        if self.request is not None and instance != self.instance:
            log.info("a new runner (%s) replaced %s: runtime restart done", instance, self.instance)
            self._withdraw(suspect="")
        elif self.request is None and instance == self.suspect:
            self.demand(
                "kill_not_confirmed",
                "the runner that did not confirm a kill is back; the runtime still needs a restart",
                [],
                instance,
            )
        elif self.suspect and instance != self.suspect:
            self._withdraw(suspect="")

    def runner_gone(self, instance: str) -> None:
        if self.request is not None and instance == self.instance:
            log.info("the runner %s is gone: runtime restart done", instance or "(unknown)")
            self._withdraw(suspect=instance)

    def _withdraw(self, suspect: str) -> None:
        self.request = None
        self.instance = ""
        self.suspect = suspect
        self._save()

    # -- persistence ---------------------------------------------------------

    def _save(self) -> None:
        metrics.RUNTIME_RESTART_REQUESTED.set(1 if self.request is not None else 0)
        data: dict[str, Any] = {"instance": self.instance, "suspect": self.suspect}
        if self.request is not None:
            data["request"] = msgspec.to_builtins(self.request)
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)
        except OSError as exc:  # the request still holds in memory
            log.warning("cannot save %s: %s", self.path, exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _load(self) -> None:
        try:
            with open(self.path) as f:
                data = json.load(f)
            req = data.get("request")
            if req is not None:
                self.request = msgspec.convert(req, models.RuntimeRestart)
            self.instance = str(data.get("instance") or "")
            self.suspect = str(data.get("suspect") or "")
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, AttributeError, msgspec.ValidationError) as exc:
            log.warning("ignoring unreadable %s: %s", self.path, exc)
        metrics.RUNTIME_RESTART_REQUESTED.set(1 if self.request is not None else 0)
