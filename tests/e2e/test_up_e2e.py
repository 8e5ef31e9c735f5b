"""`make up` (hack/up.py) on the session's cluster: progress lines for every
step with the time since the start, then commands to try that work.

The session's cluster is already running with the chart, so this drives the
path of a repeated `make up` (builds and images are cache hits, the cluster
is reused, the chart upgraded in place, examples applied and waited for, a
command through the gateway), not a cold start; the cold builds print through
the same lines (devcluster's build and image loggers)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from devcluster import deploy
from tests.e2e.conftest import E2E

pytestmark = pytest.mark.timeout(1800)

LINE = re.compile(r"^\[ ?\d+:\d\d\] ")


def _run_up(repo: Path, name: str) -> str:
    done = subprocess.run(
        [sys.executable, str(repo / "hack" / "up.py"), "up", "--name", name],
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
        cwd=repo,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


def test_up_reports_each_step_and_ends_with_commands_that_work(e2e: E2E, repo: Path) -> None:
    try:
        out = _run_up(repo, e2e.cluster.name)
        lines = out.splitlines()
        for step in range(1, 8):
            mine = [line for line in lines if f"] [{step}/7] " in line]
            assert mine, f"no line of step {step}/7 in:\n{out}"
            assert all(LINE.match(line) for line in mine), mine
            # A start line, and an end line with the step's duration.
            assert mine[0].endswith(" ..."), mine
            assert re.search(r": .+ \(\d+:\d\d\)$", mine[-1]), mine
        images = [line for line in lines if re.search(r"\[3/7\] image \d+/\d+ \S+: ", line)]
        assert images, out
        assert any("already running at https://" in line for line in lines), out
        assert any("sandbox/py-demo Ready" in line for line in lines), out

        tail = lines[next(i for i, line in enumerate(lines) if "Try next" in line) :]
        export = next(line.strip() for line in tail if line.strip().startswith("export "))
        assert f"KUBECONFIG={e2e.cluster.kubeconfig}" in export
        commands = [line.strip()[2:].split("    # ")[0] for line in tail if line.startswith("  $ ")]
        assert any(c.startswith("kubectl get ") for c in commands), commands
        assert any(c.startswith("kubectl sandbox exec ") for c in commands), commands
        assert any(c.startswith("python ") for c in commands), commands
        for command in commands:
            ran = subprocess.run(
                ["bash", "-c", f"{export}; {command}"],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
                cwd=repo,
            )
            assert ran.returncode == 0, f"{command}:\n{ran.stdout}\n{ran.stderr}"
            if "untrusted-demo" in command:  # the gVisor example
                assert "Starting gVisor" in ran.stdout, ran.stdout
            elif command.startswith(("kubectl sandbox exec ", "kubectl sandbox shell ")):
                assert ran.stdout.strip() == "42", ran.stdout
    finally:
        # The examples ran in `default`: the node holds only a few sandboxes at a time.
        deploy.kubectl(e2e.cluster, "delete", "-n", "default", "-f", str(repo / "examples"))
