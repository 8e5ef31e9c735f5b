"""gVisor on the node: `runsc` and its containerd shim, and the RuntimeClass
`gvisor` that selects them.

Both commands are built from the `gvisor.dev/gvisor` Go module (its `go`
branch, which the module proxy serves at pseudo-versions); Debian's `runsc`
package ships no shim, and a shim and a `runsc` from the same commit speak
the same command line. containerd finds a shim by its runtime type
(`io.containerd.runsc.v1` -> `containerd-shim-runsc-v1` on its PATH), so the
node gets a directory of links under those names.

Two patches. The shim lowers its own OOM score when it starts and fails the
pod when it cannot. Root on this machine lacks CAP_SYS_RESOURCE (it is not
in the bounding set), so no process may lower an oom_score_adj; containerd
itself runs with `restrict_oom_score_adj` for the same reason. The patched
shim goes on, as containerd's own runc shim does when it runs unprivileged.
And runsc refuses to take over a network namespace it believes is the
host's; it tells by the presence of /proc/sys/net/core/rmem_default, which
newer kernels (this one is 6.18) show in every namespace. The patched
test compares it with the namespace runsc started in (init's is not
readable to runsc).

Platform: systrap, gVisor's default at this commit and the only one that
runs on this machine: the KVM platform hangs at boot on its paravirtual KVM
(kvm-pvm, no hardware virtualization) and ptrace panics on its kernel
(`benchmarks/gvisor_platforms.py` shows both). Networking: gVisor's own network stack
inside the pod's network namespace, so CNI, NetworkPolicy and Services work
as for runc pods.

Containers of one pod share one gVisor kernel, but each bind mount of a pod
volume is its own filesystem in it: a Unix socket bound by one container
(the sandbox's runner) would be invisible to the other (the agent). With
`host-uds=all` the socket is created on the host file and the other
container connects through it; only sockets inside the pod's own mounts are
reachable that way.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from devcluster import build, versions

RUNTIME_CLASS = "gvisor"
"""What pods name in `runtimeClassName`."""
HANDLER = "runsc"
"""The containerd runtime (CRI handler) the RuntimeClass points at."""
SHIM = "containerd-shim-runsc-v1"

_MODULE = "gvisor.dev/gvisor"

PATCHES = (
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
        "runsc/sandbox/network.go",
        """func isRootNS() (bool, error) {
\terr := unix.Access("/proc/sys/net/core/rmem_default", unix.F_OK)
\tswitch err {
\tcase nil:
\t\treturn true, nil
\tcase unix.ENOENT:
\t\treturn false, nil
\tdefault:
\t\treturn false, fmt.Errorf("failed to access /proc/sys/net/core/rmem_default: %v", err)
\t}
}""",
        """func isRootNS() (bool, error) {
\t// devcluster: the namespace of this thread against the one runsc started in.
\tif startNetNSErr != nil {
\t\treturn false, fmt.Errorf("stat of runsc's own net namespace: %v", startNetNSErr)
\t}
\tvar self unix.Stat_t
\tif err := unix.Stat("/proc/thread-self/ns/net", &self); err != nil {
\t\treturn false, fmt.Errorf("stat of this thread's net namespace: %v", err)
\t}
\treturn self.Dev == startNetNS.Dev && self.Ino == startNetNS.Ino, nil
}""",
        "newer kernels show /proc/sys/net/core/rmem_default in every network "
        "namespace, so upstream's test took every pod's namespace for the host's",
    ),
    build.SourcePatch(
        "runsc/sandbox/devcluster_netns.go",
        "",
        """package sandbox

import "golang.org/x/sys/unix"

// The network namespace runsc started in (the host's, when the shim runs it),
// read before any thread joins another. /proc/1/ns/net is not readable here.
// Added by sandbox-operator's devcluster at build time.
var startNetNS unix.Stat_t
var startNetNSErr = unix.Stat("/proc/self/ns/net", &startNetNS)
""",
        "the namespace runsc started in, for isRootNS",
    ),
)


def binaries(*, build_missing: bool = True) -> dict[str, Path]:
    """`runsc` and the shim (as `containerd-shim-runsc-v1`), built when missing."""
    built = build.go_module_binaries(
        "gvisor",
        _MODULE,
        versions.GVISOR,
        [f"{_MODULE}/runsc", f"{_MODULE}/shim"],
        patches=PATCHES,
        build_missing=build_missing,
    )
    return {"runsc": built["runsc"], SHIM: built["shim"]}


def link_commands(bin_dir: Path, built: Mapping[str, Path]) -> Path:
    """A directory with `runsc` and `containerd-shim-runsc-v1` under the names
    containerd looks for; goes first on containerd's PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in ("runsc", SHIM):
        link = bin_dir / name
        link.unlink(missing_ok=True)
        link.symlink_to(built[name])
    return bin_dir


def runsc_config(*, runsc: Path, root: Path, log_dir: Path) -> str:
    """The shim's options file (TOML): which runsc, where its state and the
    shims' logs go."""
    return f"""# Written by devcluster/gvisor.py.
binary_name = "{runsc}"
root = "{root}"
log_path = "{log_dir}/shim-%ID%.log"
log_level = "info"

[runsc_config]
platform = "systrap"
host-uds = "all"
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
