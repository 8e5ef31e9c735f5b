"""One-shot: a disposable sandbox runs one command and is removed.

    python examples/sdk/one_shot.py

Files go in before the command starts; stdout and stderr stream while it runs;
the sandbox is deleted whatever happens (and carries a maximum lifetime, so
the operator removes it even if this process dies).
"""

from __future__ import annotations

import sys

from sandbox_sdk import SandboxClient

client = SandboxClient()


def one_shots() -> set[str]:
    """The one-shot sandboxes of the namespace (others come and go beside them:
    pool members refilling, other users' sandboxes)."""
    return {
        str(s.metadata.name)
        for s in client.list()
        if (s.metadata.labels or {}).get("sandbox.dev/one-shot") == "true"
        and not s.metadata.deletion_timestamp
    }


before = one_shots()
result = client.run(
    "python3 stats.py < numbers.txt",
    runtime="python",
    files={
        "stats.py": "import sys\nxs = [int(x) for x in sys.stdin]\nprint(sum(xs), max(xs))\n"
        "print('read', len(xs), 'numbers', file=sys.stderr)\n",
        "numbers.txt": "\n".join(str(n) for n in range(1, 101)) + "\n",
    },
    memory="256Mi",
    timeout=60,
    stdout=sys.stdout,
    stderr=sys.stderr,
)
assert result.exit_code == 0, result
assert result.stdout == "5050 100\n", result
left = one_shots() - before
assert not left, f"one-shot sandboxes left behind: {left}"
print(f"exit {result.exit_code} in {result.duration_seconds:.3f}s; the sandbox is gone")
