"""What the operator's context keeps of a Sandbox's status between its write
and the event that shows it (sandbox_operator/context.py)."""

from __future__ import annotations

from typing import Any

from sandbox_operator.agent_client import AgentClient
from sandbox_operator.config import Settings
from sandbox_operator.context import OperatorContext
from sandbox_operator.kube import Kube

JSON = dict[str, Any]


def body(status: JSON | None) -> JSON:
    meta = {"name": "box", "namespace": "ns", "uid": "u-1"}
    return {"metadata": meta, "status": status} if status is not None else {"metadata": meta}


def context() -> OperatorContext:
    kube = Kube("https://127.0.0.1:1", verify=False)  # never called here
    return OperatorContext(settings=Settings(), kube=kube, agents=AgentClient(timeout=1))


def test_the_written_status_is_kept_until_an_event_shows_it() -> None:
    ctx = context()
    written = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    ctx.statuses[("ns", "box")] = written
    older = {"phase": "Pending"}
    # An event from before the write: the kept status is the current one.
    ctx.status_seen("ns", "box", older)
    assert ctx.current(body(older))["status"] == written
    ctx.status_seen("ns", "box", None)
    assert ("ns", "box") in ctx.statuses
    # The event of the write: the body has it, the copy goes.
    ctx.status_seen("ns", "box", {**written, "conditions": [{"type": "Ready", "status": "True"}]})
    assert ("ns", "box") not in ctx.statuses
    assert ctx.current(body(written))["status"] == written
    ctx.status_seen("ns", "box", written)  # again: nothing kept, nothing to do
