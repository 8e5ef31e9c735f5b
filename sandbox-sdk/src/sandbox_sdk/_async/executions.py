"""Commands: a sandbox's `execute`, `stream`, `start`, `jobs` and `job` (methods
of AsyncSandbox, which assigns them; the sandbox is their first argument), the
output stream that reattaches after a broken connection, and AsyncJob, a
background command's handle."""

from __future__ import annotations

import base64
import collections
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from sandbox_sdk import _lazy
from sandbox_sdk._async.gateway import read_to_end
from sandbox_sdk._async_io import sleep
from sandbox_sdk._wire import MAX_TIMEOUT, FileContent, event_of, exec_body, timeout_seconds
from sandbox_sdk.errors import (
    CommandFailed,
    CommandLost,
    CommandTimeout,
    Gone,
    NotFound,
    NotReady,
    ServerError,
    Timeout,
)
from sandbox_sdk.types import CommandResult, OutputEvent, Sink, write_sink

if TYPE_CHECKING:
    from sandbox_sdk._async.sandbox import AsyncSandbox
    from sandbox_sdk.models import agent
else:  # the generated models are built on first use: see sandbox_sdk._lazy
    agent = _lazy.module("sandbox_sdk.models.agent")

JSON = dict[str, Any]
DEFAULT_TIMEOUT = 180.0  # a command's, unless it says otherwise
MAX_JOB_TIMEOUT = 3600.0


async def execute(
    self: AsyncSandbox,
    command: str | Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdin: FileContent | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    stdout: Sink | None = None,
    stderr: Sink | None = None,
    combined_output: bool = False,
    check: bool = False,
) -> CommandResult:
    """Run a command and return its result.

    `command`: a shell script (str) or an argv list. `timeout` in seconds (3
    minutes by default, at most 30): past it the command is stopped and
    CommandTimeout (with the output so far in `.result`) is raised; the
    sandbox stays usable. With `stdout`/`stderr` (callbacks or text files)
    the output is streamed to them while it runs. `check`: CommandFailed
    unless it exits 0. Retries never run the command twice (idempotency key).
    """
    seconds = timeout_seconds(timeout, MAX_TIMEOUT)
    body = exec_body(
        command,
        env=env,
        cwd=cwd,
        stdin=stdin,
        timeout=seconds,
        combined_output=combined_output,
    )
    if stdout is None and stderr is None:
        response = await self._request("POST", "executions", json_body=body, timeout=seconds + 60)
        result = CommandResult.of(agent.Execution.model_validate(response.json()))
    else:
        result = await _streamed(self, body, seconds, stdout, stderr)
    return _checked(result, check)


async def _streamed(
    self: AsyncSandbox, body: JSON, seconds: int, stdout: Sink | None, stderr: Sink | None
) -> CommandResult:
    result: CommandResult | None = None
    async for event in self._events("POST", "executions/stream", body, seconds + 60):
        if event.kind == "stdout":
            write_sink(stdout, event.data)
        elif event.kind == "stderr":
            write_sink(stderr, event.data)
        else:
            result = event.result
    if result is None:
        raise ServerError("the output stream ended before the command did")
    return result


async def stream(
    self: AsyncSandbox,
    command: str | Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdin: FileContent | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    combined_output: bool = False,
) -> AsyncIterator[OutputEvent]:
    """Run a command and iterate over its output as it comes: `stdout` and
    `stderr` events, then one `exit` event whose `result` is the outcome."""
    seconds = timeout_seconds(timeout, MAX_TIMEOUT)
    body = exec_body(
        command,
        env=env,
        cwd=cwd,
        stdin=stdin,
        timeout=seconds,
        combined_output=combined_output,
    )
    async for event in self._events("POST", "executions/stream", body, seconds + 60):
        yield event


async def _events(
    self: AsyncSandbox, method: str, tail: str, body: JSON | None, read_timeout: float | None
) -> AsyncIterator[OutputEvent]:
    """The agent's event stream; after a broken connection it reattaches to the
    same execution from the last cursor (the command does not run again)."""
    execution_id: str | None = None
    cursor = 0
    # The finished event's record carries no output (it was streamed): the
    # result gets the streamed text back, its tail like the captured form.
    seen = {"stdout": _Tail(), "stderr": _Tail()}
    for attempt in range(4):
        if execution_id is None:
            call_method, call_tail, params = method, tail, None
        else:
            call_method, call_tail = "GET", f"executions/{execution_id}/stream"
            params = {"cursor": str(cursor)}
        try:
            async with self.client.gateway.stream(
                self.namespace,
                self.name,
                call_method,
                call_tail,
                json_body=body if execution_id is None else None,
                params=params,
                read_timeout=read_timeout,
            ) as response:
                execution_id = response.headers.get("X-Execution-Id") or execution_id
                lines = response.aiter_lines()
                async for line in lines:
                    if not line:
                        continue
                    kind, event, named = event_of(json.loads(line))
                    if named is not None:
                        execution_id = named
                    if event is not None:
                        if event.cursor is not None:
                            cursor = event.cursor
                        if event.kind in seen:
                            seen[event.kind].add(event.data)
                        elif event.result is not None:
                            event = _with_output(event, seen)
                    if kind == "finished":
                        await read_to_end(lines)  # first: the caller may stop at this event
                    if event is not None:
                        yield event
                    if kind == "finished":
                        return
        except (NotReady, NotFound) as exc:
            if execution_id is not None or attempt == 3 or not await self._worth_waiting(exc):
                raise
        except Gone:
            if execution_id is None:
                raise
            # The output from the cursor on is gone (pruned under the log
            # cap, or held in memory by an agent that restarted since); the
            # record still tells how the command ended.
            result = await AsyncJob(self, execution_id).wait()
            yield _with_output(OutputEvent("exit", result=result), seen)
            return
        except ServerError:
            if attempt == 3 or (execution_id is None and not _idempotent(body)):
                raise
            # Before the first header the execution's id is unknown, but the
            # request's idempotency key names it: the same POST again finds
            # the command (a restarted agent answers with its record) and
            # never starts it twice.
            await sleep(0.5 * 2**attempt)
    raise ServerError("the output stream broke off repeatedly")


async def start(
    self: AsyncSandbox,
    command: str | Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdin: FileContent | None = None,
    stdin_open: bool = False,
    timeout: float = 1800.0,
    combined_output: bool = False,
) -> AsyncJob:
    """Start a background job (a server, a long build); returns at once.
    `stdin_open`: keep its stdin open for `job.write()`."""
    seconds = timeout_seconds(timeout, MAX_JOB_TIMEOUT)
    body = exec_body(
        command,
        env=env,
        cwd=cwd,
        stdin=stdin,
        timeout=seconds,
        combined_output=combined_output,
        background=True,
        stdin_open=stdin_open,
    )
    response = await self._request("POST", "executions", json_body=body)
    return AsyncJob(self, str(response.json()["id"]))


async def jobs(self: AsyncSandbox, *, status: str | None = None) -> list[agent.Execution]:
    """The commands the agent remembers (running and finished), without output."""
    params = {"status": status} if status else None
    answer = await self._request("GET", "executions", params=params)
    return agent.ExecutionList.model_validate(answer.json()).executions


def job(self: AsyncSandbox, job_id: str) -> AsyncJob:
    """A handle on a job by id (from `start()` or `jobs()`)."""
    return AsyncJob(self, job_id)


def _idempotent(body: JSON | None) -> bool:
    return body is not None and "idempotencyKey" in body


TAIL_CHARACTERS = 4 << 20  # the agent's own capture bound, per stream


class _Tail:
    """The last TAIL_CHARACTERS of a streamed output, without rejoining it per chunk."""

    def __init__(self) -> None:
        self.parts: collections.deque[str] = collections.deque()
        self.size = 0
        self.total = 0

    def add(self, data: str) -> None:
        self.parts.append(data)
        self.size += len(data)
        self.total += len(data)
        while len(self.parts) > 1 and self.size - len(self.parts[0]) >= TAIL_CHARACTERS:
            self.size -= len(self.parts.popleft())

    def text(self) -> str:
        return "".join(self.parts)[-TAIL_CHARACTERS:]


def _with_output(event: OutputEvent, seen: dict[str, _Tail]) -> OutputEvent:
    result = event.result
    assert result is not None
    if result.stdout or result.stderr:
        return event
    out, err = seen["stdout"], seen["stderr"]
    full = replace(
        result,
        stdout=out.text(),
        stderr=err.text(),
        stdout_truncated=result.stdout_truncated or out.total > TAIL_CHARACTERS,
        stderr_truncated=result.stderr_truncated or err.total > TAIL_CHARACTERS,
    )
    return replace(event, result=full)


def _checked(result: CommandResult, check: bool) -> CommandResult:
    if result.timed_out or result.status == "timed_out":
        raise CommandTimeout(
            f"the command ran past its timeout ({result.execution.timeout_seconds}s) and was"
            " stopped",
            result=result,
            code="timed_out",
        )
    if result.lost:
        raise CommandLost.of(result)
    if check and not result.ok:
        raise CommandFailed(
            f"the command failed: status {result.status}, exit code {result.exit_code}:"
            f" {result.stderr[-500:]}",
            result=result,
            code="command_failed",
        )
    return result


class AsyncJob:
    """A background command: its output by cursor, stdin, wait, kill."""

    def __init__(self, sandbox: AsyncSandbox, job_id: str) -> None:
        self.sandbox = sandbox
        self.id = job_id

    def __repr__(self) -> str:
        return f"<Job {self.id} in {self.sandbox.name}>"

    async def info(self) -> agent.Execution:
        """The agent's record (status, exit code, output tails)."""
        answer = await self.sandbox._request("GET", f"executions/{self.id}")
        return agent.Execution.model_validate(answer.json())

    async def output(
        self, cursor: int = 0, *, wait: float = 0.0, max_bytes: int | None = None
    ) -> agent.OutputPage:
        """Output after `cursor` (pass `page.cursor` back for the next page);
        `wait` seconds (at most 60) long-polls for new output."""
        params = {"cursor": str(cursor), "waitSeconds": str(min(wait, 60.0))}
        if max_bytes:
            params["maxBytes"] = str(max_bytes)
        answer = await self.sandbox._request(
            "GET", f"executions/{self.id}/output", params=params, timeout=wait + 60
        )
        return agent.OutputPage.model_validate(answer.json())

    async def logs(self, cursor: int = 0) -> str:
        """All output so far from `cursor`, both streams in arrival order."""
        parts: list[str] = []
        while True:
            page = await self.output(cursor)
            parts.extend(c.data or "" for c in page.chunks)
            if not page.chunks or page.cursor == cursor:
                return "".join(parts)
            cursor = page.cursor

    async def stream(self, cursor: int = 0) -> AsyncIterator[OutputEvent]:
        """Reattach: output events from `cursor` until the job ends."""
        async for event in self.sandbox._events(
            "GET", f"executions/{self.id}/stream?cursor={cursor}", None, None
        ):
            yield event

    async def wait(self, timeout: float | None = None) -> CommandResult:
        """Until the job ends; its result. Timeout if it runs on past `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 30.0 if deadline is None else max(0.0, min(30.0, deadline - time.monotonic()))
            answer = await self.sandbox._request(
                "GET",
                f"executions/{self.id}",
                params={"output": "true", "waitSeconds": f"{left:.3f}"},
                timeout=left + 60,
            )
            execution = agent.Execution.model_validate(answer.json())
            if execution.status != "running":
                return CommandResult.of(execution)
            if deadline is not None and time.monotonic() >= deadline:
                raise Timeout(f"job {self.id} still running after {timeout}s")

    async def write(self, data: FileContent, *, close: bool = False) -> None:
        """Write to the job's stdin (started with `stdin_open=True`); `close` ends it."""
        body: JSON = {"close": close}
        if isinstance(data, bytes):
            body["dataBase64"] = base64.b64encode(data).decode()
        else:
            body["data"] = data
        await self.sandbox._request(
            "POST", f"executions/{self.id}/stdin", json_body=body, idempotent=False
        )

    async def kill(self, signal: str = "KILL", *, grace: float = 0.0) -> CommandResult:
        """Stop the job: KILL (after `grace` seconds of TERM when given) to its
        process group and whatever it started; another signal name is just sent."""
        if signal.upper().removeprefix("SIG") == "KILL":
            answer = await self.sandbox._request(
                "POST", f"executions/{self.id}/cancel", json_body={"graceSeconds": grace}
            )
        else:
            answer = await self.sandbox._request(
                "POST", f"executions/{self.id}/signal", json_body={"signal": signal}
            )
        return CommandResult.of(agent.Execution.model_validate(answer.json()))
