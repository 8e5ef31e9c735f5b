"""Per chat turn: warm a sandbox when the turn starts, reuse it for every tool
call of the turn, reach it by name from another process, dispose of it right
before the chat run suspends to wait for the next message.

    python examples/sdk/chat_turns.py

Written against AsyncSandboxClient, as chat backends are async. Warming is a
task started at turn start: the turn does not wait for it, and the first tool
call waits only for what is left of the sandbox's start. The tool worker of
another process (`--worker NAME`) connects by name with the sync client.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid

from sandbox_sdk import AsyncSandbox, AsyncSandboxClient, NotFound, SandboxClient


class RunSandboxes:
    """One sandbox per chat run, warmed per turn (the map a chat worker keeps)."""

    def __init__(self, client: AsyncSandboxClient) -> None:
        self.client = client
        self.pending: dict[str, asyncio.Task[AsyncSandbox]] = {}

    def warm(self, run_id: str) -> None:
        """At turn start: begin creating the sandbox, return at once."""
        if run_id not in self.pending:
            self.pending[run_id] = asyncio.create_task(
                self.client.create("python", name=f"chat-{run_id}", wait=False)
            )

    async def get(self, run_id: str) -> AsyncSandbox:
        return await self.pending[run_id]

    async def dispose(self, run_id: str) -> None:
        """Right before the run suspends (and again when it ends, as a safety net)."""
        task = self.pending.pop(run_id, None)
        if task is not None:
            await (await task).destroy()


async def execute_code(sandboxes: RunSandboxes, run_id: str, code: str) -> str:
    """The model's tool: run a snippet in this run's sandbox."""
    sandbox = await sandboxes.get(run_id)
    await sandbox.files.write("snippet.py", code)
    result = await sandbox.execute("python3 snippet.py", timeout=30)
    return result.stdout if result.ok else f"error: {result.stderr}"


async def turn(sandboxes: RunSandboxes, run_id: str, number: int) -> None:
    began = time.monotonic()
    sandboxes.warm(run_id)
    print(f"turn {number}: warming took {1000 * (time.monotonic() - began):.2f} ms of the turn")
    await asyncio.sleep(0.2)  # the model thinks meanwhile

    first = time.monotonic()
    total = await execute_code(sandboxes, run_id, "print(sum(range(10)))")
    assert total == "45\n", total
    print(f"turn {number}: first tool call {time.monotonic() - first:.2f} s (includes the start)")
    # Reuse within the turn: the same sandbox, files from the last call included.
    listing = await execute_code(sandboxes, run_id, "import os; print(sorted(os.listdir('.')))")
    assert "snippet.py" in listing, listing

    # A tool worker in another process finds the sandbox by its name.
    name = (await sandboxes.get(run_id)).name
    worker = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--worker", name, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await worker.communicate()
    assert worker.returncode == 0, out
    assert out.decode() == "worker saw snippet.py\n", out
    print(f"turn {number}: worker process reconnected to {name}")

    await sandboxes.dispose(run_id)  # onChatSuspend
    print(f"turn {number}: disposed before suspending")


async def main() -> None:
    run_id = uuid.uuid4().hex[:8]
    async with AsyncSandboxClient() as client:
        sandboxes = RunSandboxes(client)
        try:
            for number in (1, 2):
                await turn(sandboxes, run_id, number)
                try:
                    await client.get(f"chat-{run_id}")
                except NotFound:
                    pass
                else:
                    raise SystemExit("the sandbox outlived its turn")
        finally:
            await sandboxes.dispose(run_id)  # onComplete
    print("done")


def worker(name: str) -> None:
    with SandboxClient() as client:
        sandbox = client.connect(name)
        found = sandbox.files.exists("snippet.py")
        print("worker saw snippet.py" if found else "worker found no snippet.py")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2])
    else:
        asyncio.run(main())
