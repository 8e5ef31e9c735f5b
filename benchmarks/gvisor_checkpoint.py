"""gVisor's checkpoint and restore on this machine, against a process's resident memory.

    python benchmarks/gvisor_checkpoint.py [--sizes 100,500,1024] [--timeout 300]

What a pause that keeps memory (issue: running processes survive pause and
resume) would rest on, measured at its lowest layer, outside Kubernetes: the
node's own `runsc` (devcluster/gvisor.py, systrap platform) runs a bundle of
the python runtime image's root filesystem. In it, python3 fills SIZE MiB with
random bytes (nothing to compress) and prints, every 0.2 s, a counter and a
digest of one byte of every page of that memory. Then:

- checkpoint: `runsc checkpoint --image-path` (the container stops);
- restore: `runsc restore` of that image into a new container, timed until the
  restored process prints its next line; that line must carry the next counter
  and the same digest (the process went on, every page as it was);
- baseline: `runsc run` of the same bundle until its first line: a fresh start
  of the same process, which has to fill its memory again (what a pause that
  keeps only the workspace gives back: a new process, empty).

The root filesystem is the bundle's directory with no overlay
(`--overlay2=none`), as in the first runs of this benchmark: the 2023-09
runsc the node ran then refused to restore a sandbox whose root had its
default overlay ("S/R not supported for private memory files"). The node's
runsc now saves that overlay too (pods restore with it, see
tests/devcluster/test_gvisor_checkpoint.py); the bundle keeps none so that
the figures compare with the earlier ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import write_results  # noqa: E402
from devcluster import gvisor, images  # noqa: E402

PROGRAM = """
import hashlib, os, sys, time
size = int(sys.argv[1]) << 20
blob = bytearray(os.urandom(size))
i = 0
while True:
    print(i, hashlib.sha256(blob[::4096]).hexdigest()[:16], flush=True)
    i += 1
    time.sleep(0.2)
"""


def rootfs(into: Path) -> None:
    """The python runtime image's root filesystem (from the image cache)."""
    image = images.ensure_built(images.IMAGES["sandbox-runtime-python:dev"])
    oci = into.parent / "oci"
    oci.mkdir()
    with tarfile.open(image.archive) as archive:
        archive.extractall(oci, filter="tar")
    index = json.loads((oci / "index.json").read_text())
    manifest = json.loads(_blob(oci, index["manifests"][0]["digest"]).read_text())
    into.mkdir()
    for layer in manifest["layers"]:
        with tarfile.open(_blob(oci, layer["digest"])) as archive:
            archive.extractall(into, filter="tar")
    shutil.rmtree(oci)


def _blob(oci: Path, digest: str) -> Path:
    return oci / "blobs" / "sha256" / digest.split(":", 1)[1]


def bundle(work: Path, size_mib: int) -> Path:
    """A bundle (config.json from `runsc spec`) that runs PROGRAM over `rootfs`."""
    path = work / f"bundle-{size_mib}"
    path.mkdir()
    (path / "rootfs").symlink_to(work / "rootfs")
    subprocess.run([str(runsc()), "spec", "--bundle", str(path)], check=True)
    config = json.loads((path / "config.json").read_text())
    config["process"]["terminal"] = False
    config["process"]["args"] = ["python3", "-c", PROGRAM, str(size_mib)]
    config["root"] = {"path": str(work / "rootfs"), "readonly": False}
    (path / "config.json").write_text(json.dumps(config))
    return path


def runsc() -> Path:
    return gvisor.binaries(build_missing=True)["runsc"]


class Runsc:
    """`runsc` with one state directory, the node's platform, no network, no overlay."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.base = [
            str(runsc()),
            "--root",
            str(state),
            "--platform",
            "systrap",
            "--network",
            "none",
            "--overlay2=none",
        ]

    def __call__(self, *args: str, stdout: Path | None = None, timeout: float = 300) -> float:
        """Run a command; its duration in seconds."""
        began = time.perf_counter()
        # Files, not pipes: a detached sandbox keeps the descriptors it was given.
        with open(stdout or os.devnull, "ab") as out, tempfile.TemporaryFile() as err:
            done = subprocess.run(
                [*self.base, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                timeout=timeout,
                check=False,
            )
            if done.returncode != 0:
                err.seek(0)
                message = err.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"runsc {args[0]}: {message}")
        return time.perf_counter() - began

    def delete(self, name: str) -> None:
        subprocess.run([*self.base, "delete", "--force", name], capture_output=True, check=False)

    def release(self) -> None:
        """Unmount what runsc leaves mounted in its state directory: with no
        network it binds an empty network namespace there, for its sandboxes
        to join, and does not unmount it when they are deleted."""
        netns = self.state / "null-netns"
        if os.path.ismount(netns):
            subprocess.run(["umount", str(netns)], check=True)


def lines(path: Path) -> list[tuple[int, str]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            out.append((int(parts[0]), parts[1]))
    return out


def wait_line(path: Path, after: float, timeout: float) -> tuple[float, tuple[int, str]]:
    """The first line `path` gets, and how long after `after` it came."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = lines(path) if path.exists() else []
        if got:
            return time.perf_counter() - after, got[0]
        time.sleep(0.01)
    raise TimeoutError(f"{path.name}: no line in {timeout:g}s")


def measure(work: Path, size_mib: int, timeout: float) -> dict[str, Any]:
    rs = Runsc(work / f"state-{size_mib}")
    path = bundle(work, size_mib)
    image = work / f"image-{size_mib}"
    image.mkdir()
    first, second, fresh = (work / f"{n}-{size_mib}.out" for n in ("first", "second", "fresh"))
    names = [f"a{size_mib}", f"b{size_mib}", f"c{size_mib}"]
    try:
        began = time.perf_counter()
        rs("run", "--detach", "--bundle", str(path), names[0], stdout=first, timeout=timeout)
        start_s, _ = wait_line(first, began, timeout)
        time.sleep(1.0)  # a few more lines: the process is in its loop
        checkpoint_s = rs("checkpoint", "--image-path", str(image), names[0], timeout=timeout)
        before = lines(first)[-1]
        image_bytes = sum(f.stat().st_size for f in image.iterdir())
        began = time.perf_counter()
        rs(
            "restore",
            "--image-path",
            str(image),
            "--bundle",
            str(path),
            "--detach",
            names[1],
            stdout=second,
            timeout=timeout,
        )
        restore_s, after = wait_line(second, began, timeout)
        rs.delete(names[1])
        kept = after[0] == before[0] + 1 and after[1] == before[1]
        began = time.perf_counter()
        rs("run", "--detach", "--bundle", str(path), names[2], stdout=fresh, timeout=timeout)
        fresh_s, _ = wait_line(fresh, began, timeout)
    finally:
        for name in names:
            rs.delete(name)
        rs.release()
    return {
        "size_mib": size_mib,
        "first_start_s": start_s,
        "checkpoint_s": checkpoint_s,
        "image_mib": image_bytes / (1 << 20),
        "restore_s": restore_s,
        "fresh_start_s": fresh_s,
        "state_kept": kept,
        "before": before,
        "after": after,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="100,500,1024")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("runsc needs root")
    results: dict[str, Any] = {"load": os.getloadavg(), "runs": []}
    with tempfile.TemporaryDirectory(prefix="gvisor-checkpoint-") as tmp:
        work = Path(tmp)
        rootfs(work / "rootfs")
        for size in (int(s) for s in args.sizes.split(",")):
            results["runs"].append(measure(work, size, args.timeout))
    results["load_after"] = os.getloadavg()
    print("gVisor (systrap) checkpoint and restore of a python3 process holding random bytes:")
    print(
        f"  {'resident':>9} {'checkpoint':>11} {'image':>10} {'restore':>9}"
        f" {'fresh start':>12} {'restore/fresh':>14}  state kept"
    )
    for r in results["runs"]:
        print(
            f"  {r['size_mib']:>6} MiB {r['checkpoint_s']:>10.2f}s {r['image_mib']:>6.0f} MiB"
            f" {r['restore_s']:>8.2f}s {r['fresh_start_s']:>11.2f}s"
            f" {r['restore_s'] / r['fresh_start_s']:>13.2f}x  {r['state_kept']}"
        )
    write_results("gvisor_checkpoint", results)
    if not all(r["state_kept"] for r in results["runs"]):
        raise SystemExit("a restored process did not go on from where it was")


if __name__ == "__main__":
    main()
