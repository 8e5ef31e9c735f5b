"""Container images for the local node cluster, built here: no registry is reachable.

Each image is one layer: a Debian root filesystem from `mmdebstrap` (the
host's configured Debian mirror), plus the project's Python packages installed
with pip into `/opt/<name>` and small launcher scripts. The layer is turned
into an OCI image layout archive in Python (layer tar.gz, config, manifest,
index.json, oci-layout) and imported into the node's containerd with
`ctr images import`. The pause image holds one statically linked C program.

Archives are cached under `<cache root>/images/`, keyed by a hash of their
inputs (recipe, package list, Debian sources, the project files they
install), so an unchanged image is built once. Dependencies that pip
resolves from PyPI are not pinned by that key: delete the cache to pick up
newer ones.

Images are imported under the name containerd's CRI plugin resolves a pod's
`image:` to (`sandbox-agent:dev` -> `docker.io/library/sandbox-agent:dev`),
and pods must use `imagePullPolicy: IfNotPresent` or `Never` (`:dev` tags
default to IfNotPresent): a pull would fail.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gzip
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from devcluster import build, gvisor, netbuild, records, versions

log = logging.getLogger("devcluster.images")

# Bump when the way images are built changes: cached archives of another
# recipe are rebuilt.
RECIPE = 1
REPO = Path(__file__).resolve().parent.parent
# Our C programs (`<name>.c`), compiled statically: the pause image's, and
# those an ImageSpec names in `programs`.
PROGRAMS_DIR = Path(__file__).resolve().parent
PAUSE_SOURCE = PROGRAMS_DIR / "pause.c"

# The pod sandbox image (containerd's `sandbox_image`). A `localhost/` name:
# this is not upstream's pause binary and must never look like it could be pulled.
PAUSE = "localhost/devcluster/pause:1"
# CoreDNS (devcluster/netstack.py): the static binary alone, like upstream's
# image (FROM scratch). A `localhost/` name: built here, never pulled.
COREDNS = "localhost/devcluster/coredns:1"


def _checkpointd_binary(*, build_missing: bool) -> Path:
    return gvisor.node_binaries(build_missing)[gvisor.CHECKPOINTD]


# Static binaries an image can consist of, by the name ImageSpec.binary gives.
_BINARIES: dict[str, Callable[..., Path]] = {
    "coredns": netbuild.coredns_binary,
    "checkpointd": _checkpointd_binary,
}
# Superseded archives younger than this are kept: another session may be importing one.
STALE_ARCHIVE_SECONDS = 3600

# Users present in every Debian image, so that tools that look the current
# user up (git, ssh, getpass) work under the UIDs the operator runs pods with
# (operator/sandbox_operator/config.py: sandbox 1000, agent 1001; 65532 is the
# operator's own and the conventional "nonroot").
_USERS = (
    ("sandbox", 1000, 1000, "/home/sandbox"),
    ("agent", 1001, 1000, "/home/agent"),
    ("nonroot", 65532, 65532, "/home/nonroot"),
)
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Documentation, manuals and translations are dead weight in a container.
_DPKG_EXCLUDES = (
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
    "path-exclude=/usr/share/lintian/*",
)


@dataclass(frozen=True)
class PipProject:
    """A Python project of this repository installed into an image with its dependencies."""

    name: str
    """Directory name under /opt in the image."""
    root: str
    """The project's directory, relative to the repository."""
    files: tuple[str, ...]
    """Paths relative to `root` that make up the project (copied to build its
    wheel, and hashed for the cache key)."""
    launchers: tuple[tuple[str, str], ...] = ()
    """(command, "module:function") written as /usr/local/bin/<command>."""
    extras: tuple[str, ...] = ()
    """Optional dependency groups installed with it."""


@dataclass(frozen=True)
class ImageSpec:
    name: str
    """As pods name it, e.g. `sandbox-agent:dev`."""
    packages: tuple[str, ...] = ()
    variant: str = "apt"
    """mmdebstrap variant; `minbase` for an image without apt."""
    pip: tuple[PipProject, ...] = ()
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = (f"PATH={_PATH}",)
    user: str = ""
    workdir: str = "/"
    pause: bool = False
    """The pause image: a static binary, no Debian."""
    binary: str = ""
    """An image of one static Go binary of ours (a key of `_BINARIES`) at
    /<binary>, no Debian."""
    labels: dict[str, str] = field(default_factory=dict)
    install_recommends: bool = True
    """False: only what the packages depend on (the scientific Python stack
    recommends compilers and BLAS headers: a gigabyte)."""
    users: tuple[tuple[str, int, int, str], ...] | None = None
    """(name, uid, gid, home) added to /etc/passwd; None: `_USERS`."""
    programs: tuple[str, ...] = ()
    """C programs of devcluster/ (`<name>.c`), compiled statically to
    /usr/local/bin/<name>."""

    @property
    def reference(self) -> str:
        return reference(self.name)


def reference(name: str) -> str:
    """The fully qualified name containerd's CRI plugin resolves `name` to
    (Docker's normalisation: no registry -> docker.io, no path -> library/)."""
    if "@" not in name and ":" not in name.rsplit("/", 1)[-1]:
        name += ":latest"
    first, _, rest = name.partition("/")
    if not rest:
        return f"docker.io/library/{name}"
    if "." in first or ":" in first or first == "localhost":
        return name
    return f"docker.io/{name}"


AGENT = PipProject(
    "sandbox-agent",
    "sandbox-agent",
    ("pyproject.toml", "src"),
    (("sandbox-agent", "sandbox_agent.server:main"),),
)


def _runtime(
    name: str,
    packages: tuple[str, ...],
    cmd: str,
    *,
    variant: str = "apt",
    install_recommends: bool = True,
) -> ImageSpec:
    """A sandbox runtime image: what the `sandbox` container of a pod runs,
    as the sandbox user (operator/sandbox_operator/config.py) in its home."""
    return ImageSpec(
        f"sandbox-runtime-{name}:dev",
        packages=packages,
        variant=variant,
        install_recommends=install_recommends,
        cmd=(cmd,),
        user="1000:1000",
        workdir="/home/sandbox",
    )


_OPERATOR = PipProject(
    "sandbox-operator",
    ".",
    ("pyproject.toml", "README.md", "operator"),
    (("kopf", "kopf.cli:main"), ("sandbox-gateway", "sandbox_operator.gateway.__main__:main")),
)

# The SDK with its MCP server, in the operator's image for the chart's mcp Deployment.
_SDK = PipProject(
    "sandbox-sdk",
    "sandbox-sdk",
    ("pyproject.toml", "README.md", "src"),
    (("sandbox-mcp", "sandbox_mcp.__main__:main"),),
    extras=("mcp",),
)

# The python runtime: with a Jupyter kernel for code contexts (run_code), and
# the two libraries code-interpreter users reach for first (figures, tables).
_PYTHON_PACKAGES = (
    "python3",
    "git",
    "curl",
    "ca-certificates",
    "python3-ipykernel",
    "python3-jupyter-client",
    "python3-matplotlib",
    "python3-pandas",
    # fonttools (matplotlib's) depends on "scipy | munkres": scipy
    # brings pythran, g++ and the boost headers (600 MiB)
    "python3-munkres",
    # what git recommends, named: recommends are off for this image
    "less",
    "openssh-client",
    "patch",
)

IMAGES: dict[str, ImageSpec] = {
    spec.name: spec
    for spec in (
        ImageSpec(
            PAUSE,
            pause=True,
            entrypoint=("/pause",),
            env=(),
            # The conventional pause UID: no privileges needed to sleep.
            user="65535:65535",
        ),
        ImageSpec(
            COREDNS,
            binary="coredns",
            entrypoint=("/coredns",),
            env=(),
            user="65532:65532",
        ),
        ImageSpec(
            # The chart's checkpointd DaemonSet (sandbox-node/; runs as root:
            # the gVisor sandboxes' control sockets are root's).
            "sandbox-checkpointd:dev",
            binary="checkpointd",
            entrypoint=("/checkpointd",),
            env=(),
        ),
        ImageSpec(
            "sandbox-agent:dev",
            packages=("python3",),
            pip=(AGENT,),
            # Listening within a millisecond of the container's start, before
            # the interpreter and the agent's imports: the kubelet probes the
            # agent as soon as it sees the container running.
            programs=("listen-first",),
            entrypoint=("/usr/local/bin/listen-first", "/usr/local/bin/sandbox-agent"),
            user="65532:65532",
        ),
        _runtime("python", _PYTHON_PACKAGES, "python3", install_recommends=False),
        _runtime("node", ("nodejs", "npm", "python3", "ca-certificates"), "node"),
        # E2B's `base` and `code-interpreter-v1` templates: what E2B users' code
        # expects of a sandbox (user `user` in /home/user, python and node, the
        # code interpreter's kernel and libraries).
        ImageSpec(
            "sandbox-runtime-e2b:dev",
            packages=(*_PYTHON_PACKAGES, "python-is-python3", "nodejs"),
            install_recommends=False,
            cmd=("python3",),
            user="1000:1000",
            workdir="/home/user",
            users=(("user", 1000, 1000, "/home/user"), *_USERS[1:]),
        ),
        # For the negative test: a runtime the sandbox runner cannot run in.
        _runtime("nopython", (), "/bin/sh", variant="minbase"),
        ImageSpec(
            "sandbox-operator:dev",
            packages=("python3", "ca-certificates"),
            pip=(_OPERATOR, _SDK),
            entrypoint=("/usr/local/bin/kopf",),
            cmd=("run", "-m", "sandbox_operator", "--standalone", "--all-namespaces"),
            user="65532:65532",
        ),
    )
}


class ImageError(RuntimeError):
    """An image could not be built or imported; the message says which step failed."""


# ---- cache -----------------------------------------------------------------------


def images_dir() -> Path:
    path = build.cache_root() / "images"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _debian_sources() -> list[Path]:
    """The host's apt sources files for the images' suite (the mirror to build from)."""
    candidates = [Path("/etc/apt/sources.list")]
    directory = Path("/etc/apt/sources.list.d")
    if directory.is_dir():
        candidates += sorted(directory.glob("*.sources")) + sorted(directory.glob("*.list"))
    found = []
    for path in candidates:
        with contextlib.suppress(OSError):
            lines = [
                line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")
            ]
            if any(versions.DEBIAN_SUITE in line for line in lines):
                found.append(path)
    return found


def _project_files(project: PipProject) -> Iterator[Path]:
    """Files of the project, relative to its root."""
    root = REPO / project.root
    for relative in project.files:
        path = root / relative
        if path.is_file():
            yield path.relative_to(root)
        elif path.is_dir():
            for file in sorted(path.rglob("*")):
                parts = set(file.relative_to(root).parts)
                junk = parts & {"__pycache__", ".mypy_cache", "build"} or any(
                    part.endswith(".egg-info") for part in parts
                )
                if file.is_file() and not junk:
                    yield file.relative_to(root)
        else:
            raise ImageError(f"{project.name}: {path} does not exist")


def cache_key(spec: ImageSpec) -> str:
    digest = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        digest.update(label.encode() + b"\0" + hashlib.sha256(data).digest())

    add("recipe", str(RECIPE).encode())
    spec_fields = asdict(spec)
    if spec.install_recommends:
        del spec_fields["install_recommends"]  # the default keeps older images' keys
    if spec.users is None:
        del spec_fields["users"]  # likewise
    if not spec.programs:
        del spec_fields["programs"]  # likewise
    add("spec", json.dumps(spec_fields, sort_keys=True, default=str).encode())
    add("suite", f"{versions.DEBIAN_SUITE} {versions.DEBIAN_PYTHON}".encode())
    for program in spec.programs:
        add(f"{program}.c", program_source(program).read_bytes())
    if spec.pause:
        add("pause.c", PAUSE_SOURCE.read_bytes())
    elif spec.binary:
        # The bin directory is keyed on the pinned version and our sources.
        add("binary", str(_BINARIES[spec.binary](build_missing=True)).encode())
    else:
        add("excludes", "\n".join(_DPKG_EXCLUDES).encode())
        for source in _debian_sources():
            add(str(source), source.read_bytes())
    for project in spec.pip:
        for file in _project_files(project):
            add(f"{project.root}/{file}", (REPO / project.root / file).read_bytes())
    return digest.hexdigest()[:16]


def _slug(name: str) -> str:
    return name.replace("/", "_").replace(":", "_")


@dataclass(frozen=True)
class BuiltImage:
    """An OCI archive in the cache and what `ctr import` will make of it."""

    name: str
    reference: str
    archive: Path
    manifest_digest: str
    layer_bytes: int
    """Compressed size of the image's one layer."""
    rootfs_bytes: int
    """Uncompressed size (the layer tar)."""
    build_seconds: float


def _paths(spec: ImageSpec) -> tuple[Path, Path]:
    stem = f"{_slug(spec.name)}-{cache_key(spec)}"
    return images_dir() / f"{stem}.oci.tar", images_dir() / f"{stem}.json"


def cached(spec: ImageSpec) -> BuiltImage | None:
    archive, meta = _paths(spec)
    if not archive.exists():
        return None
    try:
        return records.load(BuiltImage, meta)
    except (FileNotFoundError, ValueError):
        return None


def _lock(name: str) -> contextlib.AbstractContextManager[None]:
    return records.file_lock(images_dir() / f".{_slug(name)}.lock")


def ensure_built(spec: ImageSpec) -> BuiltImage:
    """The cached archive of `spec`, built first if its inputs changed."""
    found = cached(spec)
    if found is not None:
        return found
    with _lock(spec.name):
        found = cached(spec)
        if found is not None:
            return found
        archive, meta = _paths(spec)
        began = time.monotonic()
        log.info("building image %s", spec.name)
        with tempfile.TemporaryDirectory(dir=images_dir(), prefix=".build-") as tmp:
            work = Path(tmp)
            rootfs_tar = work / "rootfs.tar"
            if spec.pause:
                _pause_rootfs(work, rootfs_tar)
            elif spec.binary:
                _binary_rootfs(_BINARIES[spec.binary](build_missing=True), rootfs_tar)
            else:
                _debian_rootfs(spec, work, rootfs_tar)
            built_archive = work / "image.oci.tar"
            digest, layer_bytes, rootfs_bytes = _write_oci_archive(spec, rootfs_tar, built_archive)
            os.replace(built_archive, archive)
        image = BuiltImage(
            name=spec.name,
            reference=spec.reference,
            archive=archive,
            manifest_digest=digest,
            layer_bytes=layer_bytes,
            rootfs_bytes=rootfs_bytes,
            build_seconds=round(time.monotonic() - began, 1),
        )
        records.save(image, meta)
        # Older archives of the same image are only disk space now, unless another
        # session on this machine built one of them moments ago and is importing it.
        for old in images_dir().glob(f"{_slug(spec.name)}-*"):
            with contextlib.suppress(FileNotFoundError):
                recent = time.time() - old.stat().st_mtime < STALE_ARCHIVE_SECONDS
                if old not in (archive, meta) and not recent:
                    old.unlink()
        log.info(
            "built %s in %.0fs: layer %.0f MiB (rootfs %.0f MiB)",
            spec.name,
            image.build_seconds,
            layer_bytes / 2**20,
            rootfs_bytes / 2**20,
        )
        return image


# ---- root filesystems ------------------------------------------------------------


def _run(
    argv: Sequence[str],
    *,
    what: str,
    timeout: float = 1200.0,
    level: int = logging.INFO,
    **kwargs: object,
) -> str:
    log.log(level, "%s", what)
    log.debug("%s: %s", what, " ".join(argv))
    try:
        proc = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            **kwargs,  # type: ignore[call-overload]
        )
    except subprocess.TimeoutExpired as error:
        raise ImageError(f"{what}: timed out after {timeout:.0f}s") from error
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr)[-4000:]
        raise ImageError(f"{what} failed (exit {proc.returncode}):\n{output}")
    return str(proc.stdout)


def program_source(name: str) -> Path:
    return PROGRAMS_DIR / f"{name}.c"


def compile_static(source: Path, binary: Path) -> None:
    """A C program of ours as a static binary: it runs in any image, or alone."""
    _run(
        ["gcc", "-static", "-Os", "-s", "-Wall", "-Werror", "-o", str(binary), str(source)],
        what=f"compile {source.name}",
    )


def _pause_rootfs(work: Path, rootfs_tar: Path) -> None:
    binary = work / "pause"
    compile_static(PAUSE_SOURCE, binary)
    with tarfile.open(rootfs_tar, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tar.gettarinfo(str(binary), arcname="pause")
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        info.mode = 0o755
        info.mtime = 0
        with binary.open("rb") as handle:
            tar.addfile(info, handle)


def _binary_rootfs(binary: Path, rootfs_tar: Path) -> None:
    with tarfile.open(rootfs_tar, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tar.gettarinfo(str(binary), arcname=binary.name)
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        info.mode = 0o755
        info.mtime = 0
        with binary.open("rb") as handle:
            tar.addfile(info, handle)
        # An empty /tmp and /etc, as programs expect them to exist.
        for directory in ("etc", "tmp"):
            entry = tarfile.TarInfo(directory)
            entry.type = tarfile.DIRTYPE
            entry.mode = 0o1777 if directory == "tmp" else 0o755
            tar.addfile(entry)


def _manylinux_platforms() -> list[str]:
    """Platform tags of wheels that run on the image's glibc, newest first
    (pip does not expand manylinux_2_36 to the older tags by itself)."""
    major, minor = versions.DEBIAN_GLIBC
    tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 4, -1)]
    return [*tags, "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def _stage_pip_project(project: PipProject, stage: Path, work: Path) -> None:
    """Install `project` and its dependencies into stage/opt/<name>, for the
    image's Python (not this one), and write its launchers."""
    source = work / f"src-{project.name}"
    for file in _project_files(project):
        target = source / file
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / project.root / file, target)
    wheels = work / f"wheels-{project.name}"
    # Built from a copy: a wheel build in the work tree would leave build/ and
    # *.egg-info behind in the repository other people work in.
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(source)],
        what=f"wheel of {project.name}",
    )
    target = stage / "opt" / project.name
    platforms = [arg for tag in _manylinux_platforms() for arg in ("--platform", tag)]
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-compile",  # compiled in the image by its own python3 (paths, version)
            "--target",
            str(target),
            "--only-binary=:all:",
            "--implementation=cp",
            f"--python-version={versions.DEBIAN_PYTHON}",
            f"--abi=cp{versions.DEBIAN_PYTHON.replace('.', '')}",
            *platforms,
            *[
                f"{wheel}[{','.join(project.extras)}]" if project.extras else str(wheel)
                for wheel in sorted(wheels.glob("*.whl"))
            ],
        ],
        what=f"pip install {project.name}",
        timeout=1800.0,
    )
    # pip's own console scripts name the build host's interpreter.
    shutil.rmtree(target / "bin", ignore_errors=True)
    bin_dir = stage / "usr" / "local" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for command, entry in project.launchers:
        launcher = bin_dir / command
        launcher.write_text(launcher_script(project, command, entry))
        launcher.chmod(0o755)


def launcher_script(project: PipProject, command: str, entry: str) -> str:
    """/usr/local/bin/<command>: the project's `entry` ("module:function") with
    /opt/<project> on sys.path. Pure."""
    module, function = entry.split(":")
    return (
        "#!/usr/bin/python3\n"
        f"# {command}: {project.name} in /opt/{project.name}, by devcluster/images.py\n"
        "import sys\n\n"
        f'sys.path.insert(0, "/opt/{project.name}")\n'
        f"from {module} import {function}\n\n"
        f"sys.exit({function}())\n"
    )


def _shell(spec: ImageSpec) -> str:
    """The users' login shell: bash where the image names its users (E2B's
    `user` expects one), sh in the images made before that."""
    return "/bin/bash" if spec.users is not None else "/bin/sh"


def _debian_rootfs(spec: ImageSpec, work: Path, rootfs_tar: Path) -> None:
    if shutil.which("mmdebstrap") is None:
        raise ImageError("mmdebstrap is not installed (python -m devcluster.hostdeps installs it)")
    stage = work / "stage"
    stage.mkdir()
    for project in spec.pip:
        _stage_pip_project(project, stage, work)
    for program in spec.programs:
        (stage / "usr" / "local" / "bin").mkdir(parents=True, exist_ok=True)
        compile_static(program_source(program), stage / "usr" / "local" / "bin" / program)
    users = spec.users if spec.users is not None else _USERS
    passwd = "".join(
        f"{user}:x:{uid}:{gid}:{user}:{home}:{_shell(spec)}\\n" for user, uid, gid, home in users
    )
    groups = "".join(f"{user}:x:{gid}:\\n" for user, uid, gid, _home in users if uid == gid)
    homes = " ".join(f'"$1{home}"' for _user, _uid, _gid, home in users)
    owners = "; ".join(f'chown {uid}:{gid} "$1{home}"' for _user, uid, gid, home in users)
    hooks = [
        f"printf '{passwd}' >> \"$1/etc/passwd\"",
        f"printf '{groups}' >> \"$1/etc/group\"",
        f"mkdir -p {homes}; {owners}",
        f'cp -a "{stage}/." "$1/"',
    ]
    if spec.pip:
        # Bytecode by the image's own interpreter: right version and paths, and
        # nothing left to write at run time (read-only root filesystems).
        dirs = " ".join(f"/opt/{project.name}" for project in spec.pip)
        hooks.append(f'chroot "$1" python3 -m compileall -q -j0 {dirs} >/dev/null')
    # Caches and logs of the build itself (apt lists are removed by mmdebstrap).
    hooks.append(
        'rm -rf "$1"/var/cache/apt/*.bin "$1"/var/log/apt/* "$1"/var/log/dpkg.log '
        '"$1"/var/log/alternatives.log "$1"/var/cache/ldconfig/aux-cache'
    )
    argv = [
        "mmdebstrap",
        f"--variant={spec.variant}",
        "--format=tar",
        '--aptopt=Acquire::Languages "none"',
        *([] if spec.install_recommends else ['--aptopt=APT::Install-Recommends "false"']),
        *[f"--dpkgopt={option}" for option in _DPKG_EXCLUDES],
        *([f"--include={','.join(spec.packages)}"] if spec.packages else []),
        *[f"--customize-hook={hook}" for hook in hooks],
        versions.DEBIAN_SUITE,
        str(rootfs_tar),
        *[str(source) for source in _debian_sources()],
    ]
    _run(argv, what=f"mmdebstrap {spec.name}", timeout=1800.0)


# ---- OCI layout --------------------------------------------------------------------


class _Sink(Protocol):
    def write(self, data: memoryview, /) -> int: ...


class _HashingWriter(io.RawIOBase):
    """Forwards writes to `target`, hashing and counting them on the way."""

    def __init__(self, target: _Sink) -> None:
        self.target = target
        self.sha256 = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data)
        self.sha256.update(view)
        self.size += view.nbytes
        self.target.write(view)
        return view.nbytes


def _write_layer(rootfs_tar: Path, blob: Path) -> tuple[str, str, int, int]:
    """Re-tar the root filesystem as a gzip layer; returns (digest, diff id,
    compressed size, uncompressed size). Device nodes under /dev are dropped:
    the runtime mounts its own /dev, and images carry none."""
    with blob.open("wb") as raw:
        compressed = _HashingWriter(raw)
        with gzip.GzipFile(fileobj=compressed, mode="wb", compresslevel=6, mtime=0) as gz:
            plain = _HashingWriter(gz)
            with (
                tarfile.open(rootfs_tar, "r|") as source,
                tarfile.open(fileobj=plain, mode="w|", format=tarfile.PAX_FORMAT) as layer,
            ):
                for member in source:
                    name = member.name.removeprefix("./")
                    if name.startswith("dev/") and name != "dev/":
                        continue
                    if member.ischr() or member.isblk() or member.isfifo():
                        continue
                    handle = source.extractfile(member) if member.isfile() else None
                    layer.addfile(member, handle)
    return (
        "sha256:" + compressed.sha256.hexdigest(),
        "sha256:" + plain.sha256.hexdigest(),
        compressed.size,
        plain.size,
    )


def _config(spec: ImageSpec, diff_id: str) -> dict[str, object]:
    config: dict[str, object] = {"Env": list(spec.env), "WorkingDir": spec.workdir}
    if spec.entrypoint:
        config["Entrypoint"] = list(spec.entrypoint)
    if spec.cmd:
        config["Cmd"] = list(spec.cmd)
    if spec.user:
        config["User"] = spec.user
    if spec.labels:
        config["Labels"] = dict(spec.labels)
    return {
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": f"devcluster/images.py recipe {RECIPE}"}],
    }


def _write_oci_archive(spec: ImageSpec, rootfs_tar: Path, archive: Path) -> tuple[str, int, int]:
    """An OCI image layout (as a tar) with one image; returns (manifest digest,
    layer size, rootfs size)."""
    layout = archive.parent / "layout"
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    layer_tmp = blobs / "layer.tmp"
    layer_digest, diff_id, layer_size, rootfs_size = _write_layer(rootfs_tar, layer_tmp)
    layer_tmp.rename(blobs / layer_digest.removeprefix("sha256:"))

    def put(document: dict[str, object]) -> tuple[str, int]:
        data = json.dumps(document, separators=(",", ":"), sort_keys=True).encode()
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return "sha256:" + digest, len(data)

    config_digest, config_size = put(_config(spec, diff_id))
    manifest_digest, manifest_size = put(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": config_size,
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": layer_digest,
                    "size": layer_size,
                }
            ],
        }
    )
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": manifest_size,
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    # ctr import names the image after this one...
                    "io.containerd.image.name": spec.reference,
                    # ...other OCI tools after this one.
                    "org.opencontainers.image.ref.name": spec.reference,
                },
            }
        ],
    }
    (layout / "index.json").write_text(json.dumps(index, indent=2))
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in ["oci-layout", "index.json", "blobs"]:
            tar.add(layout / path, arcname=path)
    shutil.rmtree(layout)
    return manifest_digest, layer_size, rootfs_size


# ---- containerd ------------------------------------------------------------------


def _ctr(address: Path, *args: str, timeout: float = 600.0) -> str:
    return _run(
        ["ctr", "--address", str(address), "--namespace", "k8s.io", *args],
        what=f"ctr {' '.join(args[:2])}",
        timeout=timeout,
        # Quick bookkeeping calls; an import says what it imported when done.
        level=logging.DEBUG,
    )


def imported(address: Path) -> dict[str, str]:
    """Image references in the containerd at `address` (CRI namespace) -> target digest."""
    found = {}
    for line in _ctr(address, "images", "ls").splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3:
            found[fields[0]] = fields[2]
    return found


def import_images(address: Path, images: Sequence[BuiltImage]) -> list[str]:
    """Import the archives that containerd does not hold at the same digest yet.

    Returns the references imported. `ctr import` unpacks into the default
    snapshotter (overlayfs), which is what the CRI plugin runs containers from.
    """
    present = imported(address)
    todo = [image for image in images if present.get(image.reference) != image.manifest_digest]

    def one(image: BuiltImage) -> str:
        began = time.monotonic()
        _ctr(address, "images", "import", str(image.archive))
        log.info("imported %s in %.1fs", image.reference, time.monotonic() - began)
        return image.reference

    # Two at a time: an import is gunzip (CPU) then unpack (disk), and two
    # overlap well on two cores (34 s -> about 20 s for the whole catalogue).
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(one, todo))
    after = imported(address)
    wrong = [i.reference for i in images if after.get(i.reference) != i.manifest_digest]
    if wrong:
        raise ImageError(f"after import, containerd does not hold {wrong} at the built digests")
    return done


# ---- seeded image stores ----------------------------------------------------------

# Bolt databases of containerd's root: written by every containerd that opens
# them, so a clone gets copies. Everything else in a root is write-once
# (content blobs, committed snapshots, which overlayfs only reads as lower
# layers) and is hard-linked: a clone of the whole catalogue takes a second
# instead of ~20-60 s of gunzip and unpacking.
_STORE_DATABASES = (
    "io.containerd.metadata.v1.bolt/meta.db",
    "io.containerd.snapshotter.v1.overlayfs/metadata.db",
)


def _containerd_version() -> str:
    proc = subprocess.run(["containerd", "--version"], capture_output=True, text=True, check=False)
    return proc.stdout.strip()


# Bump when the way seeds are made changes (2: no `--digests` images).
_SEED_RECIPE = 2


def seed_key(images: Sequence[BuiltImage]) -> str:
    digest = hashlib.sha256(f"{RECIPE} {_SEED_RECIPE} {_containerd_version()}\n".encode())
    for image in sorted(images, key=lambda i: i.reference):
        digest.update(f"{image.reference} {image.manifest_digest}\n".encode())
    return digest.hexdigest()[:16]


def ensure_seed(images: Sequence[BuiltImage]) -> Path:
    """A containerd root holding exactly `images` (unpacked for overlayfs),
    made once per image set by a throwaway containerd without CRI, in the
    image cache. Clone it with `clone_seed` into a new cluster's root."""
    key = seed_key(images)
    stores = images_dir() / "stores"
    seed = stores / key
    if (seed / ".complete").exists():
        return seed
    stores.mkdir(exist_ok=True)
    with _lock(f"store-{key}"):
        if (seed / ".complete").exists():
            return seed
        began = time.monotonic()
        shutil.rmtree(seed, ignore_errors=True)
        # The socket path must stay short (sun_path), so not in the cache dir.
        with tempfile.TemporaryDirectory(prefix="devcluster-seed-", dir="/run") as run:
            socket = Path(run) / "containerd.sock"
            config = Path(run) / "config.toml"
            config.write_text(
                "version = 2\n"
                f'root = "{seed}"\n'
                f'state = "{Path(run) / "state"}"\n'
                "disabled_plugins = [\n"
                '  "io.containerd.grpc.v1.cri",\n'
                '  "io.containerd.internal.v1.opt",\n'
                '  "io.containerd.tracing.processor.v1.otlp",\n'
                '  "io.containerd.internal.v1.tracing",\n'
                "]\n"
                f'[grpc]\n  address = "{socket}"\n'
                f'[ttrpc]\n  address = "{socket}.ttrpc"\n'
            )
            with (Path(run) / "containerd.log").open("wb") as log_file:
                daemon = subprocess.Popen(
                    ["containerd", f"--config={config}"],
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            try:
                deadline = time.monotonic() + 30.0
                while True:
                    if daemon.poll() is not None:
                        raise ImageError(
                            "seed containerd exited: "
                            + (Path(run) / "containerd.log").read_text()[-2000:]
                        )
                    with contextlib.suppress(ImageError):
                        imported(socket)
                        break
                    if time.monotonic() > deadline:
                        raise ImageError("seed containerd did not come up within 30s")
                    time.sleep(0.1)
                import_images(socket, images)
            finally:
                daemon.terminate()
                try:
                    daemon.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait(timeout=15)
        (seed / ".complete").write_text(json.dumps([i.reference for i in images]) + "\n")
        log.info("seeded image store %s in %.1fs", key, time.monotonic() - began)
        _prune_seeds(stores, keep=seed)
        return seed


# Seeds are up to 2 GB each and every edit of sandbox-agent/ or operator/
# makes a new one: keep the newest few (several image sets are in use at once:
# the tests' clusters import different ones).
_SEEDS_KEPT = 4


def _prune_seeds(stores: Path, keep: Path) -> None:
    seeds = [d for d in stores.iterdir() if d.is_dir() and (d / ".complete").exists()]
    seeds.sort(key=lambda d: (d / ".complete").stat().st_mtime, reverse=True)
    for old in seeds[_SEEDS_KEPT:]:
        if old != keep:
            with _lock(f"store-{old.name}"):  # not while someone clones it
                shutil.rmtree(old, ignore_errors=True)


def clone_seed(seed: Path, target: Path) -> None:
    """`target` (must not exist) becomes a containerd root with the seed's
    images: hard links for the write-once files, copies of the databases."""
    tmp = target.with_name(target.name + ".cloning")
    shutil.rmtree(tmp, ignore_errors=True)
    with _lock(f"store-{seed.name}"):
        _run(["cp", "-al", str(seed), str(tmp)], what="clone image store", timeout=300.0)
        for database in _STORE_DATABASES:
            linked = tmp / database
            if linked.exists():
                linked.unlink()
                shutil.copy2(seed / database, linked)
        # Recently used: kept by _prune_seeds.
        os.utime(seed / ".complete")
    (tmp / ".complete").unlink(missing_ok=True)
    os.replace(tmp, target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devcluster.images",
        description="Build (or reuse) the local images; print their archives and sizes.",
    )
    parser.add_argument("names", nargs="*", help=f"default: all of {', '.join(IMAGES)}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for name in args.names or list(IMAGES):
        if name not in IMAGES:
            print(f"unknown image {name!r}", file=sys.stderr)
            return 2
        image = ensure_built(IMAGES[name])
        print(
            f"{image.reference:<48} layer {image.layer_bytes / 2**20:6.1f} MiB  "
            f"rootfs {image.rootfs_bytes / 2**20:6.1f} MiB  built in {image.build_seconds:5.1f}s  "
            f"{image.archive}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
