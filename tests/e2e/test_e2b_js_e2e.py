"""E2B's JavaScript SDKs (`e2b` and `@e2b/code-interpreter`, pinned in
e2b_js/package.json and its lock) run the founding flow through the E2B
adapter with node: create, `runCode` keeping a variable and returning a chart
as PNG, an exception as the execution's error, `commands.run` with streaming
callbacks, `files.write`/`read`, `kill`, `isRunning()` false after it.

The fixture `e2b_env` (from conftest.py) is the environment a user sets:
`E2B_API_URL`, `E2B_SANDBOX_URL`, `E2B_API_KEY`, and `E2B_TEMPLATE` (the
template to create from; default code-interpreter-v1: Python with a Jupyter
kernel, matplotlib, and `/home/user`).

The packages are installed once per package.json and lock (`npm ci`, no
install scripts) under the build cache (npm-e2b/<hash>), outside the
repository; the flow runs with node from there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from devcluster import build

pytestmark = pytest.mark.timeout(900)

PACKAGE = Path(__file__).resolve().parent / "e2b_js"
CACHE = build.cache_root() / "npm-e2b"
MANIFESTS = ("package.json", "package-lock.json")


def _node() -> str:
    node = shutil.which("node")
    assert node, "node (>= 20.18.1) is needed for E2B's JavaScript SDKs"
    return node


def installed() -> Path:
    """The directory where the pinned packages are installed (made on first use)."""
    digest = hashlib.sha256()
    for name in MANIFESTS:
        digest.update((PACKAGE / name).read_bytes())
    target = CACHE / digest.hexdigest()[:16]
    if (target / "node_modules" / ".complete").exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    staging = CACHE / f"{target.name}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for name in MANIFESTS:
        shutil.copyfile(PACKAGE / name, staging / name)
    npm = shutil.which("npm")
    assert npm, "npm is needed to install E2B's JavaScript SDKs"
    done = subprocess.run(
        [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund"],
        cwd=staging,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"npm ci failed:\n{done.stdout}\n{done.stderr}"
    (staging / "node_modules" / ".complete").touch()
    try:
        staging.rename(target)
    except OSError:  # another run installed it first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def run_flows(env: dict[str, str]) -> dict[str, Any]:
    """flows.mjs's findings (its last line of output)."""
    where = installed()
    script = where / "flows.mjs"
    staged = where / f"flows.mjs.{os.getpid()}"
    shutil.copyfile(PACKAGE / "flows.mjs", staged)
    staged.replace(script)  # the current script, next to its node_modules
    done = subprocess.run(
        [_node(), str(script)],
        cwd=where,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"flows.mjs failed:\n{done.stdout}\n{done.stderr}"
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def test_the_founding_flow_with_e2bs_javascript_sdks(e2b_env: dict[str, str]) -> None:
    seen = run_flows(e2b_env)
    assert seen["created"]["sandboxId"]

    code = seen["runCode"]
    assert code["first"] == {"results": 0, "error": None}
    assert code["second"]["text"] == "2"
    first_count, second_count = code["executionCounts"]
    assert second_count == first_count + 1

    chart = seen["chart"]
    assert chart["error"] is None
    (figure,) = chart["results"]
    assert figure["pngHead"] == "89504e470d0a1a0a"  # PNG's signature
    assert "png" in figure["formats"]
    assert not figure["isMainResult"]
    assert chart["streamed"] == [figure["formats"]]

    assert seen["error"] == {"name": "ZeroDivisionError", "value": "division by zero"}

    command = seen["command"]
    assert command["exitCode"] == 0
    assert command["stdout"] == "hello\ndone\n"
    assert command["stderr"] == "oops\n"
    assert command["streamedStdout"] == command["stdout"]
    assert command["streamedStderr"] == command["stderr"]

    assert seen["files"] == {"read": "written by flows.mjs\n", "fromCode": "written by flows.mjs\n"}

    assert seen["killed"] is True
    assert seen["runningAfterKill"] is False
