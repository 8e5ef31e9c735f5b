"""Helm, built from its Go module at the pinned version, and the chart install.

Release downloads are unreachable here, so `helm` is built like the
Kubernetes binaries (same cache, lock and recipe stamps). Users install the
chart the same way: `helm upgrade --install` of charts/sandbox-operator.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from devcluster import build, phases, versions

HELM_VERSION = versions.HELM
HELM_MODULE = versions.HELM_MODULE


def helm_binary(*, build_missing: bool = True) -> Path:
    """The pinned helm, building it on first use (a minute or two on 2 cores)."""
    return build.go_module_binaries(
        "helm",
        HELM_MODULE,
        HELM_VERSION,
        [f"{HELM_MODULE}/cmd/helm"],
        ldflags=f"-s -w -X helm.sh/helm/v3/internal/version.version={HELM_VERSION}",
        build_missing=build_missing,
    )["helm"]


def install_chart(
    kubeconfig: Path,
    chart: Path,
    *,
    release: str = "sandbox-operator",
    namespace: str = "sandbox-system",
    values: list[str] | None = None,
    string_values: list[str] | None = None,
    timeout: str = "5m",
) -> str:
    """`helm upgrade --install --wait` of the chart; returns helm's output."""
    argv = [
        str(helm_binary()),
        "upgrade",
        "--install",
        release,
        str(chart),
        f"--kubeconfig={kubeconfig}",
        "--namespace",
        namespace,
        "--create-namespace",
        "--wait",
        f"--timeout={timeout}",
    ]
    for value in values or []:
        argv += ["--set", value]
    # --set turns "6443" into a number; env values and the like must stay strings.
    for value in string_values or []:
        argv += ["--set-string", value]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"helm install failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def uninstall_chart(
    kubeconfig: Path, *, release: str = "sandbox-operator", namespace: str = "sandbox-system"
) -> None:
    subprocess.run(
        [
            str(helm_binary()),
            "uninstall",
            release,
            f"--kubeconfig={kubeconfig}",
            "--namespace",
            namespace,
            "--ignore-not-found",
            "--wait",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


if __name__ == "__main__":
    # `make binaries`: a phase of CI's table when SANDBOX_CI_PHASES is set.
    with phases.phase("binaries: helm"):
        print(helm_binary())
