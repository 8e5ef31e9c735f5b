"""Sandboxes under gVisor on the real node: the RuntimeClass `gvisor` (runsc
and its shim, devcluster/gvisor.py), chosen by a template or by the Sandbox.
Commands, files, a snapshot and a restore work, and the sandbox sees from
inside that it runs on gVisor's kernel, where a runc sandbox sees this host's."""

from __future__ import annotations

import os

import pytest

from devcluster import gvisor
from tests.e2e.agent import Agent
from tests.e2e.conftest import E2E
from tests.integration.harness import wait_for
from tests.kube import api_path, core_path
from tests.sandboxes import Sandboxes
from tests.snapshots import Snapshots

pytestmark = pytest.mark.timeout(900)


def _kernel(agent: Agent) -> tuple[str, str]:
    """`uname -r` and the first line of the kernel log, as the sandbox sees them."""
    release = agent.run(["uname", "-r"])
    assert release["exitCode"] == 0, release
    log = agent.run(shell="dmesg 2>&1 | head -1")
    return release["stdout"].strip(), log["stdout"].strip()


def _runtime_class(e2e: E2E, namespace: str, pod: str) -> str | None:
    spec = e2e.kube.read(core_path("pods", namespace, pod))["spec"]
    name: str | None = spec.get("runtimeClassName")
    return name


def test_a_gvisor_sandbox_runs_commands_files_snapshots_and_restores(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes, snapshots = Sandboxes(e2e.kube, ns), Snapshots(e2e.kube, ns)
    # The template option: every sandbox of this template runs under gVisor.
    e2e.kube.create(
        api_path("sandbox.dev/v1alpha1", "sandboxtemplates", ns),
        {
            "apiVersion": "sandbox.dev/v1alpha1",
            "kind": "SandboxTemplate",
            "metadata": {"name": "untrusted"},
            "spec": {
                "description": "Python 3 under gVisor",
                "sandbox": {"runtime": "python", "runtimeClassName": gvisor.RUNTIME_CLASS},
            },
        },
    )
    sandboxes.create("guest", {"templateRef": {"name": "untrusted"}})
    sandboxes.create("native")
    sandboxes.wait_ready("guest")
    sandboxes.wait_ready("native")
    assert _runtime_class(e2e, ns, "guest") == gvisor.RUNTIME_CLASS
    assert _runtime_class(e2e, ns, "native") is None

    guest = Agent.of(e2e.kube, ns, "guest")
    release, first_log_line = _kernel(guest)
    assert release != os.uname().release, release
    assert "gVisor" in first_log_line, first_log_line
    # The control: under runc the sandbox shares this machine's kernel.
    native_release, native_log = _kernel(Agent.of(e2e.kube, ns, "native"))
    assert native_release == os.uname().release
    assert "gVisor" not in native_log

    # Files both ways between the agent's container and the sandbox's.
    guest.write("src/app.py", "print('from the agent')\n")
    ran = guest.run(["python3", "src/app.py"])
    assert (ran["exitCode"], ran["stdout"]) == (0, "from the agent\n"), ran
    made = guest.run(shell="echo 'from the sandbox' > made.txt && mkdir -p out && date > out/t")
    assert made["exitCode"] == 0, made
    assert guest.read("made.txt") == "from the sandbox\n"
    listing = guest._http.get("/v1/files/list", params={"path": "."})
    assert listing.status_code == 200, listing.text
    names = {entry["name"] for entry in listing.json()["entries"]}
    assert {"src", "made.txt", "out"} <= names, names
    # A background command and its output, read back later.
    started = guest.start("for i in 1 2 3; do echo tick-$i; sleep 0.2; done > ticks.txt")
    wait_for(
        lambda: guest.execution(started["id"])["status"] != "running", 30, "the background command"
    )
    assert guest.read("ticks.txt") == "tick-1\ntick-2\ntick-3\n"

    # A snapshot of the gVisor workspace, restored into a new gVisor sandbox.
    snapshots.create("checkpoint", "guest")
    snapshots.wait_phase("checkpoint", "Ready")
    guest.write("made.txt", "changed after the checkpoint\n")
    sandboxes.create(
        "restored",
        {"templateRef": {"name": "untrusted"}, "workspace": {"fromSnapshot": "checkpoint"}},
    )
    wait_for(
        lambda: (
            (sandboxes.condition("restored", "WorkspaceRestored") or {}).get("status") == "True"
        ),
        180,
        "sandbox restored from checkpoint",
        interval=0.5,
    )
    sandboxes.wait_ready("restored")
    assert _runtime_class(e2e, ns, "restored") == gvisor.RUNTIME_CLASS
    restored = Agent.of(e2e.kube, ns, "restored")
    assert restored.read("made.txt") == "from the sandbox\n"
    assert restored.read("src/app.py") == "print('from the agent')\n"
    again = restored.run(["python3", "src/app.py"])
    assert again["stdout"] == "from the agent\n", again
    assert "gVisor" in _kernel(restored)[1]
    # The source is untouched by the copy.
    assert guest.read("made.txt") == "changed after the checkpoint\n"
