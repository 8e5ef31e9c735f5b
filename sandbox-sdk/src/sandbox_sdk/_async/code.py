"""Stateful code: run code in a sandbox's kernels (code contexts) and keep
what it defined for the next run."""

from __future__ import annotations

import builtins
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

from sandbox_sdk import _lazy
from sandbox_sdk._async.gateway import read_to_end
from sandbox_sdk.errors import NotFound, NotReady, ServerError
from sandbox_sdk.types import (
    CodeError,
    ErrorCallback,
    Execution,
    Logs,
    Result,
    ResultCallback,
    Sink,
    write_sink,
)

if TYPE_CHECKING:
    from sandbox_sdk._async.sandbox import AsyncSandbox
    from sandbox_sdk.models import agent
else:  # the generated models are built on first use: see sandbox_sdk._lazy
    agent = _lazy.module("sandbox_sdk.models.agent")

JSON = dict[str, Any]
# How long a run may take by default; the agent interrupts it past that.
DEFAULT_CODE_TIMEOUT = 300.0
ContextRef: TypeAlias = "str | agent.Context"


def _context_id(context: ContextRef) -> str:
    return context if isinstance(context, str) else context.id


class AsyncContexts:
    """Code contexts: each a kernel of its own, whose variables, imports and
    definitions stay between runs. `run_code` without a context uses the
    language's default context (`default-python`), started on first use."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self.sandbox = sandbox

    async def create(
        self, language: str = "python", *, cwd: str = ".", env: Mapping[str, str] | None = None
    ) -> agent.Context:
        """Start a context (its kernel is up when this returns)."""
        body = {"language": language, "cwd": cwd, "env": dict(env or {})}
        answer = await self.sandbox._request(
            "POST", "contexts", json_body=body, timeout=180, idempotent=False
        )
        return agent.Context.model_validate(answer.json())

    async def list(self) -> builtins.list[agent.Context]:
        answer = await self.sandbox._request("GET", "contexts")
        return agent.ContextList.model_validate(answer.json()).contexts

    async def get(self, context: ContextRef) -> agent.Context:
        answer = await self.sandbox._request("GET", f"contexts/{_context_id(context)}")
        return agent.Context.model_validate(answer.json())

    async def restart(self, context: ContextRef) -> agent.Context:
        """Start its kernel again: its state is gone."""
        answer = await self.sandbox._request(
            "POST", f"contexts/{_context_id(context)}/restart", timeout=180, idempotent=False
        )
        return agent.Context.model_validate(answer.json())

    async def interrupt(self, context: ContextRef) -> agent.Context:
        """Interrupt the run in progress (KeyboardInterrupt; the state stays)."""
        answer = await self.sandbox._request(
            "POST", f"contexts/{_context_id(context)}/interrupt", idempotent=False
        )
        return agent.Context.model_validate(answer.json())

    async def delete(self, context: ContextRef) -> None:
        await self.sandbox._request("DELETE", f"contexts/{_context_id(context)}")


async def run_code(
    self: AsyncSandbox,  # a method of AsyncSandbox (sandbox.py assigns it there)
    code: str,
    *,
    language: str = "python",
    context: ContextRef | None = None,
    on_stdout: Sink | None = None,
    on_stderr: Sink | None = None,
    on_result: ResultCallback | None = None,
    on_error: ErrorCallback | None = None,
    timeout: float = DEFAULT_CODE_TIMEOUT,
) -> Execution:
    """Run `code` in a kernel whose state stays for the next run (a Jupyter
    cell): variables, imports and definitions of earlier runs in the same
    `context` (default: the language's default context) are there.
    `language`: python (an IPython kernel), or javascript (Node.js, in an
    image that has `node`).

    Returns the results (the last expression's value, figures and tables
    the code displayed, each with all its MIME representations), what it
    printed, and the error it raised if any (an error is not raised here:
    the context stays usable). Past `timeout` seconds the run is
    interrupted (`status == "timed_out"`). The callbacks get each piece as
    it comes.
    """
    body: JSON = {"code": code, "language": language, "timeoutSeconds": timeout}
    if context is not None:
        body["contextId"] = _context_id(context)
    results: list[Result] = []
    logs = Logs()
    error: CodeError | None = None
    started: JSON = {}
    for attempt in range(3):
        try:
            async with self.client.gateway.stream(
                self.namespace,
                self.name,
                "POST",
                "code/run",
                json_body=body,
                read_timeout=timeout + 60,
            ) as response:
                lines = response.aiter_lines()
                async for line in lines:
                    if not line:
                        continue
                    event = json.loads(line)
                    kind = event.get("type")
                    if kind == "started":
                        started = event
                    elif kind in ("stdout", "stderr"):
                        text = str(event.get("text", ""))
                        (logs.stdout if kind == "stdout" else logs.stderr).append(text)
                        write_sink(on_stdout if kind == "stdout" else on_stderr, text)
                    elif kind == "result":
                        result = Result(
                            data=event.get("data") or {},
                            is_main=bool(event.get("isMain")),
                            execution_count=event.get("executionCount"),
                            metadata=event.get("metadata") or {},
                        )
                        results.append(result)
                        if on_result is not None:
                            on_result(result)
                    elif kind == "error":
                        error = CodeError(
                            str(event.get("name", "")),
                            str(event.get("value", "")),
                            [str(t) for t in event.get("traceback") or []],
                        )
                        if on_error is not None:
                            on_error(error)
                    elif kind == "finished":
                        await read_to_end(lines)
                        return Execution(
                            results=results,
                            logs=logs,
                            error=error,
                            status=str(event.get("status", "error")),
                            context_id=str(event.get("contextId") or started.get("contextId")),
                            execution_count=event.get("executionCount"),
                            duration_ms=event.get("durationMs"),
                            restarted=bool(event.get("restarted") or started.get("restarted")),
                            dropped_bytes=int(event.get("droppedBytes") or 0),
                            message=event.get("message"),
                        )
            # A stream without its end: the code may have run; never run it again.
            raise ServerError("the code run's stream ended before the run did", code="code_run_cut")
        except ServerError as exc:
            if not started or exc.code == "code_run_cut":
                raise
            # Cut after the run began: whether it ended, and how, is not known
            # here (the context's state may have changed); never run it again.
            raise ServerError(
                f"the code run's stream broke off after the run began: {exc}",
                code="code_run_cut",
            ) from exc
        except (NotReady, NotFound) as exc:
            # Refused before it started (the sandbox is starting): worth a retry.
            if started or attempt == 2 or not await self._worth_waiting(exc):
                raise
    raise AssertionError("unreachable")
