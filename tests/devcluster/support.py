"""What the devcluster tests share: waiting, the CLI, kubectl, processes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from devcluster import processes
from devcluster.controlplane import ControlPlane

REPO = Path(__file__).resolve().parents[2]
# Controllers and the kubelet react within seconds here; the bound only keeps
# something broken from hanging the suite.
WAIT = 120.0


def wait_for(condition: Callable[[], bool], what: str, timeout: float = WAIT) -> float:
    """Poll until `condition()` is true; return the seconds it took."""
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - began


def devcluster_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m devcluster ARGS` as a user runs it: its own process, from the repo."""
    return subprocess.run(
        [sys.executable, "-m", "devcluster", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def kubectl(
    cluster: ControlPlane, *args: str, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """The cluster's own kubectl as admin; `check` raises on a non-zero exit."""
    return subprocess.run(
        cluster.kubectl_command(*args), capture_output=True, text=True, timeout=60, check=check
    )


def processes_using(state_dir: Path) -> list[int]:
    """PIDs of live processes with the state dir on their command line."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or processes.is_zombie(int(entry.name)):
            continue
        with contextlib.suppress(OSError):
            if str(state_dir).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found
