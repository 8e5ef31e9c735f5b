"""Tenant limits on a real node: a SandboxQuota and a Kubernetes ResourceQuota
each hold a Sandbox back (QuotaExceeded, no pod) until there is room, and the
Sandbox then becomes Ready by itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import E2E
from tests.kube import core_path
from tests.quotas import SandboxQuotas, quota_exceeded, ready_reason, resource_quota
from tests.sandboxes import Sandboxes

pytestmark = pytest.mark.timeout(1800)
BIN = Path(sys.executable).parent  # the venv's, where `kubectl-sandbox` lives


def test_a_sandbox_quota_holds_a_sandbox_back_until_one_is_deleted(e2e: E2E, repo: Path) -> None:
    ns = e2e.namespace()
    applied = e2e.kubectl("apply", "-n", ns, "-f", str(repo / "examples" / "tenancy"))
    assert applied.returncode == 0, applied.stderr
    quotas = SandboxQuotas(e2e.kube, ns)
    sandboxes = Sandboxes(e2e.kube, ns)
    quotas.create("one-at-a-time", {"sandboxes": 1})
    sandboxes.create("first", {"runtime": "python"})
    sandboxes.wait_ready("first")
    sandboxes.create("second", {"runtime": "python"})
    status = sandboxes.wait_object("second", "QuotaExceeded", quota_exceeded)["status"]
    assert ready_reason(status)[1] == (
        "exceeded SandboxQuota one-at-a-time: sandboxes limited to 1, used 1, requested 1"
    )
    assert e2e.kube.get(core_path("pods", ns, "second")) is None
    # The example's usage counts the admitted one, through `kubectl get`.
    used = quotas.wait_used("tenant-limits", "the first sandbox", "sandboxes", 1, timeout=120)
    assert used["used"]["requests"]["cpu"] == "150m"
    # Each quota refreshes at its own interval: wait for this one's too.
    quotas.wait_used("one-at-a-time", "the first sandbox", "sandboxes", 1, timeout=120)
    listed = e2e.kubectl("get", "sandboxquota", "-n", ns, "one-at-a-time")
    assert listed.returncode == 0, listed.stderr
    # NAME, SANDBOXES (used), MAX SANDBOXES
    assert listed.stdout.splitlines()[1].split()[:3] == ["one-at-a-time", "1", "1"]

    # `kubectl sandbox create` says why it waits, once, and gives up at its timeout.
    done = subprocess.run(
        [str(BIN / "kubectl-sandbox"), "-n", ns, "create", "third", "--timeout", "6"],
        env={**os.environ, "KUBECONFIG": str(e2e.cluster.kubeconfig)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    waiting = "waiting: QuotaExceeded: exceeded SandboxQuota one-at-a-time: sandboxes limited to 1"
    assert done.stderr.count(waiting) == 1, done.stderr
    assert "error: sandbox third not ready in 6s (QuotaExceeded)" in done.stderr, done.stderr
    sandboxes.delete("third")  # the place that frees goes to "second"

    sandboxes.delete("first")
    sandboxes.wait_ready("second")


def test_a_resource_quota_refusal_shows_in_status_and_the_pod_follows_when_raised(
    e2e: E2E,
) -> None:
    ns = e2e.namespace()
    quota_path = resource_quota(e2e.kube, ns, "cpu", {"requests.cpu": "100m"})
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("held", {"runtime": "python"})
    status = sandboxes.wait_object("held", "QuotaExceeded", quota_exceeded, timeout=60)["status"]
    message = ready_reason(status)[1]
    assert "exceeded quota: cpu" in message
    assert "requested: requests.cpu=150m" in message
    assert e2e.kube.get(core_path("pods", ns, "held")) is None
    described = e2e.kubectl("describe", "sandbox", "-n", ns, "held")
    assert "QuotaExceeded" in described.stdout
    e2e.kube.patch(quota_path, {"spec": {"hard": {"requests.cpu": "1"}}})
    sandboxes.wait_ready("held")
