"""Code contexts: a Jupyter kernel per context, in the sandbox, whose state
survives between runs (the code-interpreter pattern).

A context is a bridge process (kernel.py, placed next to the runner) that the
runner starts in the sandbox container with the image's own python3; the
bridge starts an IPython kernel with jupyter_client and speaks one JSON
object per line on its stdin and stdout. So the kernel runs as the sandbox
user, with the user's packages, and its memory counts against the sandbox,
not the agent.

What the bridge says is untrusted (user code can replace it): lines are
bounded, parsed strictly, and only the fields of the current run's events
pass. Memory per run is bounded too: output and results a client has not read
yet beyond ``PENDING_CAP`` are dropped and counted (finished.droppedBytes);
the error and the run's end never are.

One run at a time per context (a kernel runs one cell at a time); further
runs wait their turn, up to ``MAX_WAITING``. A run past its timeout gets an
interrupt (KeyboardInterrupt in the kernel: its state survives); if the run
has not ended ``INTERRUPT_GRACE`` seconds later the kernel is started again
(state lost, said in the finished event). A client that leaves mid-run
interrupts it the same way.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec

from . import metrics, models
from .config import Settings
from .environment import Environment
from .errors import Busy, Conflict, NotFound, Unavailable
from .runner_client import RunnerClient, Spawn

# The bridge of each language, placed next to the runner (server.PLACED).
BRIDGES: dict[models.Language, str] = {"python": "kernel.py", "javascript": "kernel.js"}
# A line from the bridge, at most (a result with a large image in it).
MAX_LINE = 32 << 20
# Output text held for a client that reads slower than the code writes.
PENDING_CAP = 16 << 20
# After an interrupt, how long a run may take to end before its kernel is
# started again.
INTERRUPT_GRACE = 5.0
# A run whose client left is interrupted if it has not ended this much later.
ABANDON_WAIT = 0.5
# Runs waiting for their turn in one context.
MAX_WAITING = 16
# Context ids the agent makes itself: one default context per language.
DEFAULT_PREFIX = "default-"

_decode = msgspec.json.Decoder(dict[str, Any]).decode


class _Run:
    """One code run's events, queued for its client."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex[:16]
        self.events: collections.deque[models.CodeEvent] = collections.deque()
        self.pending = 0  # text bytes queued
        self.dropped = 0
        self.done = False
        self.interrupted = False
        self.timed_out = False
        self.started = time.monotonic()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, event: models.CodeEvent) -> None:
        if self.done:
            return
        size = _size(event)
        if size:
            if self.pending + size > PENDING_CAP:
                self.dropped += size
                return
            self.pending += size
        if event.type == "finished":
            self.done = True
        self.events.append(event)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next(self, seconds: float) -> models.CodeEvent | None:
        """The next event, or None when `seconds` passed without one."""
        if not self.events:
            self._waiter = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(seconds, 0.0)):
                    await asyncio.shield(self._waiter)
        if not self.events:
            return None
        event = self.events.popleft()
        self.pending -= _size(event)
        return event


async def _ends_within(run: _Run, seconds: float) -> bool:
    """Whether `run` ends within `seconds` (its events are read and dropped:
    nobody is there to get them)."""
    deadline = time.monotonic() + seconds
    while not run.done and time.monotonic() < deadline:
        await run.next(deadline - time.monotonic())
    return run.done


def _size(event: models.CodeEvent) -> int:
    """What an event holds for a slow client, roughly in bytes: text and
    results count (a loop can display a million of them), the one error and
    the bookends do not."""
    if event.type in ("stdout", "stderr"):
        return len(event.text or "")
    if event.type == "result":
        return 64 + sum(len(k) + len(str(v)) for k, v in (event.data or {}).items())
    return 0


class _Kernel:
    """One bridge process (a runner channel) and the lines it writes."""

    def __init__(self, ctx: Context, generation: int) -> None:
        self.ctx = ctx
        # The runner's mark, so that a kill reaches the kernel too. Unique: a
        # context made again under the same id (a default one) must not carry
        # the mark of its predecessor, whose kill may still be sweeping.
        self.id = f"{ctx.id}.{generation}.{uuid.uuid4().hex[:8]}"
        self.channel = 0
        self.pid: int | None = None
        self.ready: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self.ended = False  # no use any more (said it died, or its process ended)
        self.exited = False  # its process ended: nothing left to kill
        self.line = bytearray()
        self.skipping = False  # inside an over-long line: drop up to its end
        self.stderr = bytearray()  # the bridge's last words, for a failure message
        # The image cannot run this language's kernel (no node, no jupyter_client):
        # a fact about the sandbox, not a passing failure.
        self.unsupported = False

    @property
    def running(self) -> bool:
        return not self.ended

    # -- runner_client.Channel ----------------------------------------------------

    def on_started(self, pid: int) -> None:
        self.pid = pid

    def on_output(self, stderr: bool, data: memoryview) -> None:
        if stderr:
            self.stderr += data
            del self.stderr[:-4096]
            return
        chunk = bytes(data)
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            if end < 0:
                if not self.skipping:
                    self.line += chunk[start:]
                    if len(self.line) > MAX_LINE:
                        self.line.clear()
                        self.skipping = True
                        self.ctx.oversized()
                return
            if self.skipping:
                self.skipping = False
            else:
                self.line += chunk[start:end]
                if len(self.line) <= MAX_LINE:
                    self._line(bytes(self.line))
                else:
                    self.ctx.oversized()
            self.line.clear()
            start = end + 1

    def on_exit(
        self, exit_code: int | None, signal: int | None, usage: dict[str, Any], survivors: int
    ) -> None:
        why = f"exit status {exit_code}" if exit_code is not None else f"signal {signal}"
        self.exited = True
        self._end(f"the kernel's bridge ended ({why})")

    def on_spawn_failed(self, message: str) -> None:
        self.exited = True
        self.unsupported = True  # its interpreter is not in the image
        self._end(f"the kernel's bridge did not start: {message}")

    def on_lost(self, code: str, message: str) -> None:
        self.exited = True
        self._end(f"{code}: {message}")

    def on_stdin_closed(self) -> None:
        pass

    def _end(self, message: str) -> None:
        if self.ended:
            return
        self.ended = True
        last = self.stderr.decode(errors="replace").strip().splitlines()
        if last:
            message += f": {last[-1][:500]}"
        if not self.ready.done():
            self.ready.set_result(message)
        self.ctx.kernel_ended(self, message)

    # -- the bridge's lines ---------------------------------------------------------

    def _line(self, raw: bytes) -> None:
        try:
            obj = _decode(raw)
        except msgspec.DecodeError:
            return  # not ours to trust or to repeat
        kind = obj.get("type")
        if kind == "ready":
            self.ctx.language_version = _text(obj.get("languageVersion"), 64)
            if not self.ready.done():
                self.ready.set_result(None)
        elif kind == "unavailable":
            self.unsupported = True
            if not self.ready.done():
                message = _text(obj.get("message"), 2000) or "the kernel is unavailable"
                self.ready.set_result(message)
        elif kind == "died":
            # Dead from now on (the bridge exits next): the run ends with why.
            self._end(_text(obj.get("message"), 2000) or "the kernel ended")
        else:
            run = self.ctx.current
            if run is not None and obj.get("id") == run.id:
                event = _event(obj)
                if event is not None:
                    run.put(event)

    # -- the agent's side -------------------------------------------------------------

    def send(self, obj: dict[str, Any]) -> None:
        try:
            self.ctx.mgr.runner.stdin(self.channel, msgspec.json.encode(obj) + b"\n")
        except (ConnectionError, Busy) as exc:
            raise Unavailable("runner_unavailable", f"cannot reach the kernel: {exc}") from None

    def kill(self) -> None:
        if not self.exited:
            with contextlib.suppress(ConnectionError):
                self.ctx.mgr.runner.signal(
                    self.channel, signal.SIGKILL, sweep=self.ctx.mgr.settings.kill_grace
                )


def _text(value: Any, limit: int) -> str | None:
    return value[:limit] if isinstance(value, str) else None


def _event(obj: dict[str, Any]) -> models.CodeEvent | None:
    """The client's event for one of the bridge's, with only fields of the right type."""
    kind = obj.get("type")
    if kind in ("stdout", "stderr"):
        text = obj.get("text")
        return models.CodeEvent(type=kind, text=text) if isinstance(text, str) else None
    count = obj.get("executionCount")
    count = count if isinstance(count, int) and not isinstance(count, bool) else None
    if kind == "result":
        data, meta = obj.get("data"), obj.get("metadata")
        if not isinstance(data, dict):
            return None
        return models.CodeEvent(
            type="result",
            data=data,
            metadata=meta if isinstance(meta, dict) else {},
            is_main=obj.get("isMain") is True,
            execution_count=count,
        )
    if kind == "error":
        tb = obj.get("traceback")
        return models.CodeEvent(
            type="error",
            name=_text(obj.get("name"), 1000) or "Error",
            value=_text(obj.get("value"), 1 << 20) or "",
            traceback=[t for t in tb if isinstance(t, str)] if isinstance(tb, list) else [],
        )
    if kind == "finished":
        status = obj.get("status")
        return models.CodeEvent(
            type="finished",
            status=status if status in ("ok", "error", "aborted") else "error",
            execution_count=count,
        )
    return None


class Context:
    def __init__(self, mgr: ContextManager, cid: str, req: models.ContextRequest, cwd: str) -> None:
        self.mgr = mgr
        self.id = cid
        self.language = req.language
        self.cwd = cwd
        self.env = dict(req.env)
        self.created = time.time()
        self.last_used: float | None = None
        self.executions = 0
        self.restarts = -1  # the first start is not a restart
        self.kernel: _Kernel | None = None
        self.starting = False
        self.message: str | None = None
        self.language_version: str | None = None
        self.current: _Run | None = None
        self.lock = asyncio.Lock()
        self.waiting = 0
        self.generation = 0
        # A restart no run has reported yet (one after an abandoned run): the
        # next run's started event says restarted.
        self.unannounced_restart = False

    @property
    def status(self) -> models.ContextStatus:
        if self.starting:
            return "starting" if self.restarts < 0 else "restarting"
        if self.kernel is None or self.kernel.ended:
            return "dead"
        return "busy" if self.current is not None else "idle"

    def view(self) -> models.Context:
        return models.Context(
            id=self.id,
            language=self.language,
            cwd=self.cwd,
            status=self.status,
            created_at=models.rfc3339(self.created),
            last_used_at=models.rfc3339(self.last_used) if self.last_used else None,
            executions=self.executions,
            restarts=max(self.restarts, 0),
            pid=self.kernel.pid if self.kernel is not None and not self.kernel.ended else None,
            language_version=self.language_version,
            message=self.message,
        )

    # -- from the kernel ----------------------------------------------------------

    def oversized(self) -> None:
        run = self.current
        if run is not None:
            run.put(
                models.CodeEvent(
                    type="stderr",
                    text=f"[an output over {MAX_LINE >> 20} MiB was left out]\n",
                )
            )

    def kernel_ended(self, kernel: _Kernel, message: str) -> None:
        if kernel is not self.kernel:
            return
        self.message = self.message or message
        run = self.current
        if run is not None and not run.done:
            run.put(
                models.CodeEvent(
                    type="error", name="KernelDied", value=self.message or message, traceback=[]
                )
            )
            run.put(models.CodeEvent(type="finished", status="aborted", restarted=True))
        metrics.CONTEXTS.set(self.mgr.live)

    # -- starting and stopping ------------------------------------------------------

    async def start(self) -> None:
        """A new kernel (the old one, if any, is killed): waits until it is ready."""
        old = self.kernel
        if old is not None:
            old.kill()
        self.generation += 1
        kernel = _Kernel(self, self.generation)
        self.kernel = kernel
        self.restarts += 1
        self.message = None
        self.starting = True
        mgr = self.mgr
        env = {**mgr.environment.env, **self.env}
        spawn = Spawn(
            [
                *mgr.interpreter(self.language),
                f"{mgr.settings.runtime_dir}/{BRIDGES[self.language]}",
            ],
            env,
            mgr.environment.unset,
            self.cwd,
            True,
        )
        spawn.mark = kernel.id
        try:
            try:
                kernel.channel = mgr.runner.spawn(kernel, spawn)
            except ConnectionError as exc:
                raise Unavailable("runner_unavailable", str(exc)) from None
            metrics.CONTEXTS.set(mgr.live)
            try:
                async with asyncio.timeout(mgr.settings.context_start_timeout):
                    failure = await asyncio.shield(kernel.ready)
            except TimeoutError:
                kernel.kill()
                failure = (
                    f"the kernel did not start in {mgr.settings.context_start_timeout:g}s"
                    " (SANDBOX_AGENT_CONTEXT_START_TIMEOUT)"
                )
        finally:
            self.starting = False
        if failure is not None:
            kernel.kill()
            self.message = failure
            if kernel.unsupported:
                raise Conflict("kernel_unavailable", failure)
            raise Unavailable("kernel_unavailable", failure)

    def stop(self) -> None:
        if self.kernel is not None:
            self.kernel.kill()


class ContextManager:
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
        self.contexts: dict[str, Context] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def interpreter(self, language: models.Language) -> list[str]:
        """What runs a language's bridge: the runner's own python3 (the image's,
        the one with its packages), and the image's `node`."""
        if language == "javascript":
            return ["node"]
        info = self.runner.info or {}
        return [str(info.get("executable") or "") or "python3"]

    @property
    def live(self) -> int:
        return sum(1 for c in self.contexts.values() if c.kernel is not None and c.kernel.running)

    @property
    def busy(self) -> int:
        """Contexts running code now: activity, like a running command."""
        return sum(1 for c in self.contexts.values() if c.current is not None)

    def kernels(self) -> list[_Kernel]:
        """Running bridges (with their kernels): what a quiesce stops."""
        return [
            c.kernel for c in self.contexts.values() if c.kernel is not None and c.kernel.running
        ]

    async def create(self, req: models.ContextRequest, cwd: str, cid: str | None = None) -> Context:
        if len(self.contexts) >= self.settings.max_contexts:
            raise Busy(
                "too_many_contexts",
                f"at most {self.settings.max_contexts} code contexts may exist at once"
                " (SANDBOX_AGENT_MAX_CONTEXTS); delete one first",
            )
        if not self.runner.connected:
            raise Unavailable("runner_unavailable", self.runner.last_error or "no runner")
        ctx = Context(self, cid or "ctx-" + uuid.uuid4().hex[:16], req, cwd)
        self.contexts[ctx.id] = ctx
        self.on_activity()
        try:
            await ctx.start()
        except BaseException:
            self.contexts.pop(ctx.id, None)
            ctx.stop()
            raise
        return ctx

    async def default(self, language: models.Language) -> Context:
        """The language's default context, started on first use."""
        cid = DEFAULT_PREFIX + language
        ctx = self.contexts.get(cid)
        if ctx is not None:
            return ctx
        return await self.create(models.ContextRequest(language=language), ".", cid)

    def get(self, cid: str) -> Context:
        ctx = self.contexts.get(cid)
        if ctx is None:
            raise NotFound("context_not_found", f"no code context {cid}")
        return ctx

    def remove(self, ctx: Context) -> None:
        self.contexts.pop(ctx.id, None)
        ctx.stop()
        metrics.CONTEXTS.set(self.live)

    async def restart(self, ctx: Context) -> None:
        ctx.message = "restarted on request"
        ctx.stop()  # a run in progress ends (aborted) and gives up its turn
        async with ctx.lock:
            await ctx.start()

    def interrupt(self, ctx: Context) -> None:
        run = ctx.current
        if run is not None and ctx.kernel is not None:
            run.interrupted = True
            ctx.kernel.send({"op": "interrupt", "id": run.id})

    async def stop(self) -> None:
        for ctx in self.contexts.values():
            ctx.stop()
        for task in list(self._tasks):
            task.cancel()

    async def run(
        self, ctx: Context, code: str, seconds: float, env: dict[str, str] | None = None
    ) -> AsyncGenerator[models.CodeEvent, None]:
        """Run `code` in `ctx` when its turn comes, with `env` set in the kernel for
        this run only; the events as they come."""
        if ctx.waiting >= MAX_WAITING:
            raise Busy(
                "context_busy", f"{MAX_WAITING} runs already wait for context {ctx.id}; retry later"
            )
        ctx.waiting += 1
        try:
            await ctx.lock.acquire()
        finally:
            ctx.waiting -= 1
        run: _Run | None = None
        try:
            restarted = ctx.kernel is None or ctx.kernel.ended
            if restarted:
                await ctx.start()  # its kernel died since the last run: a new one
            announce, ctx.unannounced_restart = ctx.unannounced_restart, False
            kernel = ctx.kernel
            assert kernel is not None
            run = _Run()
            ctx.current = run
            ctx.executions += 1
            ctx.last_used = time.time()
            self.on_activity()
            metrics.CONTEXT_RUNS.inc()
            op: dict[str, Any] = {"op": "execute", "id": run.id, "code": code}
            if env:
                op["env"] = env
            kernel.send(op)
            yield models.CodeEvent(
                type="started",
                context_id=ctx.id,
                restarted=True if (restarted and ctx.restarts > 0) or announce else None,
            )
            async with contextlib.aclosing(self._events(ctx, run, seconds)) as events:
                async for event in events:  # closed with this one (web.Stream)
                    yield event
        finally:
            if run is not None and not run.done:
                # The client left mid-run: interrupt it, and give the context
                # back only once the kernel is done with it.
                task = asyncio.get_running_loop().create_task(self._abandon(ctx, run))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                self._release(ctx)

    async def _events(
        self, ctx: Context, run: _Run, seconds: float
    ) -> AsyncGenerator[models.CodeEvent, None]:
        deadline = run.started + seconds
        grace: float | None = None
        while True:
            event = await run.next((grace or deadline) - time.monotonic())
            if event is None:
                if grace is None:
                    run.timed_out = True
                    with contextlib.suppress(Unavailable):
                        self.interrupt(ctx)
                    grace = time.monotonic() + INTERRUPT_GRACE
                    continue
                # The interrupt did not end it (code that ignores SIGINT).
                with contextlib.suppress(Unavailable):
                    await self._restart_for(ctx, run)
                event = models.CodeEvent(type="finished", status="aborted", restarted=True)
            if event.type != "finished":
                yield event
                continue
            status = event.status
            if run.timed_out:
                status = "timed_out"
            elif run.interrupted and status == "error":
                status = "interrupted"
            yield models.CodeEvent(
                type="finished",
                context_id=ctx.id,
                status=status,
                execution_count=event.execution_count,
                duration_ms=int((time.monotonic() - run.started) * 1000),
                dropped_bytes=run.dropped or None,
                restarted=event.restarted,
                message=ctx.message if event.restarted else None,
            )
            self.on_activity()
            return

    async def _restart_for(self, ctx: Context, run: _Run) -> None:
        run.done = True
        ctx.current = None
        ctx.message = f"the run did not end {INTERRUPT_GRACE:g}s after an interrupt"
        message = ctx.message
        await ctx.start()
        ctx.message = message

    async def _abandon(self, ctx: Context, run: _Run) -> None:
        try:
            # A short run ends on its own: an interrupt that reaches the kernel
            # just after a cell can end the kernel.
            if await _ends_within(run, ABANDON_WAIT):
                return
            with contextlib.suppress(Unavailable):
                self.interrupt(ctx)
            if not await _ends_within(run, INTERRUPT_GRACE):
                with contextlib.suppress(Unavailable):
                    await self._restart_for(ctx, run)
                ctx.unannounced_restart = True
        finally:
            self._release(ctx)

    def _release(self, ctx: Context) -> None:
        ctx.current = None
        ctx.lock.release()
