"""Start-up: settings, token (fail closed), runner placement, uvicorn."""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import sys
import tempfile
from pathlib import Path

from .config import ConfigError, Settings, load

log = logging.getLogger("sandbox_agent")


class StartupError(Exception):
    pass


def read_token(path: str) -> bytes:
    if not path:
        raise StartupError("SANDBOX_AGENT_TOKEN_FILE is not set; refusing to start without auth")
    try:
        token = Path(path).read_bytes().strip()
    except OSError as exc:
        raise StartupError(f"cannot read token file {path}: {exc.strerror}") from None
    if not token:
        raise StartupError(f"token file {path} is empty; refusing to start without auth")
    if len(token) < 16:
        raise StartupError(f"token in {path} is shorter than 16 bytes; refusing a weak token")
    return token


# What the sandbox container runs from the shared directory: the code-context
# bridges (started through the runner) and the runner, its entrypoint, last:
# the container starts it as soon as it exists (builders.sandbox RUNNER_BOOTSTRAP).
PLACED = ("kernel.py", "kernel.js", "runner.py")


def place_runner(runtime_dir: str) -> str:
    """Copy our runner.py (and the files it starts) into the shared directory,
    each atomically, mode 0644; returns the runner's path."""
    os.makedirs(runtime_dir, exist_ok=True)
    for name in PLACED:
        _place(Path(__file__).with_name(name).read_bytes(), runtime_dir, name)
    return os.path.join(runtime_dir, PLACED[-1])


def _place(src: bytes, runtime_dir: str, name: str) -> None:
    dest = os.path.join(runtime_dir, name)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=runtime_dir)
    try:
        os.write(fd, src)
        os.fchmod(fd, 0o644)
        os.fsync(fd)
        os.close(fd)
        os.replace(tmp, dest)
    except BaseException:
        os.close(fd) if _is_open(fd) else None
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def tune_malloc(keep_bytes: int) -> None:
    """Keep freed large buffers in the heap instead of returning them to the OS.

    glibc serves allocations >= 128 KiB with mmap and trims the heap eagerly,
    so every MiB of command output or file data costs fresh page faults. On
    the VMs measured that is ~1 ms per MiB (a 1 MiB exec round trip spent
    most of its agent CPU there); reusing the memory makes it ~20x cheaper.
    RSS may stay up to ``keep_bytes`` above the live set.
    """
    if keep_bytes <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: 32 MiB, glibc's maximum
        libc.mallopt(-1, keep_bytes)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc (e.g. musl): nothing to tune


def prepare(settings: Settings) -> bytes:
    token = read_token(settings.token_file)
    tune_malloc(settings.malloc_keep_bytes)
    # Files we create must be writable by the sandbox user (same group).
    os.umask(settings.umask)
    if not os.path.isdir(settings.workspace):
        raise StartupError(f"workspace {settings.workspace} is not a directory")
    try:
        os.makedirs(settings.log_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=settings.log_dir):
            pass
    except OSError as exc:
        raise StartupError(f"log dir {settings.log_dir} is not writable: {exc.strerror}") from None
    try:
        dest = place_runner(settings.runtime_dir)
    except OSError as exc:
        raise StartupError(
            f"cannot place runner.py in {settings.runtime_dir}: {exc.strerror}"
        ) from None
    log.info("runner placed at %s; expecting its socket at %s", dest, settings.socket_path)
    return token


# A listening socket made before the agent started: the agent image's entry
# program listens before the interpreter starts (devcluster/listen-first.c,
# which names this variable again).
LISTEN_FD_ENV = "SANDBOX_AGENT_LISTEN_FD"


def _listener(settings: Settings, builtin: bool) -> socket.socket | None:
    """The socket the built-in server answers on: the one handed over in
    LISTEN_FD_ENV if it is on the configured port, else a new one. Listening
    comes before the slow part of the start (imports, the runner's placement):
    a probe that comes early waits in the backlog for its answer instead of
    being refused (which the kubelet reports as an Unhealthy warning)."""
    inherited = os.environ.pop(LISTEN_FD_ENV, None)
    handed: socket.socket | None = None
    if inherited is not None:
        try:
            handed = socket.socket(fileno=int(inherited))
            port = handed.getsockname()[1]
        except (OSError, ValueError) as exc:
            raise StartupError(f"{LISTEN_FD_ENV}={inherited!r} is not a socket: {exc}") from None
        if port != settings.port:
            handed.close()
            raise StartupError(
                f"the socket in {LISTEN_FD_ENV} listens on port {port}, not on {settings.port}"
            )
    if not builtin:
        if handed is not None:
            handed.close()  # uvicorn listens itself
        return None
    if handed is not None:
        return handed
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    try:
        return socket.create_server((settings.host, settings.port), family=family, backlog=1024)
    except OSError as exc:
        raise StartupError(f"cannot listen on {settings.host}:{settings.port}: {exc}") from None


def main() -> int:
    logging.basicConfig(
        level=os.environ.get("SANDBOX_AGENT_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = load()
    except ConfigError as exc:
        print(f"sandbox-agent: {exc}", file=sys.stderr)
        return 2
    builtin = os.environ.get("SANDBOX_AGENT_SERVER", "builtin") != "uvicorn"
    try:
        listener = _listener(settings, builtin)
    except StartupError as exc:
        print(f"sandbox-agent: {exc}", file=sys.stderr)
        return 1
    try:
        token = prepare(settings)
    except (ConfigError, StartupError) as exc:
        print(f"sandbox-agent: {exc}", file=sys.stderr)
        return 2

    from .app import build_app

    app = build_app(settings, token)
    if not builtin:
        # Fallback to a mainstream server (pip install 'sandbox-agent[uvicorn]').
        import uvicorn

        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            loop="uvloop",
            http="httptools",
            lifespan="on",
            access_log=False,
            log_level=os.environ.get("SANDBOX_AGENT_LOG_LEVEL", "info").lower(),
            timeout_graceful_shutdown=5,
            limit_concurrency=settings.max_connections,
            server_header=False,
        )
        server = uvicorn.Server(config)
        server.run()
        return 0 if server.started else 1

    from .httpserver import run

    return 0 if run(app, settings.host, settings.port, settings.max_connections, listener) else 1
