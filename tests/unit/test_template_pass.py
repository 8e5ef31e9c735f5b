"""One pass of the SandboxTemplate controller against the in-memory API: the
status it ends with is written once, and a failed build is recorded before
its build Sandbox goes (a restart in between finds the failure, not a build
to start again)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
import pytest

from sandbox_operator.agent_client import AgentClient
from sandbox_operator.api.template import SandboxTemplateSpec
from sandbox_operator.builders.template import build_names, setup_hash, step_execution_name
from sandbox_operator.config import Settings
from sandbox_operator.context import OperatorContext
from sandbox_operator.handlers import template as templates
from sandbox_operator.resources import EXECUTIONS, SANDBOX_TEMPLATES, SANDBOXES
from tests.unit.memorykube import MemoryKube

JSON = dict[str, Any]
LOGGER = logging.getLogger("test")
PATH = SANDBOX_TEMPLATES.path("ns", "tools")


def template(spec: JSON) -> tuple[MemoryKube, OperatorContext, JSON]:
    kube = MemoryKube()
    body = kube.put(
        PATH, {"metadata": {"name": "tools", "namespace": "ns", "generation": 1}, "spec": spec}
    )
    ctx = OperatorContext(
        settings=Settings(), kube=kube, agents=AgentClient(timeout=1), post=lambda *_: None
    )
    return kube, ctx, body


def ready(kube: MemoryKube) -> JSON:
    conditions = kube.objects[PATH]["status"]["conditions"]
    found: JSON = next(c for c in conditions if c["type"] == "Ready")
    return found


def test_an_invalid_template_is_final_and_said_once() -> None:
    kube, ctx, body = template({"sandbox": {"runtime": "cobol"}})
    with pytest.raises(kopf.PermanentError) as ended:
        asyncio.run(templates.reconcile(ctx, body, LOGGER))
    assert ready(kube)["reason"] == "InvalidSpec"
    assert ready(kube)["message"] == str(ended.value)
    assert kube.writes() == [("PATCH", f"{PATH}/status")]


def test_a_template_without_setup_is_ready_at_once() -> None:
    kube, ctx, body = template({"sandbox": {"runtime": "python"}})
    asyncio.run(templates.reconcile(ctx, body, LOGGER))
    assert (ready(kube)["status"], ready(kube)["reason"]) == ("True", "NoSetup")
    assert kube.writes() == [("PATCH", f"{PATH}/status")]


def test_a_failed_step_is_recorded_before_the_build_sandbox_goes() -> None:
    spec = {"sandbox": {"runtime": "python"}, "setup": [{"name": "deps", "script": "false"}]}
    kube, ctx, body = template(spec)
    digest = setup_hash(SandboxTemplateSpec.model_validate(spec))
    assert digest is not None
    build = build_names("tools", digest)["sandbox"]
    ok = {"type": "Ready", "status": "True", "reason": "SandboxReady", "message": ""}
    kube.put(
        SANDBOXES.path("ns", build),
        {"metadata": {"name": build}, "status": {"phase": "Running", "conditions": [ok]}},
    )
    step = step_execution_name(build, 0)
    kube.put(
        EXECUTIONS.path("ns", step),
        {"metadata": {"name": step}, "status": {"phase": "Failed", "exitCode": 1}},
    )
    with pytest.raises(kopf.PermanentError) as ended:
        asyncio.run(templates.reconcile(ctx, body, LOGGER))
    assert ready(kube)["reason"] == "SetupFailed"
    assert "exit code 1" in str(ended.value)
    assert kube.writes() == [
        ("PATCH", f"{PATH}/status"),
        ("DELETE", SANDBOXES.path("ns", build)),
    ]
