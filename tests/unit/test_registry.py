"""The test sessions' sweep of orphaned clusters (devcluster.registry)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from devcluster import registry, state


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def recorded(root: Path, name: str, owner: int) -> Path:
    directory = root / "clusters" / name
    directory.mkdir(parents=True)
    state.ClusterRecord(name=name, kind="control-plane", owner_pid=owner).write(directory)
    return directory


def test_a_cluster_named_for_a_live_session_stays_though_its_starter_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A session's CLI-started cluster: `pytest-<session pid>-cli`, owned by the
    # CLI process, which exited. Another session's sweep must leave it alone.
    monkeypatch.setenv("SANDBOX_CACHE_DIR", str(tmp_path))
    gone = dead_pid()
    kept = recorded(tmp_path, f"pytest-{os.getpid()}-cli", owner=gone)
    swept = recorded(tmp_path, f"pytest-{dead_pid()}-cli", owner=gone)
    unnamed = recorded(tmp_path, "pytest-storage-x", owner=gone)

    removed = registry.sweep_orphans("pytest-")

    assert kept.is_dir()
    assert not swept.exists()
    assert not unnamed.exists()
    assert sorted(removed) == sorted([swept.name, unnamed.name])
