"""The main job: a local control plane, the CRDs, the operator, the examples.

    python hack/demo.py up     # start (or reuse) everything, apply examples/, report
    python hack/demo.py down   # stop the operator and the control plane, remove state

The operator runs as a host process here (`kopf run -m sandbox_operator`), the
way `make run` runs it during development.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from devcluster.controlplane import ControlPlane  # noqa: E402

NAME = "demo"
HEALTH_PORT = 18081
METRICS_PORT = 18000


def _kubectl(cp: ControlPlane, *args: str) -> str:
    result = subprocess.run(
        [str(cp.kubectl), f"--kubeconfig={cp.kubeconfig}", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if result.returncode != 0:
        raise SystemExit(f"kubectl {' '.join(args)} failed:\n{result.stderr}")
    return result.stdout


def _pid_file(cp: ControlPlane) -> Path:
    return cp.state_dir / "operator.pid"


def _operator_alive(cp: ControlPlane) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{HEALTH_PORT}/healthz", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _start_operator(cp: ControlPlane) -> None:
    if _operator_alive(cp):
        print("operator: already running")
        return
    log = cp.state_dir / "operator.log"
    env = {
        **os.environ,
        "KUBECONFIG": str(cp.kubeconfig),
        "SANDBOX_OPERATOR_METRICS_PORT": str(METRICS_PORT),
    }
    kopf = Path(sys.executable).parent / "kopf"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [
                str(kopf),
                "run",
                "-m",
                "sandbox_operator",
                "--all-namespaces",
                "--standalone",
                f"--liveness=http://127.0.0.1:{HEALTH_PORT}/healthz",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO,
        )
    _pid_file(cp).write_text(str(proc.pid))
    deadline = time.monotonic() + 60
    while not _operator_alive(cp):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"operator did not start; see {log}")
        time.sleep(0.3)
    print(f"operator: running (pid {proc.pid}, log {log}, metrics :{METRICS_PORT})")


def up() -> None:
    cp = ControlPlane(NAME)
    if cp.is_healthy():
        print(f"control plane: already running at {cp.server}")
    else:
        print("control plane: starting (building the pinned binaries first if needed)...")
        cp.start()
        print(f"control plane: up at {cp.server} in {cp.start_duration:.1f}s")
    print(_kubectl(cp, "apply", "-f", str(REPO / "crds")).strip())
    _kubectl(
        cp,
        "wait",
        "--for=condition=Established",
        "crd",
        "-l",
        "app.kubernetes.io/part-of=sandbox-operator",
        "--timeout=60s",
    )
    _start_operator(cp)
    print(_kubectl(cp, "apply", "-f", str(REPO / "examples")).strip())
    names = json.loads(_kubectl(cp, "get", "sandboxes", "-o", "json"))["items"]
    deadline = time.monotonic() + 60
    for item in names:
        name = item["metadata"]["name"]
        while True:
            body = json.loads(_kubectl(cp, "get", "sandbox", name, "-o", "json"))
            if (body.get("status") or {}).get("phase"):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"sandbox {name} got no status; see the operator log")
            time.sleep(0.5)
    print()
    print(_kubectl(cp, "get", "sandboxes", "-o", "wide"))
    print(
        _kubectl(
            cp,
            "get",
            "pods,pvc,secrets,networkpolicies,services",
            "-l",
            "app.kubernetes.io/managed-by=sandbox-operator",
        )
    )
    for item in names:
        name = item["metadata"]["name"]
        body = json.loads(_kubectl(cp, "get", "sandbox", name, "-o", "json"))
        print(f"{name}:")
        for cond in body["status"]["conditions"]:
            print(
                f"  {cond['type']:<15} {cond['status']:<6} {cond['reason']:<16} {cond['message']}"
            )
    print(
        "\nThis is the control plane only: no kubelet runs the pods, so they stay Pending.\n"
        f"Explore: export KUBECONFIG={cp.kubeconfig}; {cp.kubectl} get sandbox\n"
        "Stop:    make demo-down"
    )


def down() -> None:
    cp = ControlPlane(NAME)
    pid_file = _pid_file(cp)
    if pid_file.exists():
        pid = int(pid_file.read_text())
        try:
            os.killpg(pid, signal.SIGTERM)
            for _ in range(50):
                os.kill(pid, 0)
                time.sleep(0.2)
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        pid_file.unlink()
        print("operator: stopped")
    cp.stop(remove_state=True)
    print("control plane: stopped and removed")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("action", choices=["up", "down"])
    args = parser.parse_args()
    up() if args.action == "up" else down()


if __name__ == "__main__":
    main()
