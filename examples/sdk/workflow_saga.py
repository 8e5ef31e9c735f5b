"""A durable-workflow saga: provision, run steps, always clean up.

    python examples/sdk/workflow_saga.py

A pipeline of steps runs in one sandbox. The third step fails; the handle's
`with` block is the compensation, so the sandbox is destroyed anyway (and
`destroy` returns only once it is gone). The example then checks that nothing
is left and exits 0: the failure was the point.
"""

from __future__ import annotations

from sandbox_sdk import CommandFailed, NotFound, SandboxClient

STEPS = [
    "mkdir -p build && echo 'print(1 + 1)' > build/app.py",
    "python3 build/app.py > build/out.txt",
    "python3 -c 'import sys; sys.exit(\"step 3: the tests failed\")'",
    "echo never reached > build/after.txt",
]

client = SandboxClient()
name = None
completed: list[int] = []
try:
    with client.create("python") as sandbox:
        name = sandbox.name
        for number, step in enumerate(STEPS, 1):
            sandbox.execute(step, check=True, timeout=60)
            completed.append(number)
            print(f"step {number} done")
except CommandFailed as failure:
    print(f"the workflow failed at step {len(completed) + 1}: {failure.result.stderr.strip()}")
else:
    raise SystemExit("step 3 should have failed")

assert completed == [1, 2], completed
assert name is not None
try:
    client.get(name)
except NotFound:
    print(f"sandbox {name} was destroyed by the compensation")
else:
    raise SystemExit(f"sandbox {name} is still there")
