"""sandbox-node's commands (sandbox-node/) in front of a stand-in runsc that
records its command line and, asked to checkpoint, writes an image as runsc
does: the shared part of the unit tests of sandbox-runsc and
sandbox-checkpoint and the integration test of checkpointd."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from devcluster import gvisor

FAKE_RUNSC = """#!/bin/sh
# Records its command line; `checkpoint --image-path=DIR ID` writes an image;
# `state ID` says the sandbox's pid is $SANDBOX_PID (when set).
case " $* " in
  *" state "*) if [ -n "$SANDBOX_PID" ]; then printf '{"pid": %s}' "$SANDBOX_PID"; exit 0; fi ;;
esac
printf '%s\\n' "$@" > "$RECORD"
for arg in "$@"; do
  case "$arg" in --image-path=*) image="${arg#--image-path=}" ;; esac
done
if [ "$FAIL" = 1 ]; then echo "save failed: cannot save endpoint" >&2; exit 1; fi
case " $* " in *" checkpoint "*) printf 'state' > "$image/checkpoint.img" ;; esac
"""


@dataclass
class Node:
    root: Path
    store: Path
    runsc: Path
    record: Path
    tmp: Path

    @property
    def build(self) -> str:
        return "sha256:" + hashlib.sha256(self.runsc.read_bytes()).hexdigest()

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "PATH": os.environ["PATH"],
            "SANDBOX_RUNSC": str(self.runsc),
            "SANDBOX_CHECKPOINTS": str(self.store),
            "RECORD": str(self.record),
            **extra,
        }

    def runsc_call(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        self.record.unlink(missing_ok=True)
        return subprocess.run(
            [str(binaries()[gvisor.SANDBOX_RUNSC]), f"--root={self.root}", *args],
            env=self.env() if env is None else env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    def passed_on(self) -> list[str]:
        """What the stand-in runsc was called with (after the global --root)."""
        return self.record.read_text().splitlines()[1:]

    def bundle(self, name: str, annotations: dict[str, str]) -> Path:
        path = self.tmp / "bundles" / name
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps({"annotations": annotations}))
        return path

    def image(self, namespace: str, key: str, build: str | None = None) -> Path:
        path = self.store / namespace / key
        path.mkdir(parents=True)
        (path / "checkpoint.img").write_text("state")
        (path / "complete").write_text((build or self.build) + "\n")
        return path

    def create(self, cid: str, annotations: dict[str, str]) -> subprocess.CompletedProcess[str]:
        """`runsc create` of container `cid`, its bundle's spec carrying `annotations`."""
        return self.runsc_call("create", "--bundle", str(self.bundle(cid, annotations)), cid)


def binaries() -> dict[str, Path]:
    return gvisor.node_binaries()


UID = "0b6a2c1e-5d4f-4e3a-9b8c-7d6e5f4a3b2c"


def sandbox_annotations(
    key: str | None = None, namespace: str = "team-a", uid: str = UID
) -> dict[str, str]:
    annotations = {
        "io.kubernetes.cri.container-type": "sandbox",
        "io.kubernetes.cri.sandbox-namespace": namespace,
        "io.kubernetes.cri.sandbox-uid": uid,
    }
    if key is not None:
        annotations["sandbox.dev/restore-from"] = key
    return annotations


def container_annotations(sandbox_id: str, name: str = "", uid: str = UID) -> dict[str, str]:
    annotations = {
        "io.kubernetes.cri.container-type": "container",
        "io.kubernetes.cri.sandbox-id": sandbox_id,
        "io.kubernetes.cri.sandbox-uid": uid,
    }
    if name:
        annotations["io.kubernetes.cri.container-name"] = name
    return annotations


def make_node(tmp_path: Path) -> Node:
    """A node's runsc root and checkpoint store under `tmp_path`, with the
    stand-in runsc."""
    runsc = tmp_path / "runsc"
    runsc.write_text(FAKE_RUNSC)
    runsc.chmod(0o755)
    root = tmp_path / "root"
    root.mkdir()
    return Node(root, tmp_path / "store", runsc, tmp_path / "record", tmp_path)
