"""The SandboxPool loop under the one error policy: a refused pass is said in
the pool's status and tried again after the policy's delay, never the end of
the loop."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from sandbox_operator import errors
from sandbox_operator.agent_client import AgentClient
from sandbox_operator.config import Settings
from sandbox_operator.context import OperatorContext
from sandbox_operator.handlers import pool as pool_controller
from sandbox_operator.indexes import Indexes
from sandbox_operator.kube import KubeError, Refused
from sandbox_operator.resources import SANDBOX_POOLS, SANDBOX_TEMPLATES
from tests.unit.memorykube import MemoryKube

JSON = dict[str, Any]
POOL: JSON = {
    "metadata": {"name": "warm", "namespace": "ns", "uid": "pool-uid", "generation": 1},
    "spec": {"templateRef": {"name": "tools"}, "replicas": 2},
}
QUOTA = 'sandboxes "warm-" is forbidden: exceeded quota: q'


class RefusingKube(MemoryKube):
    """Every create is refused, as a full ResourceQuota refuses it."""

    async def create(self, path: str, body: JSON) -> JSON | None:
        self.calls.append(("POST", path))
        raise Refused(KubeError(403, "Forbidden", QUOTA), body["kind"], "warm-")


class Passes:
    """A daemon's `stopped` flag that says stop after `count` passes."""

    def __init__(self, count: int) -> None:
        self.left = count

    def __bool__(self) -> bool:
        self.left -= 1
        return self.left < 0


def test_a_refused_pass_is_said_and_retried_with_the_policys_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kube = RefusingKube()
    kube.put(SANDBOX_POOLS.path("ns", "warm"), POOL)
    kube.put(SANDBOX_TEMPLATES.path("ns", "tools"), {"metadata": {"name": "tools"}, "spec": {}})
    ctx = OperatorContext(settings=Settings(), kube=kube, agents=AgentClient(timeout=1))
    indexes = Indexes(sandboxes={}, links={}, pods={}, claims={}, quotas={}, pools={}, slots={})
    waited: list[float] = []

    async def sleep(seconds: float) -> None:
        waited.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    logger = logging.getLogger("test")
    asyncio.run(pool_controller.run(ctx, POOL, indexes, logger, Passes(4)))
    # Refusals back off as a handler's do (1 s doubling, up to the policy's bound).
    assert waited == [errors.refused_delay(retry) for retry in range(4)] == [1, 2, 4, 8]
    status = kube.objects[SANDBOX_POOLS.path("ns", "warm")]["status"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "CreateFailed")
    assert QUOTA in ready["message"]
