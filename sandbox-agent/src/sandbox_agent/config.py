"""Agent settings, all from environment variables (the pod spec is the config file)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

MiB = 1 << 20


class ConfigError(Exception):
    """A setting is missing or malformed; the agent refuses to start."""


@dataclass(frozen=True)
class Settings:
    host: str = "0.0.0.0"
    port: int = 8080
    token_file: str = ""
    workspace: str = "/workspace"
    runtime_dir: str = "/sandbox/run"
    runner_socket: str = ""  # default: <runtime_dir>/runner.sock
    log_dir: str = "/tmp/sandbox-agent/logs"
    shell: str = "/bin/sh"
    umask: int = 0o002
    # exec limits
    default_timeout: float = 180.0
    max_timeout: float = 3600.0
    max_concurrent_executions: int = 32
    max_capture_bytes: int = 4 * MiB  # per stream, in memory (tail kept)
    max_log_bytes: int = 64 * MiB  # per execution, on disk
    max_log_dir_bytes: int = 1024 * MiB  # all logs; oldest finished pruned
    log_memory_bytes: int = 2 * MiB  # an execution's log stays in memory up to this
    log_memory_total_bytes: int = 64 * MiB  # all in-memory logs; oldest spill to disk
    capture_memory_total_bytes: int = 256 * MiB  # tails kept by finished records
    max_records: int = 1000  # finished executions remembered (idempotency window)
    kill_grace: float = 5.0  # wait for the runner to confirm a kill, then restart the runtime
    runner_stall_seconds: float = 30.0  # no pong this long while commands run: restart (0: never)
    # request limits
    max_body_bytes: int = 8 * MiB  # JSON bodies and stdin
    max_upload_bytes: int = 4096 * MiB  # file and archive uploads
    max_extract_bytes: int = 8192 * MiB  # total unpacked size of one archive
    max_archive_entries: int = 100_000
    max_read_bytes: int = 4096 * MiB  # one file read
    search_max_results: int = 1000
    search_max_file_bytes: int = 8 * MiB
    search_max_files: int = 100_000
    list_max_entries: int = 10_000
    # search, find, patch and replace at once (each may hold a file or two in
    # memory); more wait up to 10 s, then 429 files_busy
    max_file_scans: int = 2
    max_connections: int = 128  # open HTTP connections; the longest idle is closed first
    # terminals (a pty program each): at once, output kept per terminal for
    # re-attaching, and how long one lives with nobody attached (0: for ever)
    max_terminals: int = 16
    terminal_buffer_bytes: int = 1 * MiB
    terminal_idle_timeout: float = 3600.0
    # code contexts (a Jupyter kernel each, in the sandbox): at once, and how
    # long a kernel may take to come up
    max_contexts: int = 8
    context_start_timeout: float = 120.0
    # directory watches (GET /v1/files/watch)
    max_watches: int = 8  # streams open at once; more: 429 too_many_watches
    watch_queue: int = 4096  # changes held per stream for its client; then one overflow event
    watch_max_directories: int = 4096  # inotify watches (directories) per stream
    watch_keepalive: float = 15.0  # seconds of quiet before a keepalive line
    # How watches find changes: inotify, or poll (scans compared); auto: poll
    # where inotify cannot see the sandbox container's changes (watchpoll.py).
    watch_mode: str = "auto"
    watch_poll_interval: float = 0.25  # seconds between scans (longer for a large tree)
    watch_poll_max_entries: int = 20_000  # entries one polled stream remembers
    # watchers kept between calls (POST /v1/files/watchers, watchers.py)
    max_watchers: int = 8  # at once; more: 429 too_many_watchers
    watcher_idle_timeout: float = 600.0  # seconds without a fetch: removed
    metrics_auth: bool = True
    malloc_keep_bytes: int = 128 * MiB  # freed heap kept for reuse (0: glibc defaults)
    # The container's memory limit (the operator passes limits.memory); 0:
    # read the cgroup's, if any. The memory budgets above that are not set
    # explicitly are derived from it (see derive_budgets).
    memory_limit_bytes: int = 0

    @property
    def socket_path(self) -> str:
        return self.runner_socket or os.path.join(self.runtime_dir, "runner.sock")


_ENV = {
    "host": "SANDBOX_AGENT_HOST",
    "port": "SANDBOX_AGENT_PORT",
    "token_file": "SANDBOX_AGENT_TOKEN_FILE",
    "workspace": "SANDBOX_AGENT_WORKSPACE",
    "runtime_dir": "SANDBOX_AGENT_RUNTIME_DIR",
    "runner_socket": "SANDBOX_AGENT_RUNNER_SOCKET",
    "log_dir": "SANDBOX_AGENT_LOG_DIR",
    "shell": "SANDBOX_AGENT_SHELL",
    "umask": "SANDBOX_AGENT_UMASK",
    "default_timeout": "SANDBOX_AGENT_DEFAULT_TIMEOUT",
    "max_timeout": "SANDBOX_AGENT_MAX_TIMEOUT",
    "max_concurrent_executions": "SANDBOX_AGENT_MAX_CONCURRENT_EXECUTIONS",
    "max_capture_bytes": "SANDBOX_AGENT_MAX_CAPTURE_BYTES",
    "max_log_bytes": "SANDBOX_AGENT_MAX_LOG_BYTES",
    "max_log_dir_bytes": "SANDBOX_AGENT_MAX_LOG_DIR_BYTES",
    "log_memory_bytes": "SANDBOX_AGENT_LOG_MEMORY_BYTES",
    "log_memory_total_bytes": "SANDBOX_AGENT_LOG_MEMORY_TOTAL_BYTES",
    "capture_memory_total_bytes": "SANDBOX_AGENT_CAPTURE_MEMORY_TOTAL_BYTES",
    "max_records": "SANDBOX_AGENT_MAX_RECORDS",
    "kill_grace": "SANDBOX_AGENT_KILL_GRACE",
    "runner_stall_seconds": "SANDBOX_AGENT_RUNNER_STALL_SECONDS",
    "max_body_bytes": "SANDBOX_AGENT_MAX_BODY_BYTES",
    "max_upload_bytes": "SANDBOX_AGENT_MAX_UPLOAD_BYTES",
    "max_extract_bytes": "SANDBOX_AGENT_MAX_EXTRACT_BYTES",
    "max_archive_entries": "SANDBOX_AGENT_MAX_ARCHIVE_ENTRIES",
    "max_read_bytes": "SANDBOX_AGENT_MAX_READ_BYTES",
    "search_max_results": "SANDBOX_AGENT_SEARCH_MAX_RESULTS",
    "search_max_file_bytes": "SANDBOX_AGENT_SEARCH_MAX_FILE_BYTES",
    "search_max_files": "SANDBOX_AGENT_SEARCH_MAX_FILES",
    "list_max_entries": "SANDBOX_AGENT_LIST_MAX_ENTRIES",
    "max_file_scans": "SANDBOX_AGENT_MAX_FILE_SCANS",
    "max_connections": "SANDBOX_AGENT_MAX_CONNECTIONS",
    "max_terminals": "SANDBOX_AGENT_MAX_TERMINALS",
    "terminal_buffer_bytes": "SANDBOX_AGENT_TERMINAL_BUFFER_BYTES",
    "terminal_idle_timeout": "SANDBOX_AGENT_TERMINAL_IDLE_TIMEOUT",
    "max_contexts": "SANDBOX_AGENT_MAX_CONTEXTS",
    "context_start_timeout": "SANDBOX_AGENT_CONTEXT_START_TIMEOUT",
    "max_watches": "SANDBOX_AGENT_MAX_WATCHES",
    "watch_queue": "SANDBOX_AGENT_WATCH_QUEUE",
    "watch_max_directories": "SANDBOX_AGENT_WATCH_MAX_DIRECTORIES",
    "watch_keepalive": "SANDBOX_AGENT_WATCH_KEEPALIVE",
    "watch_mode": "SANDBOX_AGENT_WATCH_MODE",
    "watch_poll_interval": "SANDBOX_AGENT_WATCH_POLL_INTERVAL",
    "watch_poll_max_entries": "SANDBOX_AGENT_WATCH_POLL_MAX_ENTRIES",
    "max_watchers": "SANDBOX_AGENT_MAX_WATCHERS",
    "watcher_idle_timeout": "SANDBOX_AGENT_WATCHER_IDLE_TIMEOUT",
    "metrics_auth": "SANDBOX_AGENT_METRICS_AUTH",
    "malloc_keep_bytes": "SANDBOX_AGENT_MALLOC_KEEP_BYTES",
    "memory_limit_bytes": "SANDBOX_AGENT_MEMORY_LIMIT_BYTES",
}

# Settings derived from the memory limit when not given explicitly.
_DERIVED = (
    "max_concurrent_executions",
    "max_capture_bytes",
    "log_memory_bytes",
    "log_memory_total_bytes",
    "capture_memory_total_bytes",
    "malloc_keep_bytes",
)


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def derive_budgets(limit: int) -> dict[str, int]:
    """Memory budgets that keep the agent well inside a container limit.

    Sized from measurements (benchmarks/agent_memory_bench.py): the
    interpreter and its libraries take ~35 MiB; what grows with use is the
    output of running commands (a tail per stream, an in-memory log) and,
    when a command ends, its answer (the tails again, JSON-encoded: about
    three copies). So concurrency and the per-stream tail shrink with the
    limit, and the in-memory totals and the heap kept for reuse are fixed
    fractions of it. Above ~1 GiB these are the plain defaults.
    """
    d = Settings()
    concurrent = _clamp(limit // (16 * MiB), 4, d.max_concurrent_executions)
    capture = _clamp(limit // 192, 256 << 10, d.max_capture_bytes)
    total = _clamp(limit // 16, 4 * MiB, d.log_memory_total_bytes)
    return {
        "max_concurrent_executions": concurrent,
        "max_capture_bytes": capture,
        "log_memory_total_bytes": total,
        "log_memory_bytes": _clamp(total // 8, 256 << 10, d.log_memory_bytes),
        "capture_memory_total_bytes": _clamp(limit // 16, 4 * MiB, d.capture_memory_total_bytes),
        "malloc_keep_bytes": _clamp(limit // 8, 0, d.malloc_keep_bytes),
    }


def cgroup_memory_limit() -> int:
    """The memory limit of the cgroup we run in (as a container sees it), 0 if none."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 50:  # "max", or v1's "unlimited" number
            return int(raw)
        return 0
    return 0


def env_names() -> dict[str, str]:
    """Setting name -> environment variable (documented in the README)."""
    return dict(_ENV)


def load(environ: Mapping[str, str] | None = None) -> Settings:
    env = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for f in fields(Settings):
        name = _ENV[f.name]
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        default = getattr(Settings, f.name)
        try:
            if isinstance(default, bool):
                if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(raw)
                values[f.name] = raw.lower() in ("1", "true", "yes")
            elif f.name == "umask":
                values[f.name] = int(raw, 8)
            elif isinstance(default, int):
                values[f.name] = int(raw)
            elif isinstance(default, float):
                values[f.name] = float(raw)
            else:
                values[f.name] = raw
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not a valid value") from None
        value = values[f.name]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise ConfigError(f"{name} must not be negative")
    settings = Settings(**values)  # type: ignore[arg-type]
    limit = settings.memory_limit_bytes or cgroup_memory_limit()
    if limit:
        derived = {k: v for k, v in derive_budgets(limit).items() if k not in values}
        settings = replace(settings, memory_limit_bytes=limit, **derived)  # type: ignore[arg-type]
    if not 0 < settings.port < 65536:
        raise ConfigError("SANDBOX_AGENT_PORT must be 1..65535")
    if settings.default_timeout <= 0 or settings.max_timeout < settings.default_timeout:
        raise ConfigError("need 0 < SANDBOX_AGENT_DEFAULT_TIMEOUT <= SANDBOX_AGENT_MAX_TIMEOUT")
    if settings.max_connections < 2:
        raise ConfigError("SANDBOX_AGENT_MAX_CONNECTIONS must be >= 2")
    if settings.terminal_buffer_bytes < 4096:
        raise ConfigError("SANDBOX_AGENT_TERMINAL_BUFFER_BYTES must be >= 4096")
    if settings.max_concurrent_executions < 1:
        raise ConfigError("SANDBOX_AGENT_MAX_CONCURRENT_EXECUTIONS must be >= 1")
    if settings.watch_queue < 2 or settings.watch_max_directories < 1:
        raise ConfigError(
            "SANDBOX_AGENT_WATCH_QUEUE must be >= 2 and SANDBOX_AGENT_WATCH_MAX_DIRECTORIES >= 1"
        )
    if settings.watch_keepalive <= 0:
        raise ConfigError("SANDBOX_AGENT_WATCH_KEEPALIVE must be > 0")
    if settings.watch_mode not in ("auto", "inotify", "poll"):
        raise ConfigError("SANDBOX_AGENT_WATCH_MODE must be auto, inotify or poll")
    if settings.watch_poll_interval < 0.01 or settings.watch_poll_max_entries < 1:
        raise ConfigError(
            "SANDBOX_AGENT_WATCH_POLL_INTERVAL must be >= 0.01 and"
            " SANDBOX_AGENT_WATCH_POLL_MAX_ENTRIES >= 1"
        )
    if settings.watcher_idle_timeout < 1:
        raise ConfigError("SANDBOX_AGENT_WATCHER_IDLE_TIMEOUT must be >= 1")
    return settings
