"""Build Kubernetes components and etcd from their upstream Go modules.

Release downloads are unreachable here; the Go module proxy is not. Binaries are
cached outside the repository, keyed on the pinned versions and on the build
recipe (`RECIPE`), and reused. Each binary has a stamp file beside it saying
how it was built and how long that took; `python -m devcluster.build --report`
prints those and the cache sizes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from devcluster import phases, records, versions

log = logging.getLogger("devcluster.build")

# Bump whenever the way binaries are built changes (flags, ldflags): binaries
# stamped with another recipe are rebuilt rather than silently reused.
# 2: version ldflags (the API server reported v0.0.0-master) and -s -w.
# 3: buildDate is the release time of the module, not 1970.
RECIPE = 3


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


def _build_lock(name: str) -> contextlib.AbstractContextManager[None]:
    """Serialise builds of the same thing across processes."""
    return records.file_lock(cache_root() / f".{name}.lock")


def _go(args: list[str], cwd: Path) -> str:
    log.debug("go %s (in %s)", " ".join(args), cwd)
    proc = subprocess.run(
        ["go", *args], cwd=cwd, env=go_env(), capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"go {' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    return proc.stdout


def _kubernetes_module(kubernetes_version: str, workdir: Path) -> tuple[list[str], str]:
    """Staging modules that kubernetes' go.mod points at ./staging (unusable from
    outside), and the release time of the version (for reproducible ldflags)."""
    info = json.loads(
        _go(["mod", "download", "-json", f"k8s.io/kubernetes@{kubernetes_version}"], workdir)
    )
    gomod = Path(info["GoMod"]).read_text()
    staging = re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", gomod, re.MULTILINE)
    # `go mod download -json` has no time; the .info file beside it does.
    released = "1970-01-01T00:00:00Z"
    with contextlib.suppress(KeyError, OSError, ValueError):
        released = str(json.loads(Path(info["Info"]).read_text())["Time"])
    return sorted(set(staging)), released


def _kubernetes_ldflags(released: str) -> str:
    """What upstream's hack/lib/version.sh sets, so /version and `kubectl version`
    report the pinned release instead of v0.0.0-master (which breaks clients
    that parse the server version, e.g. kubectl's skew check and Helm)."""
    major, minor = versions.KUBERNETES.removeprefix("v").split(".")[:2]
    values = {
        "gitVersion": versions.KUBERNETES,
        "gitMajor": major,
        "gitMinor": minor,
        # The module zip carries no VCS data; say so instead of a made-up hash.
        "gitCommit": "unknown",
        "gitTreeState": "clean",
        "buildDate": released,
    }
    flags = ["-s", "-w"]  # no symbol tables or DWARF: a third smaller, as upstream ships
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X={package}.{key}={value}" for key, value in values.items()]
    return " ".join(flags)


def _stamp_path(binary: Path) -> Path:
    return binary.with_name(f".{binary.name}.build.json")


def _is_current(binary: Path) -> bool:
    """Built by this recipe (an older recipe's binary is rebuilt, not reused)."""
    try:
        stamp = json.loads(_stamp_path(binary).read_text())
    except (FileNotFoundError, ValueError):
        return False
    return binary.exists() and isinstance(stamp, dict) and stamp.get("recipe") == RECIPE


def _go_version() -> str:
    proc = subprocess.run(["go", "version"], capture_output=True, text=True, check=False)
    return proc.stdout.strip()


def _install(
    built: Path, target_dir: Path, started: float, version: str, *, patches: Sequence[str] = ()
) -> None:
    """Move freshly built binaries into place atomically (a rename per file),
    each with a stamp recording the recipe, the build time and any patches."""
    target_dir.mkdir(parents=True, exist_ok=True)
    names = sorted(binary.name for binary in built.iterdir())
    stamp: dict[str, object] = {
        "recipe": RECIPE,
        "version": version,
        **({"patches": list(patches)} if patches else {}),
        "go": _go_version(),
        "built_together": names,
        "seconds": round(time.monotonic() - started, 1),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for name in names:
        target = target_dir / name
        os.replace(built / name, target)
        _stamp_path(target).write_text(json.dumps(stamp, indent=2) + "\n")
    log.info("built %s in %.0fs", ", ".join(names), stamp["seconds"])


def kubernetes_paths(
    commands: tuple[str, ...] = versions.KUBERNETES_COMMANDS,
) -> dict[str, Path]:
    """Where the Kubernetes commands are (or will be) installed; builds nothing."""
    bin_dir = cache_root() / "bin" / f"kubernetes-{versions.KUBERNETES}"
    return {name: bin_dir / name for name in commands}


def etcd_path() -> Path:
    """Where etcd is (or will be) installed; builds nothing."""
    return cache_root() / "bin" / f"etcd-{versions.ETCD}" / "etcd"


def _all_current(wanted: Mapping[str, Path]) -> bool:
    return all(_is_current(path) for path in wanted.values())


def _cached(name: str, wanted: dict[str, Path], make: Callable[[float], None]) -> dict[str, Path]:
    """`wanted`, built by `make(started)` unless every one is current: under
    the build lock of `name`, and checked again once that is held (another
    process may have built them while this one waited for the lock)."""
    if not _all_current(wanted):
        with _build_lock(name):
            if not _all_current(wanted):
                log.info(
                    "go build %s: %s (minutes on a cold cache)", name, ", ".join(sorted(wanted))
                )
                make(time.monotonic())
    return wanted


def _fresh_dir(path: Path) -> Path:
    """An empty work dir: a crashed build's go.mod must not leak into this one."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


@dataclass(frozen=True)
class SourcePatch:
    """One edit of an upstream module's file, applied at build time to a
    copy of the module (the module cache stays as the proxy served it).

    `old` must occur exactly `count` times in the file (a new upstream
    version that changed it fails the build loudly instead of building
    something else), and every occurrence is replaced; `old=""` adds `path`
    as a new file with the content `new`. `why` is written beside the binary
    in its build stamp.
    """

    path: str
    """Relative to the module's root."""
    old: str
    new: str
    why: str
    count: int = 1


def patches_key(patches: Sequence[SourcePatch]) -> str:
    """A short hash of the patches, part of the bin directory's name: an
    edited patch is a different binary."""
    digest = hashlib.sha256()
    for patch in patches:
        digest.update(f"{patch.path}\0{patch.old}\0{patch.new}\0{patch.count}\0".encode())
    return digest.hexdigest()[:10]


def _patched_copy(module_dir: Path, target: Path, patches: Sequence[SourcePatch]) -> Path:
    """A copy of an upstream module with `patches` applied, for a `replace`
    directive. The go command refuses edits beneath GOMODCACHE (even through
    `-overlay`), so the module is copied as hard links (a second for the
    10,000 files of k8s.io/kubernetes) and patched files are written anew
    (unlinked first: a hard-linked file is the module cache's own)."""
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(module_dir), str(target)], check=True)
    written: set[Path] = set()
    for patch in patches:
        path = target / patch.path
        if patch.old:
            text = path.read_text()
            if text.count(patch.old) != patch.count:
                raise RuntimeError(
                    f"patch of {module_dir / patch.path} does not apply: the text to replace "
                    f"occurs {text.count(patch.old)} times, not {patch.count} ({patch.why})"
                )
            text = text.replace(patch.old, patch.new)
        elif path.exists():
            raise RuntimeError(f"patch adds {module_dir / patch.path}, which exists already")
        else:
            text = patch.new
        # The module cache's directories are read-only; these are copies.
        path.parent.chmod(0o755)
        if path not in written:
            path.unlink(missing_ok=True)
            written.add(path)
        path.write_text(text)
    return target


def _kubernetes_workdir(extra: str = "", name: str = "") -> tuple[Path, str]:
    """The wrapper module that builds Kubernetes commands (staging modules
    replaced by their tagged versions), and the release time for ldflags.
    `extra` go.mod lines and a `name` suffix: a wrapper of its own."""
    workdir = cache_root() / "build" / f"kubernetes-{versions.KUBERNETES}{name}"
    workdir.mkdir(parents=True, exist_ok=True)
    staging, released = _kubernetes_module(versions.KUBERNETES, workdir)
    replaces = "\n".join(
        f"replace {module} => {module} {versions.KUBERNETES_STAGING}" for module in staging
    )
    (workdir / "go.mod").write_text(
        f"module sandbox-operator.local/kubernetes-build\n\ngo 1.24.0\n\n{replaces}\n{extra}"
    )
    _go(["get", f"k8s.io/kubernetes@{versions.KUBERNETES}"], workdir)
    return workdir, released


def kubernetes_binaries(
    commands: tuple[str, ...] = versions.KUBERNETES_COMMANDS, *, build_missing: bool = True
) -> dict[str, Path]:
    """Paths of the requested Kubernetes commands, building the missing ones
    (`build_missing=False`: only where they are or will be)."""
    wanted = kubernetes_paths(commands)
    if not build_missing:
        return wanted

    def make(started: float) -> None:
        missing = [name for name, path in wanted.items() if not _is_current(path)]
        workdir, released = _kubernetes_workdir()
        packages = [f"k8s.io/kubernetes/cmd/{name}" for name in missing]
        ldflags = _kubernetes_ldflags(released)
        _build_into(workdir, packages, ldflags, wanted, started, versions.KUBERNETES)

    return _cached("kubernetes", wanted, make)


def patched_kubernetes_binary(
    command: str, patches: Sequence[SourcePatch], *, build_missing: bool = True
) -> Path:
    """A Kubernetes command built like `kubernetes_binaries` (same wrapper
    module, GOCACHE and ldflags) with `patches` applied to k8s.io/kubernetes.
    Its own bin directory, keyed on the patches."""
    key = f"{versions.KUBERNETES}-patched-{patches_key(patches)}"
    wanted = {command: cache_root() / "bin" / f"kubernetes-{key}" / command}
    if not build_missing:
        return wanted[command]

    def make(started: float) -> None:
        workdir = _fresh_dir(cache_root() / "build" / f"kubernetes-{key}")
        module_dir = Path(go_module_download("k8s.io/kubernetes", versions.KUBERNETES)["Dir"])
        _patched_copy(module_dir, workdir / "patched", patches)
        workdir, released = _kubernetes_workdir(
            "replace k8s.io/kubernetes => ./patched\n", f"-patched-{patches_key(patches)}"
        )
        _build_into(
            workdir,
            [f"k8s.io/kubernetes/cmd/{command}"],
            _kubernetes_ldflags(released),
            wanted,
            started,
            key,
            patches=patches,
        )

    return _cached(f"kubernetes-{key}", wanted, make)[command]


_ETCD_MAIN = """package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
"""


def etcd_binary() -> Path:
    wanted = {"etcd": etcd_path()}

    def make(started: float) -> None:
        workdir = _fresh_dir(cache_root() / "build" / f"etcd-{versions.ETCD}")
        (workdir / "go.mod").write_text("module sandbox-operator.local/etcd-build\n\ngo 1.24.0\n")
        # In a directory named like the command: `go build -o dir/` names the
        # binary after its package directory.
        (workdir / "etcd").mkdir()
        (workdir / "etcd" / "main.go").write_text(_ETCD_MAIN)
        _go(["get", f"go.etcd.io/etcd/server/v3@{versions.ETCD}"], workdir)
        _build_into(workdir, ["./etcd"], "-s -w", wanted, started, versions.ETCD)

    return _cached("etcd", wanted, make)["etcd"]


# ---- generic Go module builds (CSI driver and sidecars, ...) ------------------

_REPLACE_LINE = re.compile(r"^(\S+)(?:\s+(\S+))?\s+=>\s+(\S+)(?:\s+(\S+))?\s*$")


def _replace_directives(gomod: str) -> list[tuple[str, str | None, str, str | None]]:
    """`replace` directives of a go.mod (single lines and blocks), as
    (module, version or None, target, target version or None)."""
    found = []
    in_block = False
    for raw in gomod.splitlines():
        line = raw.split("//", 1)[0].strip()
        if in_block:
            if line == ")":
                in_block = False
                continue
        elif line.startswith("replace"):
            line = line.removeprefix("replace").strip()
            if line == "(":
                in_block = True
                continue
        else:
            continue
        match = _REPLACE_LINE.match(line)
        if match:
            module, version, target, target_version = match.groups()
            found.append((module, version, target, target_version))
    return found


def _go_directive(gomod: str) -> str:
    match = re.search(r"^go\s+(\S+)\s*$", gomod, re.MULTILINE)
    return match.group(1) if match else "1.24.0"


def go_module_download(module: str, version: str, workdir: Path | None = None) -> dict[str, str]:
    """`go mod download -json module@version`: where the module's zip, go.mod
    and extracted directory (`Dir`) are in the module cache. Raises with the
    proxy's answer (e.g. 403 for a version it does not serve)."""
    proc = subprocess.run(
        ["go", "mod", "download", "-json", f"{module}@{version}"],
        cwd=workdir or cache_root(),
        env=go_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    # Errors are reported in the JSON on stdout, not on stderr.
    try:
        info = json.loads(proc.stdout)
    except ValueError:
        info = {}
    if proc.returncode != 0 or not isinstance(info, dict) or "Error" in info or "Dir" not in info:
        detail = info.get("Error") if isinstance(info, dict) else None
        raise RuntimeError(f"go mod download {module}@{version}: {detail or proc.stderr.strip()}")
    return {str(key): str(value) for key, value in info.items()}


def go_module_paths(name: str, version: str, packages: Sequence[str]) -> dict[str, Path]:
    """Where `go_module_binaries` installs (or will install) each package's
    command, by command name (the package's last path element); builds nothing."""
    bin_dir = cache_root() / "bin" / f"{name}-{version}"
    return {
        package.rstrip("/").rsplit("/", 1)[-1]: bin_dir / package.rstrip("/").rsplit("/", 1)[-1]
        for package in packages
    }


def go_module_binaries(
    name: str,
    module: str,
    version: str,
    packages: Sequence[str],
    *,
    local_replaces: Mapping[str, str] | None = None,
    ldflags: str = "-s -w",
    patches: Sequence[SourcePatch] = (),
    build_missing: bool = True,
) -> dict[str, Path]:
    """Build commands of a Go module that `go install module/cmd/x@version`
    cannot build: one whose go.mod has `replace` directives (the go command
    refuses those for `go install`, and ignores them in a dependency).

    A throwaway wrapper module requires `module@version` and repeats its
    `replace` directives, so the build list is the one upstream builds with.
    A replace to a local directory (`=> ./client`, a nested module that is not
    in the module zip) is replaced by the module version `local_replaces`
    names for it. `packages` are full import paths of main packages.
    Cached like the Kubernetes binaries: same cache root, lock and recipe stamp;
    `name` and `version` key the bin directory (and a hash of `patches`,
    edits of the module's own files, when there are any). `build_missing=False`
    only says where the commands are (or will be).
    """
    key = f"{version}-patched-{patches_key(patches)}" if patches else version
    wanted = go_module_paths(name, key, packages)
    if not build_missing:
        return wanted

    def make(started: float) -> None:
        workdir = _fresh_dir(cache_root() / "build" / f"{name}-{key}")
        (workdir / "go.mod").write_text(
            f"module sandbox-operator.local/{name}-build\n\ngo 1.24.0\n"
        )
        info = go_module_download(module, version, workdir)
        upstream = Path(info["GoMod"]).read_text()
        lines = []
        for target_module, target_version, to, to_version in _replace_directives(upstream):
            source = f"{target_module} {target_version}" if target_version else target_module
            if to.startswith(("./", "../")):
                pinned = (local_replaces or {}).get(target_module)
                if pinned is None:
                    raise RuntimeError(
                        f"{module}@{version} replaces {target_module} with the local "
                        f"directory {to}; name a module version for it in local_replaces"
                    )
                lines.append(f"replace {source} => {target_module} {pinned}")
            else:
                lines.append(f"replace {source} => {to} {to_version or ''}".rstrip())
        if patches:
            _patched_copy(Path(info["Dir"]), workdir / "patched", patches)
            lines.append(f"replace {module} => ./patched")
        (workdir / "go.mod").write_text(
            f"module sandbox-operator.local/{name}-build\n\ngo {_go_directive(upstream)}\n\n"
            + "\n".join(lines)
            + "\n"
        )
        _go(["get", f"{module}@{version}"], workdir)
        _build_into(workdir, list(packages), ldflags, wanted, started, version, patches=patches)

    return _cached(name, wanted, make)


def _source_version(source: Path, requires: Mapping[str, str]) -> str:
    """A version string for in-repo Go sources: a hash of the .go files and
    the pinned requirements, so an edit rebuilds and an unchanged tree is reused."""
    digest = hashlib.sha256()
    for path in sorted(source.rglob("*.go")):
        digest.update(str(path.relative_to(source)).encode() + b"\0" + path.read_bytes() + b"\0")
    for module, version in sorted(requires.items()):
        digest.update(f"{module}@{version}\n".encode())
    return "src-" + digest.hexdigest()[:12]


# Source versions of in-repo Go commands kept in the cache: sessions on other
# branches of this repository may run another version right now (and would
# rebuild it, or fail to start it, if it were removed under them).
_SOURCE_VERSIONS_KEPT = 4


def go_source_module(name: str) -> str:
    """The module path in-repo Go sources of `name` are built as: what their
    packages import each other by (e.g. devcluster/csi's shared package)."""
    return f"sandbox-operator.local/{name}"


def go_source_binaries(
    name: str,
    source: Path,
    requires: Mapping[str, str],
    packages: Sequence[str],
    *,
    ldflags: str = "-s -w",
    build_missing: bool = True,
) -> dict[str, Path]:
    """Build main packages from Go source kept in this repository (`source`, a
    directory tree of .go files without go.mod) against pinned `requires`
    (module -> version). The go.mod (module `go_source_module(name)`) is
    generated here so that every version is a pin in versions.py; `packages`
    are paths relative to `source`. The bin directory is keyed on a hash of
    the sources and requirements; only the few most recently built source
    versions are kept. `build_missing=False` only says where they are.
    """
    version = _source_version(source, requires)
    wanted = go_module_paths(name, version, packages)
    if not build_missing:
        return wanted

    def make(started: float) -> None:
        workdir = cache_root() / "build" / name
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.copytree(source, workdir, ignore=shutil.ignore_patterns("*.md"))
        requirements = "\n".join(f"\t{module} {ver}" for module, ver in sorted(requires.items()))
        (workdir / "go.mod").write_text(
            f"module {go_source_module(name)}\n\ngo 1.24.0\n\nrequire (\n{requirements}\n)\n"
        )
        # Resolves the indirect requirements from the pinned ones (MVS); asks
        # the proxy for no "latest" of anything.
        _go(["mod", "download"], workdir)
        _build_into(
            workdir, [f"./{package}" for package in packages], ldflags, wanted, started, version
        )
        current = next(iter(wanted.values())).parent
        built = sorted(
            current.parent.glob(f"{name}-src-*"),
            key=lambda directory: directory.stat().st_mtime,
            reverse=True,
        )
        for old in built[_SOURCE_VERSIONS_KEPT:]:
            if old != current:
                shutil.rmtree(old, ignore_errors=True)

    return _cached(name, wanted, make)


def _build_into(
    workdir: Path,
    packages: list[str],
    ldflags: str,
    wanted: Mapping[str, Path],
    started: float,
    version: str,
    *,
    patches: Sequence[SourcePatch] = (),
) -> None:
    with tempfile.TemporaryDirectory(dir=workdir) as out:
        _go(["build", "-trimpath", f"-ldflags={ldflags}", "-o", out + "/", *packages], workdir)
        _install(
            Path(out),
            next(iter(wanted.values())).parent,
            started,
            version,
            patches=[f"{patch.path}: {patch.why}" for patch in patches],
        )


def binaries_current(commands: tuple[str, ...] = versions.KUBERNETES_COMMANDS) -> bool:
    """True when etcd and `commands` are built by the current recipe (no build needed)."""
    return _all_current({"etcd": etcd_path(), **kubernetes_paths(commands)})


def _du(path: Path) -> int:
    """Bytes on disk under `path` (like du -s, hard links counted once)."""
    if not path.exists():
        return 0
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                stat = os.lstat(os.path.join(root, name))
                if (stat.st_dev, stat.st_ino) not in seen:
                    seen.add((stat.st_dev, stat.st_ino))
                    total += stat.st_blocks * 512
    return total


def report() -> dict[str, object]:
    """Cache sizes and the recorded build of each binary (for docs and CI logs)."""
    root = cache_root()
    sizes = {name: _du(root / name) for name in ("bin", "gomod", "gocache", "build")}
    builds: dict[str, object] = {}
    for stamp in sorted((root / "bin").glob("*/.*.build.json")):
        with contextlib.suppress(ValueError):
            binary = stamp.parent / stamp.name[1:].removesuffix(".build.json")
            builds[str(binary)] = json.loads(stamp.read_text())
    return {"cache_root": str(root), "bytes": sizes, "builds": builds}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if "--report" in sys.argv[1:]:
        info = report()
        sizes = info["bytes"]
        assert isinstance(sizes, dict)
        for name, size in sizes.items():
            print(f"{size / 2**20:10.0f} MiB  {info['cache_root']}/{name}")
        print(json.dumps(info["builds"], indent=2))
        return
    with phases.phase("binaries: etcd, Kubernetes"):
        print(etcd_binary())
        for path in kubernetes_binaries().values():
            print(path)


if __name__ == "__main__":
    main()
