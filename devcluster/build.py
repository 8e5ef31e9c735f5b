"""Build Kubernetes components and etcd from their upstream Go modules.

Release downloads are unreachable here; the Go module proxy is not. Binaries are
cached outside the repository, keyed on the pinned versions, and reused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from devcluster import versions

log = logging.getLogger("devcluster.build")


def cache_root() -> Path:
    """Where builds and binaries live; survives between runs, never in the repo."""
    root = os.environ.get("SANDBOX_CACHE_DIR") or str(Path.home() / ".cache" / "sandbox-operator")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def go_env() -> dict[str, str]:
    root = cache_root()
    env = dict(os.environ)
    env.update(
        GOMODCACHE=str(root / "gomod"),
        GOCACHE=str(root / "gocache"),
        GOFLAGS="-mod=mod",
        # Never let the go command fetch another toolchain: only the proxy is reachable.
        GOTOOLCHAIN="local",
        CGO_ENABLED="0",
    )
    return env


@contextlib.contextmanager
def _build_lock(name: str) -> Iterator[None]:
    """Serialise builds of the same thing across processes (parallel test runs)."""
    lock_path = cache_root() / f".{name}.lock"
    with lock_path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _go(args: list[str], cwd: Path) -> str:
    log.info("go %s (in %s)", " ".join(args), cwd)
    proc = subprocess.run(
        ["go", *args], cwd=cwd, env=go_env(), capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"go {' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    return proc.stdout


def _staging_modules(kubernetes_version: str, workdir: Path) -> list[str]:
    """Modules that kubernetes' go.mod points at ./staging (unusable from outside)."""
    info = json.loads(
        _go(["mod", "download", "-json", f"k8s.io/kubernetes@{kubernetes_version}"], workdir)
    )
    gomod = Path(info["GoMod"]).read_text()
    return sorted(set(re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", gomod, re.MULTILINE)))


def _install(built: Path, target_dir: Path) -> None:
    """Move freshly built binaries into place atomically (a rename per file)."""
    target_dir.mkdir(parents=True, exist_ok=True)
    for binary in built.iterdir():
        os.replace(binary, target_dir / binary.name)


def kubernetes_binaries(
    commands: tuple[str, ...] = versions.KUBERNETES_COMMANDS,
) -> dict[str, Path]:
    """Paths of the requested Kubernetes commands, building the missing ones."""
    bin_dir = cache_root() / "bin" / f"kubernetes-{versions.KUBERNETES}"
    wanted = {name: bin_dir / name for name in commands}
    if all(path.exists() for path in wanted.values()):
        return wanted
    with _build_lock("kubernetes"):
        missing = [name for name, path in wanted.items() if not path.exists()]
        if not missing:
            return wanted
        workdir = cache_root() / "build" / f"kubernetes-{versions.KUBERNETES}"
        workdir.mkdir(parents=True, exist_ok=True)
        replaces = "\n".join(
            f"replace {module} => {module} {versions.KUBERNETES_STAGING}"
            for module in _staging_modules(versions.KUBERNETES, workdir)
        )
        (workdir / "go.mod").write_text(
            f"module sandbox-operator.local/kubernetes-build\n\ngo 1.24.0\n\n{replaces}\n"
        )
        _go(["get", f"k8s.io/kubernetes@{versions.KUBERNETES}"], workdir)
        with tempfile.TemporaryDirectory(dir=workdir) as out:
            _go(
                ["build", "-o", out + "/", *[f"k8s.io/kubernetes/cmd/{name}" for name in missing]],
                workdir,
            )
            _install(Path(out), bin_dir)
    return wanted


_ETCD_MAIN = """package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
"""


def etcd_binary() -> Path:
    bin_dir = cache_root() / "bin" / f"etcd-{versions.ETCD}"
    binary = bin_dir / "etcd"
    if binary.exists():
        return binary
    with _build_lock("etcd"):
        if binary.exists():
            return binary
        workdir = cache_root() / "build" / f"etcd-{versions.ETCD}"
        if workdir.exists():
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
        (workdir / "go.mod").write_text("module sandbox-operator.local/etcd-build\n\ngo 1.24.0\n")
        (workdir / "main.go").write_text(_ETCD_MAIN)
        _go(["get", f"go.etcd.io/etcd/server/v3@{versions.ETCD}"], workdir)
        with tempfile.TemporaryDirectory(dir=workdir) as out:
            _go(["build", "-o", out + "/etcd", "."], workdir)
            _install(Path(out), bin_dir)
    return binary


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print(etcd_binary())
    for path in kubernetes_binaries().values():
        print(path)


if __name__ == "__main__":
    main()
