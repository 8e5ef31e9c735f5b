"""sandbox-node's commands, built as the node gets them, in front of a
stand-in runsc that records its command line (and, asked to checkpoint,
writes an image as runsc does): what sandbox-runsc passes on, when a `start`
becomes a restore, and what sandbox-checkpoint leaves in the store. The real
runsc under the real shim is the node tier's (tests/devcluster/
test_gvisor_checkpoint.py)."""

from __future__ import annotations

import json
import subprocess
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from devcluster import gvisor
from tests.sandbox_node import (
    UID,
    Node,
    binaries,
    container_annotations,
    make_node,
    sandbox_annotations,
)


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return make_node(tmp_path)


def test_everything_but_a_restore_passes_through_unchanged(node: Node) -> None:
    for args in (
        ["state", "abc"],
        ["events", "--stats", "abc"],
        ["start", "abc"],
        ["spec", "--bundle", "/some/bundle"],
        ["--help"],
    ):
        done = node.runsc_call(*args)
        assert done.returncode == 0, done.stderr
        assert node.passed_on() == args
    done = node.create("pod1", sandbox_annotations())
    assert done.returncode == 0, done.stderr
    assert node.passed_on()[0] == "create"
    assert node.runsc_call("start", "pod1").returncode == 0
    assert node.passed_on() == ["start", "pod1"]


def test_a_pod_naming_a_complete_image_is_restored_container_by_container(node: Node) -> None:
    image = node.image("team-a", "k1")
    assert node.create("pod1", sandbox_annotations("k1")).returncode == 0
    assert node.runsc_call("start", "pod1").returncode == 0
    restore = ["restore", "--detach", f"--image-path={image}", "pod1"]
    assert node.passed_on() == restore
    # Its containers follow the pod's decision, whatever their own annotations say.
    for cid, name in (("sandbox1", "sandbox"), ("agent1", "agent")):
        assert node.create(cid, container_annotations("pod1", name)).returncode == 0
        assert node.runsc_call("start", cid).returncode == 0
        assert node.passed_on() == ["restore", "--detach", f"--image-path={image}", cid]
    # A container the kubelet restarts later (same name, new ID) starts fresh
    # in the restored sandbox.
    assert node.create("agent2", container_annotations("pod1", "agent")).returncode == 0
    assert node.runsc_call("start", "agent2").returncode == 0
    assert node.passed_on() == ["start", "agent2"]
    # A second sandbox of the same pod (the kubelet makes one when the first
    # died) starts fresh: the workspace has moved on since the image.
    again = node.create("pod1b", sandbox_annotations("k1"))
    assert again.returncode == 0
    assert "it was restored once" in again.stderr
    assert node.runsc_call("start", "pod1b").returncode == 0
    assert node.passed_on() == ["start", "pod1b"]
    # Deleted, a container's decision goes with it.
    assert node.runsc_call("delete", "--force", "agent1").returncode == 0
    assert node.runsc_call("start", "agent1").returncode == 0
    assert node.passed_on() == ["start", "agent1"]


@pytest.mark.parametrize(
    ("case", "namespace", "key", "warning"),
    [
        ("no image", "team-a", "k1", "no complete image"),
        ("other build", "team-a", "old", "written by runsc sha256:000"),
        ("incomplete", "team-a", "partial", "no complete image"),
        ("key is a path", "team-a", "../team-b/k1", "not a DNS label"),
        ("namespace is a path", "..", "k1", "not a DNS label"),
        ("another namespace's image", "team-b", "theirs", "no complete image"),
    ],
)
def test_an_image_that_cannot_be_restored_leaves_a_fresh_start(
    node: Node, case: str, namespace: str, key: str, warning: str
) -> None:
    node.image("team-a", "old", build="sha256:" + "0" * 64)
    (node.store / "team-a" / "partial").mkdir(parents=True)
    node.image("team-c", "theirs")
    done = node.create("pod1", sandbox_annotations(key, namespace=namespace))
    assert done.returncode == 0, done.stderr
    assert warning in done.stderr, (case, done.stderr)
    assert node.runsc_call("start", "pod1").returncode == 0
    assert node.passed_on() == ["start", "pod1"]
    assert node.create("c1", container_annotations("pod1")).returncode == 0
    assert node.runsc_call("start", "c1").returncode == 0
    assert node.passed_on() == ["start", "c1"]


def test_the_containers_of_a_checkpointed_pod_do_not_start_again(node: Node) -> None:
    assert node.create("pod1", sandbox_annotations()).returncode == 0
    done = _checkpoint(node, "team-a", UID, "k1")
    assert done.returncode == 0, done.stderr
    for cid, spec in (("pod2", sandbox_annotations()), ("c2", container_annotations("pod2"))):
        refused = node.create(cid, spec)
        assert refused.returncode == 1
        assert f"pod {UID} was checkpointed" in refused.stderr
        assert not node.record.exists()
    # Another pod is not concerned.
    other = str(uuid.uuid4())
    assert node.create("pod3", sandbox_annotations(uid=other)).returncode == 0


def test_the_containers_of_a_checkpointed_pod_are_deleted_by_force(node: Node) -> None:
    other = str(uuid.uuid4())
    for cid, spec in (
        ("pod1", sandbox_annotations()),
        ("c1", container_annotations("pod1")),
        ("pod3", sandbox_annotations(uid=other)),
    ):
        assert node.create(cid, spec).returncode == 0
    assert _checkpoint(node, "team-a", UID, "k1").returncode == 0
    # runsc refuses to delete a container it still sees running: the
    # checkpointed sandbox is still going away when the shim asks.
    for cid in ("c1", "pod1"):
        assert node.runsc_call("delete", cid).returncode == 0
        assert node.passed_on() == ["delete", "--force", cid]
    assert node.runsc_call("delete", "--force", "c1").returncode == 0
    assert node.passed_on() == ["delete", "--force", "c1"]
    # A pod that was not checkpointed is deleted as the shim asks.
    assert node.runsc_call("delete", "pod3").returncode == 0
    assert node.passed_on() == ["delete", "pod3"]


def test_a_checkpointed_pod_is_deleted_once_its_sandbox_process_is_gone(node: Node) -> None:
    assert node.create("pod1", sandbox_annotations()).returncode == 0
    assert _checkpoint(node, "team-a", UID, "k1").returncode == 0
    # The stand-in for a sandbox process that is still going away: it exits
    # after a moment and is reaped (a zombie still answers kill(pid, 0)).
    sandbox = subprocess.Popen(["sleep", "0.5"])
    reaper = threading.Thread(target=sandbox.wait)
    reaper.start()
    try:
        done = node.runsc_call("delete", "pod1", env=node.env(SANDBOX_PID=str(sandbox.pid)))
        # Not before the process was reaped.
        assert sandbox.returncode is not None
    finally:
        reaper.join()
    assert done.returncode == 0, done.stderr
    assert node.passed_on() == ["delete", "--force", "pod1"]


def _checkpoint(
    node: Node, namespace: str, uid: str, key: str, **env: str
) -> subprocess.CompletedProcess[str]:
    node.record.unlink(missing_ok=True)
    return subprocess.run(
        [
            str(binaries()[gvisor.CHECKPOINT]),
            f"--runsc={node.runsc}",
            f"--root={node.root}",
            f"--store={node.store}",
            f"--namespace={namespace}",
            f"--pod-uid={uid}",
            f"--key={key}",
            "--runsc-flag=platform=systrap",
        ],
        env=node.env(**env),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_a_checkpoint_is_renamed_into_place_when_whole(node: Node) -> None:
    assert node.create("pod1", sandbox_annotations()).returncode == 0
    done = _checkpoint(node, "team-a", UID, "k1")
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    image = node.store / "team-a" / "k1"
    assert result["image"] == str(image)
    assert result["bytes"] == len("state") + len(node.build) + 1
    assert node.passed_on() == [
        "--platform=systrap",
        "checkpoint",
        f"--image-path={node.store / 'team-a' / '.k1.partial'}",
        "pod1",
    ]
    assert sorted(p.name for p in image.iterdir()) == ["checkpoint.img", "complete"]
    assert (image / "complete").read_text() == node.build + "\n"
    assert [p.name for p in (node.store / "team-a").iterdir()] == ["k1"]
    # Taken again under the same key: the new image replaces the old one.
    assert node.create("pod9", sandbox_annotations(uid=str(uuid.uuid4()))).returncode == 0
    again = _checkpoint(node, "team-a", UID, "k1")
    assert again.returncode == 0, again.stderr


def test_a_failed_checkpoint_leaves_nothing_and_the_pod_runs_on(node: Node) -> None:
    assert node.create("pod1", sandbox_annotations()).returncode == 0
    done = _checkpoint(node, "team-a", UID, "k1", FAIL="1")
    assert done.returncode == 1
    assert "runsc checkpoint of pod" in done.stderr
    assert "cannot save endpoint" in done.stderr
    assert list((node.store / "team-a").iterdir()) == []
    # Not marked ended: its containers may start again.
    assert node.create("pod2", sandbox_annotations()).returncode == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"uid": "not-a-uid"}, "is not a UID"),
        ({"uid": str(uuid.uuid4())}, "no gVisor sandbox of pod"),
        ({"namespace": "../etc"}, "not a DNS label"),
        ({"key": "a/b"}, "not a DNS label"),
    ],
)
def test_checkpoint_refuses_what_it_cannot_find_or_name(
    node: Node, args: dict[str, str], message: str
) -> None:
    assert node.create("pod1", sandbox_annotations()).returncode == 0
    done = _checkpoint(
        node, args.get("namespace", "team-a"), args.get("uid", UID), args.get("key", "k1")
    )
    assert done.returncode == 1
    assert message in done.stderr, done.stderr
    assert not node.record.exists()


def test_without_its_runsc_sandbox_runsc_says_so(node: Node) -> None:
    env = node.env()
    del env["SANDBOX_RUNSC"]
    done = node.runsc_call("state", "abc", env=env)
    assert done.returncode == 1
    assert "SANDBOX_RUNSC is not set" in done.stderr
    unnamed = node.runsc_call("start", "../x")
    assert unnamed.returncode == 1
    assert "is not a file name" in unnamed.stderr


@pytest.mark.parametrize(
    ("uid", "recorded"),
    [("5f0c6a1e9d2b4c7e8a1f3b5d7c9e0a2b", True), ("../../etc", False), ("", False)],
)
def test_any_pod_starts_whatever_its_uid(node: Node, uid: str, recorded: bool) -> None:
    """A static pod's UID is a hash, not a UUID; a UID that is no file name is
    not recorded (that pod cannot be checkpointed) but its sandbox starts."""
    done = node.create("pod1", sandbox_annotations(uid=uid))
    assert done.returncode == 0, done.stderr
    assert node.passed_on()[0] == "create"
    assert (node.root / "sandbox-runsc" / "pods" / uid).is_file() == recorded
