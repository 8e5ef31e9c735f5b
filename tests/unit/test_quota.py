"""Quota arithmetic: what a Sandbox holds and which limit a request exceeds."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from sandbox_operator.api.quota import SandboxQuotaSpec
from sandbox_operator.api.sandbox import SandboxSpec
from sandbox_operator.builders import quota
from sandbox_operator.config import Settings

SETTINGS = Settings()


def _sandbox(spec: dict[str, Any], admitted: bool | None = True) -> dict[str, Any]:
    status = {} if admitted is None else {"admitted": admitted}
    return {"metadata": {"name": "s", "namespace": "ns"}, "spec": spec, "status": status}


def test_a_sandbox_holds_its_pods_requests_and_limits_and_its_workspace() -> None:
    spec = SandboxSpec.model_validate({"resources": {"cpu": "2", "memory": "1Gi"}})
    held = quota.sandbox_usage(spec, SETTINGS)
    # The runtime container plus the agent, as the scheduler counts them.
    assert held.requests_cpu == Decimal("0.1") + Decimal("0.05")
    assert held.limits_cpu == Decimal(2) + Decimal(1)
    assert held.requests_memory == held.limits_memory == Decimal(2**30 + 256 * 2**20)
    assert held.workspace_storage == Decimal(2**30)
    ephemeral = SandboxSpec.model_validate({"workspace": {"ephemeral": True, "size": "5Gi"}})
    assert quota.sandbox_usage(ephemeral, SETTINGS).workspace_storage == 0


def test_only_admitted_sandboxes_count() -> None:
    bodies = [_sandbox({}), _sandbox({}, admitted=None), _sandbox({"workspace": {"size": "3Gi"}})]
    used = quota.namespace_usage(bodies, SETTINGS, running_executions=4)
    assert (used.sandboxes, used.running_executions) == (2, 4)
    assert used.workspace_storage == Decimal(4 * 2**30)


def test_the_refusal_names_the_quota_the_limit_the_usage_and_the_request() -> None:
    limits = {
        "b-storage": SandboxQuotaSpec.model_validate({"workspaceStorage": "10Gi"}),
        "a-cpu": SandboxQuotaSpec.model_validate({"requests": {"cpu": "1"}}),
    }
    used = quota.Usage(requests_cpu=Decimal("0.9"), workspace_storage=Decimal(9 * 2**30))
    ask = quota.Usage(sandboxes=1, requests_cpu=Decimal("0.15"), workspace_storage=Decimal(2**30))
    assert quota.refusal(limits, used, ask) == (
        "exceeded SandboxQuota a-cpu: requests.cpu limited to 1, used 900m, requested 150m"
    )
    assert quota.refusal(limits, quota.Usage(workspace_storage=Decimal(9 * 2**30)), ask) is None
    over_storage = quota.Usage(workspace_storage=Decimal(9 * 2**30 + 1))
    assert "workspaceStorage limited to 10Gi" in (quota.refusal(limits, over_storage, ask) or "")


def test_a_zero_limit_refuses_everything_and_an_unset_one_nothing() -> None:
    none = {"q": SandboxQuotaSpec.model_validate({"sandboxes": 0})}
    assert quota.refusal(none, quota.Usage(), quota.Usage(sandboxes=1)) is not None
    assert quota.refusal(none, quota.Usage(), quota.Usage(running_executions=1)) is None


def test_running_executions_count_the_index_and_this_processs_claims() -> None:
    def entry(name: str, started: bool, done: bool = False) -> dict[str, Any]:
        return {"name": name, "started": started, "done": done, "quota": False}

    slots = {
        ("ns", "a"): [entry("1", True), entry("2", True, done=True), entry("3", False)],
        ("ns", "b"): [entry("4", True)],
        ("other", "c"): [entry("5", True)],
    }
    claimed = {("ns", "a"): {"1", "3"}, ("ns", "d"): {"6"}}
    assert quota.running_executions(slots, claimed, "ns") == 4  # 1, 3, 4, 6


def test_quantities_read_as_people_write_them() -> None:
    assert quota.format_quantity(Decimal("1.5")) == "1500m"
    assert quota.format_quantity(Decimal(3)) == "3"
    assert quota.format_quantity(Decimal(3 * 2**30), binary=True) == "3Gi"
    assert quota.format_quantity(Decimal(1000), binary=True) == "1000"
    assert quota.format_quantity(Decimal(0), binary=True) == "0"
