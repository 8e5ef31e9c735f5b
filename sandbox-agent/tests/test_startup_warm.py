"""What the agent pays at start so that a sandbox's first call does not."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# In a fresh interpreter: the app's start, then whether anyio's asyncio backend
# (imported on a task group's first use, which a streamed answer is) is loaded.
PROBE = textwrap.dedent(
    """
    import asyncio, os, sys
    from sandbox_agent.app import build_app
    from sandbox_agent.config import load

    app = build_app(load(), b"t" * 32)

    async def main():
        inbox, outbox = asyncio.Queue(), asyncio.Queue()
        await inbox.put({"type": "lifespan.startup"})
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.3"}}
        task = asyncio.create_task(app(scope, inbox.get, outbox.put))
        started = await outbox.get()
        assert started["type"] == "lifespan.startup.complete", started
        print("anyio._backends._asyncio" in sys.modules, flush=True)
        # Nothing to stop cleanly: no runner ever connects to this agent.
        os._exit(0)

    asyncio.run(main())
    """
)


def test_the_first_streamed_answer_finds_anyios_backend_loaded(tmp_path: Path) -> None:
    for name in ("workspace", "run", "logs"):
        (tmp_path / name).mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(SRC),
        "SANDBOX_AGENT_WORKSPACE": str(tmp_path / "workspace"),
        "SANDBOX_AGENT_RUNTIME_DIR": str(tmp_path / "run"),
        "SANDBOX_AGENT_LOG_DIR": str(tmp_path / "logs"),
    }
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True", done.stdout
