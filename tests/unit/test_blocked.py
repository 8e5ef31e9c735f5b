"""A Sandbox pass that cannot go on: what its status says, how often it is
written, and the Kopf error the pass ends with (the delay of its next try).

Through `reconcile` itself, against the in-memory API: each way a pass stops
short before any child is made.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

import kopf
import pytest

from sandbox_operator.agent_client import AgentClient
from sandbox_operator.api.quota import SandboxQuotaSpec
from sandbox_operator.config import Settings
from sandbox_operator.context import OperatorContext
from sandbox_operator.handlers.sandbox import Children, reconcile
from sandbox_operator.indexes import Indexes
from sandbox_operator.resources import SANDBOXES, SECRETS
from tests.unit.memorykube import MemoryKube

JSON = dict[str, Any]
T = TypeVar("T")
SETTINGS = Settings()
LOGGER = logging.getLogger("test")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


class Pass:
    """One Sandbox, the in-memory API holding it, and the Events posted."""

    def __init__(self, spec: JSON, status: JSON | None = None) -> None:
        self.kube = MemoryKube()
        self.events: list[tuple[str, str]] = []
        self.body: JSON = {
            "metadata": {
                "name": "box",
                "namespace": "ns",
                "uid": "box-uid",
                "generation": 1,
                "creationTimestamp": "2026-01-01T00:00:00Z",
            },
            "spec": spec,
            "status": status or {},
        }
        self.kube.put(SANDBOXES.path("ns", "box"), self.body)
        self.quotas: dict[str, list[JSON]] = {}
        self.pools: dict[tuple[str, str], list[JSON]] = {}

        def post(body: JSON, kind: str, reason: str, message: str) -> None:
            self.events.append((reason, message))

        self.ctx = OperatorContext(
            settings=SETTINGS, kube=self.kube, agents=AgentClient(timeout=1), post=post
        )

    def reconcile(self) -> JSON | None:
        indexes = Indexes(
            sandboxes={("ns", "box"): [self.body]},
            links={},
            pods={},
            claims={},
            quotas=self.quotas,
            pools=self.pools,
            slots={},
        )
        return run(
            reconcile(self.ctx, self.body, LOGGER, children=Children.CREATE, indexes=indexes)
        )

    def ready(self) -> JSON:
        status = self.kube.objects[SANDBOXES.path("ns", "box")]["status"]
        ready: JSON = next(c for c in status["conditions"] if c["type"] == "Ready")
        return ready

    def status_writes(self) -> int:
        return self.kube.writes().count(("PATCH", SANDBOXES.path("ns", "box", "status")))

    def children_made(self) -> list[tuple[str, str]]:
        return [call for call in self.kube.writes() if call[0] == "POST"]


def test_an_invalid_spec_is_final_and_said_once() -> None:
    sandbox = Pass({"runtime": "cobol"})
    with pytest.raises(kopf.PermanentError) as ended:
        sandbox.reconcile()
    ready = sandbox.ready()
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert ready["message"] == str(ended.value)
    assert "cobol" in ready["message"]
    assert sandbox.status_writes() == 1
    assert sandbox.children_made() == []
    assert [reason for reason, _ in sandbox.events] == ["InvalidSpec"]


def test_a_missing_pool_is_waited_for() -> None:
    sandbox = Pass({"runtime": "python", "poolRef": {"name": "warm"}})
    with pytest.raises(kopf.TemporaryError) as ended:
        sandbox.reconcile()
    assert ended.value.delay == 1.0
    ready = sandbox.ready()
    assert (ready["reason"], ready["message"]) == (
        "PoolNotFound",
        "SandboxPool warm does not exist in namespace ns",
    )
    assert str(ended.value) == ready["message"]
    assert sandbox.status_writes() == 1
    assert sandbox.children_made() == []
    # Said once: the next look that finds the same is not a new Event.
    with pytest.raises(kopf.TemporaryError):
        sandbox.reconcile()
    assert [reason for reason, _ in sandbox.events] == ["PoolNotFound"]


def test_a_missing_template_is_waited_for() -> None:
    sandbox = Pass({"templateRef": {"name": "tools"}})
    with pytest.raises(kopf.TemporaryError) as ended:
        sandbox.reconcile()
    assert ended.value.delay == 3.0
    ready = sandbox.ready()
    assert ready["reason"] == "TemplateNotFound"
    assert "tools" in ready["message"]
    assert str(ended.value) == ready["message"]
    assert sandbox.status_writes() == 1
    assert sandbox.children_made() == []


def test_a_full_quota_holds_a_new_sandbox_back() -> None:
    sandbox = Pass({"runtime": "python"})
    sandbox.quotas = {"ns": [{"name": "q", "spec": SandboxQuotaSpec(sandboxes=0)}]}
    with pytest.raises(kopf.TemporaryError) as ended:
        sandbox.reconcile()
    assert ended.value.delay == SETTINGS.quota_retry_seconds
    assert str(ended.value) == "waiting for room in the SandboxQuotas of ns"
    ready = sandbox.ready()
    assert ready["reason"] == "QuotaExceeded"
    assert "q" in ready["message"]
    assert sandbox.status_writes() == 1
    assert sandbox.children_made() == []
    assert not sandbox.kube.objects[SANDBOXES.path("ns", "box")]["status"].get("admitted")


def test_a_lost_pool_member_is_said_and_not_retried() -> None:
    pool = {
        "name": "warm",
        "outcome": "Claimed",
        "templateRef": {"name": "tools"},
        "member": "warm-x",
        "memberUid": "gone-uid",
    }
    sandbox = Pass({"runtime": "python", "poolRef": {"name": "warm"}}, {"pool": pool})
    assert sandbox.reconcile() is None
    ready = sandbox.ready()
    assert ready["reason"] == "PoolMemberLost"
    assert "warm-x" in ready["message"]
    assert sandbox.status_writes() == 1
    assert sandbox.children_made() == []


def test_an_empty_pool_with_whenempty_wait_is_waited_for() -> None:
    sandbox = Pass({"runtime": "python", "poolRef": {"name": "warm"}})
    pool = {
        "metadata": {"name": "warm", "namespace": "ns", "uid": "pool-uid"},
        "spec": {"templateRef": {"name": "tools"}, "replicas": 1, "whenEmpty": "Wait"},
    }
    sandbox.pools = {("ns", "warm"): [pool]}
    with pytest.raises(kopf.TemporaryError) as ended:
        sandbox.reconcile()
    assert ended.value.delay == 1.0
    ready = sandbox.ready()
    assert ready["reason"] == "PoolEmpty"
    assert str(ended.value) == ready["message"]
    status = sandbox.kube.objects[SANDBOXES.path("ns", "box")]["status"]
    assert status["pool"]["outcome"] == "Waiting"
    assert sandbox.status_writes() == 1
    assert sandbox.children_made() == []


def test_a_name_held_by_an_earlier_namesake_is_waited_for() -> None:
    sandbox = Pass({"runtime": "python"})
    earlier = {"kind": "Sandbox", "name": "box", "uid": "earlier-uid", "controller": True}
    sandbox.kube.put(
        SECRETS.path("ns", "box-agent-token"),
        {"metadata": {"name": "box-agent-token", "ownerReferences": [earlier]}},
    )
    with pytest.raises(kopf.TemporaryError) as ended:
        sandbox.reconcile()
    assert ended.value.delay == 2.0
    ready = sandbox.ready()
    assert ready["reason"] == "PredecessorDeleting"
    assert str(ended.value) == ready["message"]
    assert "earlier Sandbox named box" in ready["message"]
    assert sandbox.status_writes() == 1
    assert [reason for reason, _ in sandbox.events] == ["PredecessorDeleting"]
