"""A handler still running while the operator stops (a timer that fires after the
cleanup closed the clients) is retried by the error policy, never logged as a bug."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import kopf
import pytest

from sandbox_operator import errors
from sandbox_operator.agent_client import AgentClient
from sandbox_operator.kube import Kube, ShuttingDown


def _after_close(call: Callable[[Kube, AgentClient], Awaitable[Any]]) -> BaseException:
    async def scenario() -> BaseException:
        kube, agents = Kube("https://127.0.0.1:9", False), AgentClient(timeout=1.0)
        # Used before the close (nothing listens there): its session exists.
        with contextlib.suppress(aiohttp.ClientError):
            await kube.get("/api")
        await kube.close()
        await agents.close()
        with pytest.raises(kopf.TemporaryError) as raised:
            async with errors.policy("Sandbox", "timer"):
                await call(kube, agents)
        return raised.value

    return asyncio.run(scenario())


@pytest.mark.parametrize(
    "call",
    [
        lambda kube, agents: kube.get("/api/v1/namespaces/default/secrets/x"),
        lambda kube, agents: kube.create("/api/v1/namespaces/default/secrets", {}),
        lambda kube, agents: agents.info("http://127.0.0.1:9", "token"),
    ],
    ids=["kube get", "kube create", "agent call"],
)
def test_calls_after_the_clients_closed_are_retried(
    call: Callable[[Kube, AgentClient], Awaitable[Any]],
) -> None:
    retried = _after_close(call)
    assert isinstance(retried.__cause__, ShuttingDown), repr(retried.__cause__)
    assert "shutting down" in str(retried)
