"""Which gVisor platforms run on this machine, and what each costs against no gVisor.

    python benchmarks/gvisor_platforms.py [--rounds 3] [--timeout 120]

The node's `gvisor` RuntimeClass runs one platform (devcluster/gvisor.py).
This tries each platform of the same `runsc` (the node's build) with
`runsc do`, outside Kubernetes, on one workload, interleaved with the same
workload run natively (the baseline):

- 100 starts of `/bin/true` from a shell loop (process creation);
- Python creating, stat-ing and removing 2,000 files (system calls).

Each is timed inside the sandbox, so gVisor's own start is not counted. A
platform that fails or does not finish within `--timeout` is reported with
the last lines of its debug log (why it does not run here). The KVM platform
needs /dev/kvm; what the kernel offers there is printed too.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import write_results  # noqa: E402
from devcluster import gvisor  # noqa: E402

PLATFORMS = ("systrap", "kvm", "ptrace")
WORKLOAD = r"""
now() { date +%s%N; }
s=$(now); i=0
while [ $i -lt 100 ]; do /bin/true; i=$((i+1)); done
echo "true_ms $(( ($(now) - s) / 1000000 ))"
s=$(now)
python3 -c '
import os, tempfile
d = tempfile.mkdtemp()
for i in range(2000):
    p = os.path.join(d, str(i))
    with open(p, "w") as f:
        f.write("x")
    os.stat(p)
    os.unlink(p)
'
echo "files_ms $(( ($(now) - s) / 1000000 ))"
"""
KVM_GET_API_VERSION = 0xAE00
KVM_CREATE_VM = 0xAE01


def kvm_state() -> str:
    """What /dev/kvm offers: absent, or whether a VM can be made, and the CPU's
    virtualization flags (none under a paravirtual KVM such as PVM)."""
    if not os.path.exists("/dev/kvm"):
        return "no /dev/kvm"
    flags = {"vmx", "svm"} & set(Path("/proc/cpuinfo").read_text().split())
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
    except OSError as exc:
        return f"/dev/kvm cannot be opened: {exc}"
    try:
        version = fcntl.ioctl(fd, KVM_GET_API_VERSION)
        vm = fcntl.ioctl(fd, KVM_CREATE_VM, 0)
        os.close(vm)
        made = "a VM can be created"
    except OSError as exc:
        made, version = f"KVM_CREATE_VM fails: {exc}", -1
    finally:
        os.close(fd)
    virt = ", ".join(sorted(flags)) or "none (a paravirtual KVM)"
    return f"/dev/kvm API {version}, {made}; CPU virtualization flags: {virt}"


def run(command: list[str], timeout: float, log_dir: Path | None) -> dict[str, Any]:
    """The workload's two timings, or why there are none."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s", "log": _log_tail(log_dir)}
    found = dict(re.findall(r"^(true_ms|files_ms) (\d+)$", done.stdout, re.M))
    if done.returncode != 0 or len(found) != 2:
        return {
            "error": f"exit status {done.returncode}: {done.stderr.strip()[-300:]}",
            "log": _log_tail(log_dir),
        }
    return {name: int(value) for name, value in found.items()}


def _log_tail(log_dir: Path | None) -> list[str]:
    """The last lines of runsc's debug logs that say something went wrong."""
    if log_dir is None or not log_dir.exists():
        return []
    lines: list[str] = []
    for log in sorted(log_dir.iterdir()):
        lines += [
            f"{log.name.split('.')[-2]}: {line.strip()[:200]}"
            for line in log.read_text(errors="replace").splitlines()
            if re.search(r"panic|fatal|error|fail|Platform:|vCPUs", line, re.I)
            and "RLIMIT_MEMLOCK" not in line  # every platform here, harmless
        ]
    return lines[-6:]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    runsc = gvisor.binaries()["runsc"]
    work = Path(tempfile.mkdtemp(prefix="gvisor-platforms-"))
    script = work / "work.sh"
    script.write_text(WORKLOAD)
    results: dict[str, Any] = {"load": os.getloadavg(), "kvm": kvm_state(), "runs": {}}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ("native", *PLATFORMS)}
    broken: set[str] = set()
    # `runsc do` keeps its state in a directory of its own under /tmp, which a
    # run killed at the timeout (a hung platform) leaves behind, mounted.
    left_before = set(Path(tempfile.gettempdir()).glob("runsc-do*"))
    try:
        for round_ in range(args.rounds):
            runs["native"].append(run(["sh", str(script)], args.timeout, None))
            for platform in PLATFORMS:
                if platform in broken:
                    continue  # once is enough to know; a hang costs the whole timeout
                logs = work / f"logs-{platform}-{round_}"
                command = [
                    str(runsc),
                    f"--platform={platform}",
                    "--network=none",
                    f"--root={work / f'root-{platform}-{round_}'}",
                    "--debug",
                    f"--debug-log={logs}/",
                    "do",
                    "sh",
                    str(script),
                ]
                outcome = run(command, args.timeout, logs)
                runs[platform].append(outcome)
                if "error" in outcome:
                    broken.add(platform)
    finally:
        # runsc binds an empty network namespace into each root (--network=none)
        # and leaves it mounted.
        left = set(Path(tempfile.gettempdir()).glob("runsc-do*")) - left_before
        for netns in [*work.glob("root-*/null-netns"), *(d / "null-netns" for d in left)]:
            if os.path.ismount(netns):
                subprocess.run(["umount", str(netns)], check=False)
        for directory in (work, *left):
            shutil.rmtree(directory, ignore_errors=True)
    results["runs"] = runs
    print(results["kvm"])
    native = {
        key: statistics.median(r[key] for r in runs["native"] if key in r)
        for key in ("true_ms", "files_ms")
    }
    print(
        f"  {'native':<8} 100 x true {native['true_ms']:6.0f} ms   2,000 files "
        f"{native['files_ms']:6.0f} ms"
    )
    for platform in PLATFORMS:
        good = [r for r in runs[platform] if "error" not in r]
        if not good:
            failed = runs[platform][0]
            print(f"  {platform:<8} does not run here: {failed['error']}")
            for line in failed["log"]:
                print(f"           {line}")
            continue
        true_ms = statistics.median(r["true_ms"] for r in good)
        files_ms = statistics.median(r["files_ms"] for r in good)
        print(
            f"  {platform:<8} 100 x true {true_ms:6.0f} ms ({true_ms / native['true_ms']:.1f}x)"
            f"   2,000 files {files_ms:6.0f} ms ({files_ms / native['files_ms']:.1f}x)"
        )
    results["load_after"] = os.getloadavg()
    write_results("gvisor_platforms", results)


if __name__ == "__main__":
    main()
