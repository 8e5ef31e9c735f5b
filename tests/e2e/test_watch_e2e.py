"""File watching on the real node: the SDK's `files.watch` through the gateway
(the API server's service proxy), the watch held by the agent, and the changes
made by commands in the other container of the pod, under runc and gVisor.

Under gVisor each container mounts the workspace as a filesystem of its own in
gVisor's kernel, so the agent's inotify never hears of the sandbox container's
changes (gVisor issues 8089 and 11326); the agent polls there instead
(sandbox-agent/src/sandbox_agent/watchpoll.py). Polling sees the difference
between two scans, so each step below waits for its events before the next
one is made: a step's changes are then never folded into the next's."""

from __future__ import annotations

import pytest

from devcluster import gvisor
from sandbox_sdk import Sandbox, SandboxClient, Watch
from sandbox_sdk.models.agent import WatchEvent
from tests.e2e.conftest import E2E
from tests.sandboxes import Sandboxes

pytestmark = pytest.mark.timeout(900)

Seen = tuple[str, str | None]  # (type, path)

# Each step: a command run in the sandbox container, and the events it must bring.
STEPS: list[tuple[str, list[Seen]]] = [
    ("echo one > w/a.txt", [("create", "w/a.txt"), ("write", "w/a.txt")]),
    ("echo two >> w/a.txt", [("write", "w/a.txt")]),
    ("chmod 600 w/a.txt", [("chmod", "w/a.txt")]),
    ("mv w/a.txt w/b.txt", [("rename", "w/b.txt")]),
    ("mkdir w/sub && echo deep > w/sub/c.txt", [("create", "w/sub"), ("create", "w/sub/c.txt")]),
    ("rm w/b.txt", [("remove", "w/b.txt")]),
]


def _until(changes: Watch, want: list[Seen], log: list[WatchEvent]) -> None:
    """Read events until each of `want` has come (in any order: a scan may see
    a step half done); every event read goes to `log`. The watch's own timeout
    ends the iteration if they never come."""
    missing = list(want)
    for event in changes:
        log.append(event)
        if (event.type, event.path) in missing:
            missing.remove((event.type, event.path))
        if not missing:
            return
    raise AssertionError(
        f"the watch ended ({changes.end_reason}) before {missing}; it saw {_shown(log)}"
    )


def _shown(log: list[WatchEvent]) -> list[tuple[str, ...]]:
    return [(e.type, e.path or "", *([e.old_path] if e.old_path else [])) for e in log]


@pytest.mark.parametrize(
    ("runtime_class", "mode"), [(None, "inotify"), (gvisor.RUNTIME_CLASS, "poll")]
)
def test_a_watch_sees_what_commands_in_the_sandbox_change(
    e2e: E2E, runtime_class: str | None, mode: str
) -> None:
    ns = e2e.namespace()
    spec: dict[str, object] = {"runtime": "python"}
    if runtime_class is not None:
        spec["runtimeClassName"] = runtime_class
    Sandboxes(e2e.kube, ns).create("box", spec)
    Sandboxes(e2e.kube, ns).wait_ready("box")
    with SandboxClient(ns, kubeconfig=e2e.cluster.kubeconfig) as client:
        box: Sandbox = client.connect("box")
        assert box.execute("mkdir w", check=True).exit_code == 0
        log: list[WatchEvent] = []
        # The timeout bounds the test if events never come (the iteration ends).
        with box.files.watch("w", recursive=True, timeout=300) as changes:
            started = changes.started
            assert started is not None
            assert started.mode == mode, started
            if mode == "poll":
                assert started.poll_interval is not None
                assert started.poll_interval > 0
            for command, want in STEPS:
                assert box.execute(command, check=True).exit_code == 0
                _until(changes, want, log)
            renamed = next(e for e in log if e.type == "rename")
            assert (renamed.old_path, renamed.move) == ("w/a.txt", "within"), _shown(log)
            # The watched directory removed by the sandbox: what it held, itself,
            # and the end of the stream.
            assert box.execute("rm -r w", check=True).exit_code == 0
            gone: list[Seen] = [("remove", "w/sub/c.txt"), ("remove", "w/sub"), ("remove", "w")]
            _until(changes, gone, log)
            assert list(changes) == []
            assert changes.end_reason == "removed", _shown(log)
        # Nothing the commands did not do, and each kind of change at least once.
        kinds = {e.type for e in log}
        assert kinds == {"create", "write", "chmod", "rename", "remove"}, _shown(log)
