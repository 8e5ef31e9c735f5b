"""gVisor on the node: `runsc` and its containerd shim, and the RuntimeClass
`gvisor` that selects them.

Both commands are built from the `gvisor.dev/gvisor` Go module (its `go`
branch, which the module proxy serves at pseudo-versions); Debian's `runsc`
package ships no shim. They come from two commits (versions.py): the shim
from one that still speaks containerd 1.6's start protocol, runsc from a
recent one, which checkpoints and restores pods of several containers. The
shim drives runsc by its command line, which both commits share. containerd
finds a shim by its runtime type (`io.containerd.runsc.v1` ->
`containerd-shim-runsc-v1` on its PATH), so the node gets a directory of
links under those names. The shim runs runsc through sandbox-runsc
(sandbox-node/), which restores a pod from the node's checkpoint store when
the pod asks for it (docs/pause-memory.md).

Two patches of the shim. It lowers its own OOM score when it starts and
fails the pod when it cannot. Root on this machine lacks CAP_SYS_RESOURCE
(it is not in the bounding set), so no process may lower an oom_score_adj;
containerd itself runs with `restrict_oom_score_adj` for the same reason.
The patched shim goes on, as containerd's own runc shim does when it runs
unprivileged. And it finds a pod's volumes under /var/lib/kubelet/pods,
where this node's kubelet (one per cluster, each with its own root
directory) keeps none: the patched shim reads the directory from
KUBELET_PODS_DIR when set.

Platform: systrap, gVisor's default at this commit and the only one that
runs on this machine: the KVM platform hangs at boot on its paravirtual KVM
(kvm-pvm, no hardware virtualization) and ptrace panics on its kernel
(`benchmarks/gvisor_platforms.py` shows both). Networking: gVisor's own network stack
inside the pod's network namespace, so CNI, NetworkPolicy and Services work
as for runc pods.

Containers of one pod share one gVisor kernel, but each bind mount of a pod
volume is its own filesystem in it: a Unix socket bound by one container
(the sandbox's runner) would be invisible to the other (the agent). The
operator annotates its pods so that the volume holding that socket is one
tmpfs of the pod inside the sandbox (`dev.gvisor.spec.mount.<volume>.*`,
which containerd passes on as `pod_annotations` and the shim completes).
Sockets then stay inside gVisor, where a checkpoint can save them; runsc's
`host-uds`, which made them host sockets, would make every checkpoint fail
("cannot save endpoint with bound host socket").
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

from devcluster import build, versions

RUNTIME_CLASS = "gvisor"
"""What pods name in `runtimeClassName`."""
HANDLER = "runsc"
"""The containerd runtime (CRI handler) the RuntimeClass points at."""
SHIM = "containerd-shim-runsc-v1"

_MODULE = "gvisor.dev/gvisor"

SHIM_PATCHES = (
    build.SourcePatch(
        "pkg/shim/service.go",
        "\tif err := shim.SetScore(cmd.Process.Pid); err != nil {\n"
        '\t\treturn "", fmt.Errorf("failed to set OOM Score on shim: %w", err)\n'
        "\t}",
        "\t_ = shim.SetScore(cmd.Process.Pid) // devcluster: no CAP_SYS_RESOURCE here",
        # Dropped without a word: containerd reads all the start command
        # prints as the shim's address (a warning there failed every pod).
        "root here lacks CAP_SYS_RESOURCE: the shim cannot lower its OOM score, "
        "which must not fail every gVisor pod",
    ),
    build.SourcePatch(
        "pkg/shim/utils/volumes.go",
        'var kubeletPodsDir = "/var/lib/kubelet/pods"',
        'var kubeletPodsDir = kubeletPodsDirFromEnv("/var/lib/kubelet/pods")',
        "each devcluster kubelet has its own root directory",
    ),
    build.SourcePatch(
        "pkg/shim/utils/devcluster_volumes.go",
        "",
        """package utils

import "os"

// The kubelet's pods directory, from KUBELET_PODS_DIR when set.
// Added by sandbox-operator's devcluster at build time.
func kubeletPodsDirFromEnv(fallback string) string {
\tif dir := os.Getenv("KUBELET_PODS_DIR"); dir != "" {
\t\treturn dir
\t}
\treturn fallback
}
""",
        "KUBELET_PODS_DIR for the shim's volume annotations",
    ),
)

KUBELET_PODS_DIR_ENV = "KUBELET_PODS_DIR"
"""Where the patched shim looks for a pod's volumes (containerd's environment)."""


SANDBOX_RUNSC = "sandbox-runsc"
CHECKPOINT = "sandbox-checkpoint"
CHECKPOINTD = "checkpointd"
_SANDBOX_NODE_SOURCE = Path(__file__).resolve().parent.parent / "sandbox-node"


def binaries(*, build_missing: bool = True) -> dict[str, Path]:
    """`runsc`, the shim (as `containerd-shim-runsc-v1`), and sandbox-node's
    `sandbox-runsc` and `sandbox-checkpoint`, built when missing."""
    runsc = build.go_module_binaries(
        "gvisor", _MODULE, versions.GVISOR, [f"{_MODULE}/runsc"], build_missing=build_missing
    )
    shim = build.go_module_binaries(
        "gvisor-shim",
        _MODULE,
        versions.GVISOR_SHIM,
        [f"{_MODULE}/shim"],
        patches=SHIM_PATCHES,
        build_missing=build_missing,
    )
    return {"runsc": runsc["runsc"], SHIM: shim["shim"], **node_binaries(build_missing)}


def node_binaries(build_missing: bool = True) -> dict[str, Path]:
    """sandbox-node's `sandbox-runsc`, `sandbox-checkpoint` and `checkpointd`
    (Go, standard library only: seconds to build)."""
    return build.go_source_binaries(
        "sandbox-node",
        _SANDBOX_NODE_SOURCE,
        {},
        [SANDBOX_RUNSC, CHECKPOINT, CHECKPOINTD],
        build_missing=build_missing,
    )


def link_commands(bin_dir: Path, built: Mapping[str, Path]) -> Path:
    """A directory with `runsc` and `containerd-shim-runsc-v1` under the names
    containerd looks for (goes first on containerd's PATH), and a copy of
    `sandbox-runsc`, the shims' runsc (`runsc_config`).

    The copy, not the build: the build cache keeps a few builds of
    sandbox-node's sources, and the shims of pods that run when a rebuilt one
    is installed go on calling the path they started with; a pruned build
    would fail their every call, the deletion of their containers included.
    Replaced by rename, so a call under way keeps the file it started."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in ("runsc", SHIM):
        link = bin_dir / name
        link.unlink(missing_ok=True)
        link.symlink_to(built[name])
    installing = bin_dir / f".{SANDBOX_RUNSC}.new"
    shutil.copy2(built[SANDBOX_RUNSC], installing)
    installing.replace(bin_dir / SANDBOX_RUNSC)
    return bin_dir


def containerd_env(*, runsc: Path, checkpoints: Path, kubelet_root_dir: Path) -> dict[str, str]:
    """What containerd passes on to the shim and sandbox-runsc."""
    return {
        "SANDBOX_RUNSC": str(runsc),
        "SANDBOX_CHECKPOINTS": str(checkpoints),
        KUBELET_PODS_DIR_ENV: str(kubelet_root_dir / "pods"),
    }


def runsc_config(*, sandbox_runsc: Path, root: Path, log_dir: Path) -> str:
    """The shim's options file (TOML): which runsc (sandbox-runsc, which runs
    the real one), where its state and the shims' logs go."""
    return f"""# Written by devcluster/gvisor.py.
binary_name = "{sandbox_runsc}"
root = "{root}"
log_path = "{log_dir}/shim-%ID%.log"
log_level = "info"

[runsc_config]
platform = "systrap"
# A restored pod's specs differ from the checkpointed pod's where they must
# (the pod UID in its cgroup path): compare, log differences, restore anyway.
# The operator restores an image only into the pod shape it was taken from.
restore-spec-validation = "warning"
# No debug-log: runsc writes one file per command it is run for, and containerd
# runs `runsc events` every 10 s per container. Add `debug-log = "<dir>/%ID%/"`
# here to see them.
"""


def containerd_runtime(cri: str, config_path: Path) -> str:
    """The CRI runtime entry of containerd's config for HANDLER."""
    return f"""
    # gVisor (devcluster/gvisor.py): pods with runtimeClassName {RUNTIME_CLASS!r}.
    [{cri}.containerd.runtimes.{HANDLER}]
      runtime_type = "io.containerd.runsc.v1"
      # Into the OCI specs, for the shim (volume sharing) and sandbox-runsc.
      pod_annotations = ["dev.gvisor.spec.mount.*", "sandbox.dev/restore-from"]

      [{cri}.containerd.runtimes.{HANDLER}.options]
        TypeUrl = "io.containerd.runsc.v1.options"
        ConfigPath = "{config_path}"
"""


def runtime_class() -> dict[str, object]:
    return {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {
            "name": RUNTIME_CLASS,
            "labels": {"app.kubernetes.io/managed-by": "devcluster"},
        },
        "handler": HANDLER,
    }
