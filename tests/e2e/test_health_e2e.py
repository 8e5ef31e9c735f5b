"""Argo CD health and kstatus on real objects: Sandboxes, Executions and
Snapshots driven through their phases on the node, each captured object
evaluated by the chart's health script in gopher-lua (devcluster/luahealth).

SANDBOX_HEALTH_CAPTURE=1 also writes the captured objects to
tests/fixtures/health/, which the unit test replays."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from devcluster import luahealth
from tests import health
from tests.e2e.conftest import E2E
from tests.executions import Executions
from tests.integration.harness import wait_for
from tests.kube import JSON, ApiError
from tests.resources import Resources
from tests.sandboxes import Sandboxes
from tests.snapshots import Snapshots

pytestmark = pytest.mark.timeout(1800)

HOLD = "e2e.sandbox.dev/hold"
JSON_PATCH = "application/json-patch+json"


def _ready(status: JSON) -> JSON:
    return next(c for c in status.get("conditions", []) if c["type"] == "Ready")


def _observed(status: JSON) -> bool:
    """The operator has written a status for the current spec."""
    return bool(status.get("conditions")) and status.get("observedGeneration") is not None


def _release(e2e: E2E, path: str) -> None:
    """Remove our finalizer alone: the operator removes its own meanwhile, so
    the list is edited by index under a test of the value (JSON patch)."""

    def released() -> bool:
        finalizers = (e2e.kube.get(path) or {}).get("metadata", {}).get("finalizers") or []
        if HOLD not in finalizers:
            return True
        at = f"/metadata/finalizers/{finalizers.index(HOLD)}"
        try:
            e2e.kube.patch(
                path,
                [{"op": "test", "path": at, "value": HOLD}, {"op": "remove", "path": at}],
                JSON_PATCH,
            )
        except ApiError:
            return False  # the list changed under us: read it again
        return True

    wait_for(released, 30, f"finalizer {HOLD} removed from {path}")


def _phase_is(phase: str) -> Callable[[JSON], bool]:
    return lambda status: status.get("phase") == phase


class Capture:
    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    def __call__(
        self,
        case: str,
        resources: Resources,
        name: str,
        what: str,
        test: Callable[[JSON], bool],
        timeout: float = 120,
    ) -> JSON:
        """Wait for `test(status)`, then judge the object as Argo CD would."""
        body = resources.wait_object(name, what, lambda s: _observed(s) and test(s), timeout)
        if os.environ.get("SANDBOX_HEALTH_CAPTURE"):
            health.save(case, body)
        [result] = luahealth.evaluate([health.trimmed(body)])
        self.seen[case] = result.status
        assert (result.status, case) == (health.EXPECTED[case], case), (result, body["status"])
        assert result.message
        return body


def test_health_of_every_phase(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes, executions, snapshots = (
        Sandboxes(e2e.kube, ns),
        Executions(e2e.kube, ns),
        Snapshots(e2e.kube, ns),
    )
    capture = Capture()

    sandboxes.create("box", {"runtime": "python"})
    capture(
        "sandbox-starting",
        sandboxes,
        "box",
        "starting",
        lambda s: s.get("phase") in ("Pending", "Starting"),
    )
    # A resource profile the operator does not offer: admitted (the chart's
    # admission policy checks runtimes and ports), then InvalidSpec.
    sandboxes.create("bad", {"resources": {"profile": "no-such-profile"}})
    capture(
        "sandbox-invalid-spec",
        sandboxes,
        "bad",
        "invalid",
        lambda s: _ready(s)["reason"] == "InvalidSpec",
    )
    sandboxes.create(
        "nopy", {"image": "sandbox-runtime-nopython:dev", "workspace": {"ephemeral": True}}
    )
    capture(
        "sandbox-no-python",
        sandboxes,
        "nopy",
        "no python3",
        lambda s: _ready(s)["reason"] == "RuntimeMissingPython",
        timeout=240,
    )
    snapshots.create("of-nopy", "nopy")
    capture("snapshot-failed", snapshots, "of-nopy", "failed", lambda s: s.get("phase") == "Failed")
    snapshots.create("early", "not-yet")
    capture(
        "snapshot-waiting",
        snapshots,
        "early",
        "waiting for its sandbox",
        lambda s: _ready(s)["reason"] == "SandboxNotFound",
    )

    # Deleted while a finalizer of someone else's holds it: what Argo CD sees
    # while the operator's teardown runs.
    held = [*sandboxes.read("bad")["metadata"].get("finalizers", []), HOLD]
    sandboxes.patch("bad", {"metadata": {"finalizers": held}})
    sandboxes.delete("bad")
    capture(
        "sandbox-terminating",
        sandboxes,
        "bad",
        "deleting",
        lambda s: True,
    )
    assert sandboxes.read("bad")["metadata"].get("deletionTimestamp")
    _release(e2e, sandboxes.path("bad"))

    sandboxes.wait_ready("box")
    capture("sandbox-running", sandboxes, "box", "Ready", lambda s: _ready(s)["status"] == "True")
    executions.run("slow", "box", "sleep 120")
    capture(
        "execution-running", executions, "slow", "running", lambda s: s.get("phase") == "Running"
    )
    executions.patch("slow", {"spec": {"cancel": True}})
    executions.run("ok", "box", "echo fine")
    executions.run("fails", "box", "exit 3")
    executions.run("too-slow", "box", "sleep 60", timeout="1s")
    for case, name, phase in (
        ("execution-cancelled", "slow", "Cancelled"),
        ("execution-succeeded", "ok", "Succeeded"),
        ("execution-failed", "fails", "Failed"),
        ("execution-timed-out", "too-slow", "TimedOut"),
    ):
        capture(case, executions, name, phase, _phase_is(phase))
    # `kubectl wait --for=condition=Ready` agrees with Argo CD on an Execution.
    waited = e2e.kubectl("wait", "-n", ns, "--for=condition=Ready", "execution/ok", "--timeout=30s")
    assert waited.returncode == 0, waited.stderr

    snapshots.create("snap", "box")
    capture("snapshot-ready", snapshots, "snap", "Ready", lambda s: s.get("phase") == "Ready", 240)
    sandboxes.patch("box", {"spec": {"paused": True}})
    capture(
        "sandbox-paused",
        sandboxes,
        "box",
        "paused",
        lambda s: _ready(s)["reason"] == "Paused",
    )
    assert capture.seen == health.EXPECTED
