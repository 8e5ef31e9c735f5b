"""Snapshots on the real local node, side by side with a plain tar copy.

    python benchmarks/snapshot_bench.py [--sizes 10,1024]

For each workspace size (MiB of incompressible data in 16 MiB files, written
through the agent):

1. Snapshot -> Ready: a `Snapshot` created until its phase is Ready (the
   agent's flush, the VolumeSnapshot, the CSI hostpath driver's copy).
2. Restore -> Ready: a `Sandbox` with `workspace.fromSnapshot` created until
   it is Ready (claim provisioned from the snapshot, pod, agent, runner).
3. The baseline: `tar -c | tar -x` of the same workspace directory into a
   fresh directory on the same disk, run on the host.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    agent_client,
    create_namespace,
    operator_cluster,
    sandbox_ready,
    wait_until,
    write_results,
)
from devcluster.storage import StorageLayout  # noqa: E402
from tests.kube import KubeJSON, api_path, core_path  # noqa: E402

NS = "bench"
API = "sandbox.dev/v1alpha1"
CHUNK_MIB = 16


def _absent(kube: KubeJSON, path: str) -> bool:
    return kube.get(path) is None


def _phase(kube: KubeJSON, name: str) -> str | None:
    body = kube.get(api_path(API, "snapshots", NS, name)) or {}
    phase = (body.get("status") or {}).get("phase")
    if phase == "Failed":
        raise SystemExit(f"snapshot {name} failed: {body['status']}")
    return phase if isinstance(phase, str) else None


def create_sandbox(kube: KubeJSON, name: str, workspace: dict[str, Any]) -> float:
    began = time.monotonic()
    kube.create(
        api_path(API, "sandboxes", NS),
        {
            "apiVersion": API,
            "kind": "Sandbox",
            "metadata": {"name": name},
            "spec": {"workspace": workspace},
        },
    )
    wait_until(lambda: sandbox_ready(kube, NS, name), timeout=1800)
    return time.monotonic() - began


def fill(kube: KubeJSON, name: str, mib: int) -> None:
    files, rest = divmod(mib, CHUNK_MIB)
    script = (
        f"for i in $(seq 1 {files}); do head -c {CHUNK_MIB}M /dev/urandom > data-$i.bin; done;"
        f" head -c {rest}M /dev/urandom > data-rest.bin; du -sm ."
    )
    with agent_client(kube, NS, name, timeout=1800) as client:
        response = client.post("/v1/executions", json={"command": script, "timeoutSeconds": 1800})
        assert response.status_code == 200, response.text
        assert response.json()["exitCode"] == 0, response.text


def snapshot(kube: KubeJSON, name: str, sandbox: str) -> float:
    began = time.monotonic()
    kube.create(
        api_path(API, "snapshots", NS),
        {
            "apiVersion": API,
            "kind": "Snapshot",
            "metadata": {"name": name},
            "spec": {"sandboxRef": {"name": sandbox}},
        },
    )
    wait_until(lambda: _phase(kube, name) == "Ready", timeout=1800)
    return time.monotonic() - began


def volume_dir(kube: KubeJSON, layout: StorageLayout, sandbox: str) -> Path:
    """The hostpath driver's directory holding a sandbox's workspace volume."""
    claim = kube.read(core_path("persistentvolumeclaims", NS, f"{sandbox}-workspace"))
    pv = kube.read(core_path("persistentvolumes", name=claim["spec"]["volumeName"]))
    handle = pv["spec"]["csi"]["volumeHandle"]
    found = [p for p in layout.data_dir.rglob(handle) if p.is_dir()]
    if len(found) != 1:
        raise SystemExit(f"volume {handle} not found under {layout.data_dir}: {found}")
    return found[0]


def tar_copy(source: Path) -> float:
    """`tar -c | tar -x` into a new directory beside the source (same disk), synced."""
    target = Path(tempfile.mkdtemp(prefix="tar-copy-", dir=source.parent))
    try:
        began = time.monotonic()
        subprocess.run(
            f"tar -C {source} -cf - . | tar -C {target} -xf - && sync",
            shell=True,
            check=True,
        )
        return time.monotonic() - began
    finally:
        shutil.rmtree(target)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="10,1024", help="workspace sizes in MiB")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with operator_cluster(f"bench-snap-{os.getpid()}") as cluster:
        kube = KubeJSON(cluster.kubeconfig)
        layout = StorageLayout.of(cluster)
        create_namespace(kube, NS)
        for mib in sizes:
            claim_size = f"{max(1, (mib * 2) // 1024 + 1)}Gi"
            source, snap, restored = f"src-{mib}", f"snap-{mib}", f"restored-{mib}"
            create_sandbox(kube, source, {"size": claim_size})
            fill(kube, source, mib)
            to_ready = snapshot(kube, snap, source)
            restore = create_sandbox(kube, restored, {"size": claim_size, "fromSnapshot": snap})
            tar = tar_copy(volume_dir(kube, layout, source))
            rows.append((mib, to_ready, restore, tar))
            for name in (source, restored):
                kube.delete(api_path(API, "sandboxes", NS, name))
            wait_until(partial(_absent, kube, api_path(API, "sandboxes", NS, restored)))
    print("\nWorkspace snapshot and restore on the CSI hostpath driver, one each:")
    print(f"  {'size':>8}  {'snapshot->Ready':>16}  {'restore->Ready':>15}  {'tar copy':>9}")
    for mib, to_ready, restore, tar in rows:
        print(f"  {mib:>5} MiB  {to_ready:>14.2f} s  {restore:>13.2f} s  {tar:>7.2f} s")
    write_results(
        "snapshot_bench",
        {
            "seconds": [
                {"mib": mib, "snapshot_ready": r, "restore_ready": t, "tar_copy": c}
                for mib, r, t, c in rows
            ]
        },
    )


if __name__ == "__main__":
    main()
