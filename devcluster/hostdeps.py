"""Debian packages the node tier needs on the host, checked and installed idempotently.

The node tier runs containerd, runc and the CNI plugins from Debian, builds
images with mmdebstrap and compiles the pause program with gcc. Machines of
this project are handed out fresh, so nothing installed by hand survives:
`ensure()` is called on every node-cluster start (a dpkg query when all is
there, about 20 ms) and by `make` through `python -m devcluster.hostdeps`.

Only Debian's own packages are used: no other registry serves these.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from devcluster import records

log = logging.getLogger("devcluster.hostdeps")

# Package -> a file it installs that the node tier calls (checked as well as
# the dpkg status: a half-removed package can leave the status "installed").
PACKAGES: dict[str, str] = {
    # Container runtime (1.6 on bookworm: CRI v1, config version 2).
    "containerd": "/usr/bin/containerd",
    "runc": "/usr/sbin/runc",
    # bridge, host-local, loopback, portmap in /usr/lib/cni.
    "containernetworking-plugins": "/usr/lib/cni/bridge",
    # portmap programs iptables; stop() reads iptables-save to verify cleanup.
    "iptables": "/usr/sbin/iptables-save",
    # `nft`: kube-proxy's nftables mode runs it; stop() lists and deletes
    # the cluster's tables with it.
    "nftables": "/usr/sbin/nft",
    # `ip` for the pod bridge.
    "iproute2": "/usr/sbin/ip",
    # Root filesystems of the locally built images.
    "mmdebstrap": "/usr/bin/mmdebstrap",
    # The pause image's program is compiled statically from C here.
    "gcc": "/usr/bin/gcc",
    "libc6-dev": "/usr/lib/x86_64-linux-gnu/libc.a",
}


class HostDepsError(RuntimeError):
    """A required Debian package is missing and could not be installed."""


def _installed(package: str) -> bool:
    proc = subprocess.run(
        ["dpkg-query", "-W", "-f=${db:Status-Status}", package],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.returncode == 0 and proc.stdout.strip() == "installed"


def missing(packages: dict[str, str] | None = None) -> list[str]:
    """Packages of `packages` (default: all the node tier needs) not usable now."""
    wanted = PACKAGES if packages is None else packages
    return [name for name, path in wanted.items() if not (_installed(name) and Path(path).exists())]


def _apt(args: Sequence[str]) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    proc = subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise HostDepsError(
            f"apt-get {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )


def ensure(packages: dict[str, str] | None = None) -> list[str]:
    """Install whatever of `packages` is missing; returns what was installed.

    Runs `apt-get update` first (a fresh machine's lists may be empty or old),
    but only when something is missing. Needs root, like the node tier itself.
    A lock serialises concurrent callers (parallel test sessions).
    """
    if not missing(packages):
        return []
    if shutil.which("apt-get") is None:
        raise HostDepsError(f"missing Debian packages {missing(packages)} and no apt-get here")
    if os.geteuid() != 0:
        raise HostDepsError(f"missing Debian packages {missing(packages)}; installing needs root")
    with records.file_lock(Path("/run/lock/devcluster-hostdeps.lock")):
        todo = missing(packages)
        if not todo:
            return []
        log.info("installing Debian packages: %s", " ".join(todo))
        _apt(["update"])
        # --reinstall too: a package whose status says installed but whose
        # files are gone (see PACKAGES) is fixed only by reinstalling it.
        _apt(["install", "-y", "--no-install-recommends", "--reinstall", *todo])
        still = missing(packages)
        if still:
            raise HostDepsError(f"still missing after apt-get install: {still}")
        return todo


# Kernel limits a node needs more of than a stock host gives. Every containerd
# (its CNI config monitor), kubelet and CSI sidecar holds inotify instances;
# Debian's 128 per user ran out with three node clusters on the machine (a
# test's own beside the session's and `make up`'s): containerd then started
# without its CRI plugin ("too many open files") and never became ready.
HOST_LIMITS = {
    "/proc/sys/fs/inotify/max_user_instances": 8192,
    "/proc/sys/fs/inotify/max_user_watches": 1048576,
}


def raise_limits(limits: dict[str, int] | None = None) -> dict[str, int]:
    """Raise each limit below its value (never lower one); returns what changed."""
    changed: dict[str, int] = {}
    for path, wanted in (HOST_LIMITS if limits is None else limits).items():
        current = int(Path(path).read_text().split()[0])
        if current < wanted:
            Path(path).write_text(f"{wanted}\n")
            changed[path] = wanted
            log.info("raised %s from %d to %d", path, current, wanted)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devcluster.hostdeps",
        description="Check (and install with apt-get) the Debian packages the local "
        "node cluster needs: " + ", ".join(PACKAGES),
    )
    parser.add_argument(
        "--check", action="store_true", help="only report; exit 1 if something is missing"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.check:
        absent = missing()
        for name in absent:
            print(f"missing: {name}")
        return 1 if absent else 0
    try:
        installed = ensure()
    except HostDepsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print("installed: " + " ".join(installed) if installed else "all present")
    return 0


if __name__ == "__main__":
    sys.exit(main())
