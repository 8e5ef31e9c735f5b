"""Request and response shapes of the HTTP API.

msgspec structs: they validate requests, encode responses fast, and generate
the JSON Schemas of the OpenAPI document, so the contract cannot drift from
the code. JSON field names are camelCase like the Kubernetes side.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from .errors import Code

Path = Annotated[
    str,
    Meta(
        max_length=4096,
        description="Path relative to the workspace root ('.' is the root). Absolute paths, "
        "'..' components and symlinks that leave the workspace are refused.",
    ),
]
OctalMode = Annotated[
    str, Meta(pattern="^0?[0-7]{3,4}$", description="Permission bits in octal, e.g. '0644'")
]


def rfc3339(ts: float) -> str:
    """RFC 3339 UTC with milliseconds (hot path: avoids datetime objects)."""
    ms = int(ts * 1000) % 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{ms:03d}Z"


ORDER = (
    "Order: within one stream, bytes come exactly in the order the command wrote them. "
    "Between stdout and stderr, the order (and so the cursor) is the order in which the "
    "runner read the two pipes: writes a few milliseconds apart or closer may appear in "
    "either order. With combinedOutput, both go to one pipe, reported as stdout, in exactly "
    "the order the writes reached it."
)
COMBINED = (
    "stderr goes into the same pipe as stdout: one stream in true order (reported as "
    "stdout; stderr stays empty). Note that programs often buffer stdout but not stderr "
    "when it is not a terminal; this orders their writes, not their print calls."
)
# Environment variable names as Kubernetes accepts them.
EnvName = Annotated[str, Meta(pattern="^[-._a-zA-Z][-._a-zA-Z0-9]*$", max_length=1024)]
EnvValue = Annotated[str, Meta(pattern="^[^\\x00]*$", max_length=128 << 10)]
RestartReason = Literal["kill_not_confirmed", "runner_unresponsive"]
ExecutionStatus = Literal["running", "completed", "timed_out", "cancelled", "failed", "lost"]


class _Base(msgspec.Struct, rename="camel", kw_only=True, forbid_unknown_fields=True):
    pass


class _Out(msgspec.Struct, rename="camel", kw_only=True):
    pass


# -- errors and health ----------------------------------------------------


class ErrorDetail(_Out, kw_only=True):
    code: Code  # its schema, with the codes' meanings: openapi.py
    message: str
    details: dict[str, Any] | None = None


class ErrorBody(_Out, kw_only=True):
    error: ErrorDetail


class Interruption(_Out, kw_only=True):
    """Why the gateway cut an event stream short (an `interrupted` event): its
    own code (e.g. upstream_lost), not one of the agent's."""

    code: str
    message: str


class Health(_Out, kw_only=True):
    status: str


class Readiness(_Out, kw_only=True):
    status: Literal["ready", "not_ready"]
    reason: (
        Annotated[
            str,
            Meta(description="runner_not_connected, runner_not_answering, runtime_restart_pending"),
        ]
        | None
    ) = None
    message: str | None = None
    runner_version: str | None = None


# -- exec -----------------------------------------------------------------


class ExecRequest(_Base, kw_only=True):
    command: (
        Annotated[
            str,
            Meta(
                min_length=1,
                description="Shell script, up to the request body limit "
                "(SANDBOX_AGENT_MAX_BODY_BYTES, 8 MiB). Up to 64 KiB it runs as "
                "SANDBOX_AGENT_SHELL -c command SANDBOX_AGENT_SHELL; a larger one does not "
                "travel in argv: the shell reads it from descriptor 3 (SANDBOX_AGENT_SHELL "
                "-c '. /dev/fd/3' SANDBOX_AGENT_SHELL). Either way $0 is the shell and there "
                "are no positional parameters, as with `sh -c command`.",
            ),
        ]
        | None
    ) = None
    argv: (
        Annotated[
            list[Annotated[str, Meta(max_length=1 << 20)]],
            Meta(min_length=1, max_length=4096, description="Program and arguments, no shell"),
        ]
        | None
    ) = None
    env: Annotated[
        dict[str, str],
        Meta(
            description="Added to the runner's environment and the overlay of PUT "
            "/v1/environment; wins over both"
        ),
    ] = msgspec.field(default_factory=dict)
    cwd: Path = "."
    timeout_seconds: (
        Annotated[
            float,
            Meta(
                gt=0,
                description="Kill the process group after this long (default 180; at most "
                "SANDBOX_AGENT_MAX_TIMEOUT, 3600 by default: more is 400 timeout_too_large)",
            ),
        ]
        | None
    ) = None
    stdin: Annotated[str, Meta(description="Written to stdin (UTF-8)")] | None = None
    stdin_base64: Annotated[str, Meta(description="Written to stdin (base64)")] | None = None
    stdin_open: Annotated[
        bool, Meta(description="Keep stdin open for POST .../stdin (else EOF after 'stdin')")
    ] = False
    background: Annotated[
        bool, Meta(description="Return 202 at once instead of waiting for the exit")
    ] = False
    combined_output: Annotated[bool, Meta(description=COMBINED)] = False
    idempotency_key: (
        Annotated[
            str,
            Meta(
                min_length=1,
                max_length=256,
                description="Same key twice runs once; the second call returns the first "
                "execution (running or finished). Also accepted as the Idempotency-Key header.",
            ),
        ]
        | None
    ) = None


class RunError(_Out, kw_only=True):
    code: Annotated[
        str,
        Meta(
            description="spawn_failed, runner_lost, runner_unresponsive, kill_incomplete, "
            "runtime_restarted, runner_protocol_error, agent_restarted, agent_stopping, "
            "agent_error"
        ),
    ]
    message: str


class Execution(_Out, kw_only=True):
    id: str
    idempotency_key: str | None = None
    status: ExecutionStatus
    command: (
        Annotated[
            str,
            Meta(
                description="The command as sent, or its first 4 KiB when it was longer "
                "(commandTruncated; argv likewise): records are kept for up to "
                "SANDBOX_AGENT_MAX_RECORDS executions"
            ),
        ]
        | None
    ) = None
    command_truncated: bool = False
    command_bytes: (
        Annotated[int, Meta(description="Size of the whole command (or argv) in UTF-8 bytes")]
        | None
    ) = None
    argv: list[str]
    cwd: str
    timeout_seconds: float
    background: bool
    combined_output: Annotated[bool, Meta(description=COMBINED)] = False
    pid: int | None = None
    exit_code: int | None = None
    signal: Annotated[int, Meta(description="Terminating signal number")] | None = None
    signal_name: str | None = None
    timed_out: bool = False
    cancelled: bool = False
    oom_killed: Annotated[
        bool,
        Meta(
            description="Killed by SIGKILL that neither the timeout nor a cancel sent: "
            "almost always the kernel OOM killer"
        ),
    ] = False
    error: RunError | None = None
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    duration_seconds: float | None = None
    stdout: Annotated[str, Meta(description="Captured stdout tail (UTF-8, lossy)")] | None = None
    stderr: Annotated[str, Meta(description="Captured stderr tail (UTF-8, lossy)")] | None = None
    stdout_truncated: Annotated[
        bool, Meta(description="stdout exceeded the in-memory cap; only the tail is here")
    ] = False
    stderr_truncated: bool = False
    tails_dropped: Annotated[
        bool,
        Meta(
            description="stdout and stderr are empty because their tails were dropped "
            "from memory (the agent's budget for finished records); the whole output "
            "is readable by cursor from 0 (GET /v1/executions/{id}/output) while the "
            "log exists (logPruned otherwise)"
        ),
    ] = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    output_cursor: Annotated[int, Meta(description="End of the on-disk output log")] = 0
    log_truncated: Annotated[
        bool, Meta(description="The on-disk log hit its cap; later output is not in it")
    ] = False
    stdin_open: bool = False
    user_cpu_seconds: float | None = None
    system_cpu_seconds: float | None = None
    max_rss_kib: int | None = None


class ExecutionList(_Out, kw_only=True):
    executions: list[Execution]


class OutputChunk(_Out, kw_only=True):
    stream: Annotated[Literal["stdout", "stderr"], Meta(description=ORDER)]
    data: str | None = None
    data_base64: str | None = None
    cursor: Annotated[int, Meta(description="Cursor just after this chunk")]


class OutputPage(_Out, kw_only=True):
    chunks: list[OutputChunk]
    cursor: Annotated[int, Meta(description="Pass back to continue after these chunks")]
    finished: Annotated[bool, Meta(description="The execution ended and all output was read")]
    status: ExecutionStatus
    log_truncated: bool = False


class StreamEvent(_Out, kw_only=True, omit_defaults=True):
    """One event of an execution's stream. A stream ends with `finished`, or
    with `interrupted` (written by the gateway when the agent's stream broke off
    or the gateway shuts down: reattach from the last cursor), never silently."""

    type: Literal["started", "output", "truncated", "finished", "interrupted"]
    execution: Execution | None = None
    error: Interruption | None = None
    stream: Literal["stdout", "stderr"] | None = None
    data: str | None = None
    data_base64: str | None = None
    cursor: int | None = None


WatchType = Literal[
    "started",
    "create",
    "write",
    "remove",
    "rename",
    "chmod",
    "overflow",
    "keepalive",
    "finished",
    "interrupted",
]


class WatchEvent(_Out, kw_only=True, omit_defaults=True):
    """One event of a directory watch (GET /v1/files/watch). The stream opens
    with `started` (from then on every change is seen), then changes: `create`,
    `write` (content changed), `remove`, `rename`, `chmod` (mode, owner or
    times); `overflow` when changes were dropped (rescan what you track);
    `keepalive` while nothing happens. It ends with `finished` (the watched
    directory was removed or moved away, or timeoutSeconds passed), when the
    client leaves, or with `interrupted` (written by the gateway when the
    agent's stream broke off or the gateway shuts down: watch again)."""

    type: WatchType
    time: Annotated[
        str | None, Meta(description="When the agent read the change (RFC 3339, UTC)")
    ] = None
    path: Annotated[
        str | None,
        Meta(
            description="Relative to the workspace, under the watched path as it was named. "
            "rename: the new name (or the old one, moved out of the watch)"
        ),
    ] = None
    old_path: Annotated[
        str | None, Meta(description="rename within the watch: the name before")
    ] = None
    move: Annotated[
        Literal["within", "in", "out"] | None,
        Meta(
            description="rename: both names in the watch (within), moved in from outside it "
            "(in: path is the new name) or out of it (out: path is the old name)"
        ),
    ] = None
    file_type: Annotated[
        Literal["file", "directory"] | None,
        Meta(description="directory, or file for anything else (symlinks included)"),
    ] = None
    recursive: Annotated[bool | None, Meta(description="started: subdirectories watched")] = None
    watches: Annotated[
        int | None,
        Meta(description="started: directories watched (inotify watches), or scanned (poll)"),
    ] = None
    mode: Annotated[
        Literal["inotify", "poll"] | None,
        Meta(
            description="started: how changes are found. inotify: as they happen; poll: by "
            "comparing scans of the tree, every pollInterval seconds (where inotify does not "
            "see the sandbox container's changes: the workspace is a separate filesystem per "
            "container, as under gVisor). A poll sees the difference between two scans: what "
            "was made and removed between them is not reported, and several writes are one"
        ),
    ] = None
    poll_interval: Annotated[
        float | None, Meta(description="started, mode poll: seconds between two scans (at least)")
    ] = None
    dropped: Annotated[
        int | None,
        Meta(description="overflow: changes the agent dropped (the kernel's own are not counted)"),
    ] = None
    reason: Annotated[
        Literal["queue", "kernel", "watch_limit", "removed", "moved", "unmounted", "timeout"]
        | None,
        Meta(
            description="overflow: the agent's queue was full (queue), the kernel's was "
            "(kernel), a new directory was not watched (watch_limit); finished: why it ended"
        ),
    ] = None
    error: Interruption | None = None


class WatcherRequest(_Base, kw_only=True):
    path: Path = "."
    recursive: Annotated[
        bool, Meta(description="Watch subdirectories too, and those made later")
    ] = False


class PolledWatcher(_Out, kw_only=True):
    """A directory watch the agent keeps between calls (POST /v1/files/watchers):
    its changes are fetched with GET .../events."""

    id: str
    path: Annotated[str, Meta(description="The watched directory, as named")]
    recursive: bool
    mode: Literal["inotify", "poll"]
    poll_interval: float | None = None
    created_at: str
    idle_timeout_seconds: Annotated[
        float, Meta(description="Removed when nobody fetched its events for this long")
    ]


class WatcherList(_Out, kw_only=True):
    watchers: list[PolledWatcher]


class WatcherEvents(_Out, kw_only=True):
    """The changes a watcher saw since the previous fetch, in order: the same
    events as a watch stream's (no started or keepalive); `finished` once, last,
    when the watched directory went away."""

    path: Annotated[str, Meta(description="The watched directory, as named")]
    events: list[WatchEvent]
    finished: Annotated[bool, Meta(description="The watch has ended: nothing more will come")]


class StdinRequest(_Base, kw_only=True):
    data: Annotated[str, Meta(description="UTF-8 text to write")] = ""
    data_base64: str | None = None
    close: Annotated[bool, Meta(description="Close stdin after writing")] = False


class StdinResult(_Out, kw_only=True):
    bytes: int
    stdin_open: bool


class SignalRequest(_Base, kw_only=True):
    signal: Annotated[
        str | Annotated[int, Meta(ge=1, le=64)],
        Meta(description="Name ('TERM', 'SIGKILL') or number; sent to the process group"),
    ]


class CancelRequest(_Base, kw_only=True):
    grace_seconds: Annotated[
        float, Meta(ge=0, le=300, description="SIGTERM, then SIGKILL after this long (0: SIGKILL)")
    ] = 0.0


# -- info -----------------------------------------------------------------


class RuntimeRestart(_Out, kw_only=True):
    """Why the agent asks for the sandbox container to be restarted.

    kill_not_confirmed: the runner did not confirm a kill within
    SANDBOX_AGENT_KILL_GRACE. runner_unresponsive: it answered no ping for
    SANDBOX_AGENT_RUNNER_STALL_SECONDS while commands ran.
    """

    reason: RestartReason
    message: str
    since: Annotated[str, Meta(description="RFC 3339 UTC")]
    executions: Annotated[list[str], Meta(description="Executions the runner could not end")]


class RuntimeLiveness(_Out, kw_only=True, omit_defaults=True):
    status: Literal["ok", "restart_requested"]
    reason: RestartReason | None = None
    message: str | None = None
    since: str | None = None
    executions: list[str] | None = None


class EnvironmentRequest(_Base, kw_only=True):
    env: Annotated[
        dict[EnvName, EnvValue],
        Meta(max_length=1000, description="Set for new commands (after `unset`)"),
    ] = msgspec.field(default_factory=dict)
    unset: Annotated[
        list[EnvName],
        Meta(max_length=1000, description="Removed from the runner's environment (no repeats)"),
    ] = msgspec.field(default_factory=list)


class EnvironmentView(_Out, kw_only=True):
    env: dict[str, str]
    unset: Annotated[list[str], Meta(description="Sorted")]
    hash: Annotated[
        str,
        Meta(
            description='sha256 (lowercase hex) of json.dumps({"env": env, "unset": '
            'sorted(unset)}, sort_keys=True, separators=(",", ":")) (ASCII escapes)'
        ),
    ]


class WorkspaceUsage(_Out, kw_only=True):
    """statvfs(2) of the workspace: its filesystem's size as non-root users see it."""

    total_bytes: int
    used_bytes: int
    available_bytes: Annotated[int, Meta(description="What a write may still use")]


class SandboxLimits(_Out, kw_only=True):
    """The sandbox container's cgroup counters (since the container started);
    null where its cgroup mount does not show them (gVisor, say)."""

    pids_current: int | None = None
    pids_limit: Annotated[
        int | None, Meta(description="The container cgroup's own limit; the pod's is not shown")
    ] = None
    pids_refused: Annotated[
        int | None, Meta(description="Process starts refused by a PID limit (pids.events max)")
    ] = None
    cpu_periods: int | None = None
    cpu_throttled_periods: Annotated[
        int | None, Meta(description="CFS periods in which the CPU limit stopped it")
    ] = None
    cpu_throttled_seconds: float | None = None


class Info(_Out, kw_only=True):
    version: str
    runner_version: str | None
    runner_connected: bool
    runner_uid: int | None = None
    runner_python: str | None = None
    last_activity: Annotated[str, Meta(description="RFC 3339 UTC; exec and file calls only")]
    active_executions: Annotated[
        int,
        Meta(
            description="Commands running now, and code runs in progress (the operator's "
            "idle timeout does not run while any is)"
        ),
    ]
    started_at: str
    uptime_seconds: float
    workspace: str
    workspace_usage: Annotated[
        WorkspaceUsage | None, Meta(description="null when the workspace cannot be read")
    ] = None
    limits: Annotated[
        SandboxLimits | None, Meta(description="null when the runner does not answer")
    ] = None
    runtime_restart_requested: Annotated[
        bool, Meta(description="GET /livez/runtime answers 503: the sandbox container must restart")
    ] = False
    runtime_restart: RuntimeRestart | None = None
    environment_hash: Annotated[str, Meta(description="hash of the PUT /v1/environment overlay")]
    default_timeout_seconds: float
    max_timeout_seconds: Annotated[float, Meta(description="Largest timeoutSeconds accepted")]


class SyncResult(_Out, kw_only=True):
    synced: bool
    duration_seconds: float


class QuiesceRequest(_Base, kw_only=True):
    # The bound holds whatever happens to the caller (a crashed operator).
    seconds: Annotated[
        float, Meta(gt=0, le=600, description="Resume by itself after this long")
    ] = 60.0


class QuiesceResult(_Out, kw_only=True):
    quiesced: Annotated[
        list[str],
        Meta(description="Ids of the running executions and terminals now stopped (SIGSTOP)"),
    ]
    resume_at: Annotated[str | None, Meta(description="RFC 3339 UTC; None when resumed")]
    synced: bool
    duration_seconds: float


# -- files ----------------------------------------------------------------


class FileInfo(_Out, kw_only=True):
    path: str
    name: str
    type: Literal["file", "directory", "symlink", "other"]
    size: int
    mode: Annotated[str, Meta(description="Permission bits in octal, e.g. '0644'")]
    modified_at: str
    uid: int
    gid: int
    symlink_target: str | None = None


class FileList(_Out, kw_only=True):
    path: str
    entries: list[FileInfo]
    truncated: bool


class WriteRequest(_Base, kw_only=True):
    path: Path
    content: str | None = None
    content_base64: str | None = None
    mode: OctalMode | None = None
    parents: bool = True


class MkdirRequest(_Base, kw_only=True):
    path: Path
    parents: bool = True
    mode: OctalMode | None = None
    exist_ok: bool = True


class RemoveRequest(_Base, kw_only=True):
    path: Path
    recursive: Annotated[bool, Meta(description="Remove a directory with its contents")] = False
    missing_ok: Annotated[bool, Meta(description="A missing path is not an error")] = False


class Removed(_Out, kw_only=True):
    path: str
    removed: Annotated[bool, Meta(description="False: it was already missing (missingOk)")]


class MoveRequest(_Base, kw_only=True):
    source: Path
    destination: Path
    overwrite: Annotated[bool, Meta(description="Replace an existing destination")] = False
    parents: Annotated[bool, Meta(description="Create missing parents of the destination")] = True


class SearchRequest(_Base, kw_only=True):
    pattern: Annotated[str, Meta(min_length=1, max_length=4096, description="Python regex")]
    path: Path = "."
    glob: Annotated[str, Meta(max_length=1024)] | None = None
    ignore_case: bool = False
    fixed_string: bool = False
    max_results: Annotated[int, Meta(ge=1)] | None = None
    include_hidden: bool = False


class SearchMatch(_Out, kw_only=True):
    path: str
    line: int
    column: int
    text: str


class SearchResult(_Out, kw_only=True):
    matches: list[SearchMatch]
    truncated: bool
    files_scanned: int
    files_skipped: Annotated[int, Meta(description="Binary, unreadable or over the size cap")]


class FindRequest(_Base, kw_only=True):
    pattern: Annotated[
        str,
        Meta(
            min_length=1,
            max_length=1024,
            description="Glob matched against names, or against relative paths if it has '/'",
        ),
    ]
    path: Path = "."
    type: Literal["file", "directory", "any"] = "any"
    max_depth: Annotated[int, Meta(ge=0, le=256)] | None = None
    max_results: Annotated[int, Meta(ge=1)] | None = None
    include_hidden: bool = True


class FindResult(_Out, kw_only=True):
    paths: list[str]
    truncated: bool


class PatchRequest(_Base, kw_only=True):
    patch: Annotated[str, Meta(min_length=1, description="Unified diff (git or diff -u)")]
    strip: (
        Annotated[
            int,
            Meta(ge=0, le=32, description="Leading components to strip (default: auto a/ b/)"),
        ]
        | None
    ) = None
    dry_run: bool = False


class PatchedFile(_Out, kw_only=True):
    path: str
    status: Literal["modified", "created", "deleted"]
    hunks: int


class PatchResult(_Out, kw_only=True):
    files: list[PatchedFile]
    dry_run: bool


class ReplaceRequest(_Base, kw_only=True):
    path: Path
    find: Annotated[str, Meta(min_length=1)]
    replace: str
    all: Annotated[bool, Meta(description="Replace every match (else exactly one must exist)")] = (
        False
    )
    regex: bool = False
    expected_count: Annotated[int, Meta(ge=0)] | None = None


class ReplaceResult(_Out, kw_only=True):
    path: str
    replacements: Annotated[int, Meta(description="Matches replaced")]


class ArchiveResult(_Out, kw_only=True):
    path: str
    entries: Annotated[int, Meta(description="Archive members extracted")]
    bytes: Annotated[int, Meta(description="File content bytes written")]


# -- terminals ----------------------------------------------------------------

TerminalStatus = Literal["starting", "running", "exited", "failed", "lost"]
Window = Annotated[int, Meta(ge=1, le=1000)]


class TerminalRequest(_Base, kw_only=True):
    command: (
        Annotated[
            str,
            Meta(
                min_length=1,
                max_length=64 << 10,
                description="Shell command line to run on the terminal (SANDBOX_AGENT_SHELL -c)."
                " Neither this nor argv: the sandbox user's login shell.",
            ),
        ]
        | None
    ) = None
    argv: (
        Annotated[
            list[Annotated[str, Meta(max_length=64 << 10)]],
            Meta(min_length=1, max_length=1024, description="Program and arguments, no shell"),
        ]
        | None
    ) = None
    env: Annotated[
        dict[EnvName, EnvValue],
        Meta(description="Added to the environment (TERM defaults to xterm-256color)"),
    ] = msgspec.field(default_factory=dict)
    cwd: Path = "."
    cols: Window = 80
    rows: Window = 24
    idle_timeout_seconds: (
        Annotated[
            float,
            Meta(
                ge=0,
                le=7 * 86400,
                description="End the terminal after this long with nobody attached (0: never;"
                " default SANDBOX_AGENT_TERMINAL_IDLE_TIMEOUT, 3600)",
            ),
        ]
        | None
    ) = None


class Terminal(_Out, kw_only=True):
    id: str
    status: Annotated[
        TerminalStatus,
        Meta(
            description="running; exited (exitCode or signal); failed (its program did not "
            "start: message); lost (the runner went away with it: message)"
        ),
    ]
    command: str | None = None
    argv: list[str] | None = None
    cwd: str
    cols: int
    rows: int
    pid: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    message: str | None = None
    created_at: str
    ended_at: str | None = None
    attached: Annotated[int, Meta(description="Viewers attached now")]
    output_cursor: Annotated[int, Meta(description="Offset after the last byte of output")]
    output_start: Annotated[
        int, Meta(description="Offset of the oldest byte still kept (the ring holds the rest)")
    ]
    idle_timeout_seconds: float


class TerminalList(_Out, kw_only=True):
    terminals: list[Terminal]


class TerminalResize(_Base, kw_only=True):
    cols: Window
    rows: Window


class TerminalInput(_Base, kw_only=True):
    data: (
        Annotated[str, Meta(description="UTF-8 text, as typed (\\r: Enter, \\u0003: Ctrl-C)")]
        | None
    ) = None
    data_base64: str | None = None


class TerminalOutput(_Out, kw_only=True):
    cursor: Annotated[int, Meta(description="Offset of the first byte of data")]
    next_cursor: Annotated[int, Meta(description="Where the next read starts")]
    dropped: Annotated[
        int, Meta(description="Bytes between the asked cursor and `cursor` no longer kept")
    ]
    data_base64: str
    status: TerminalStatus
    exit_code: int | None = None
    signal: int | None = None


# -- code contexts (stateful code: a Jupyter kernel per context) ----------------

Language = Literal["python", "javascript"]
ContextStatus = Literal["starting", "idle", "busy", "restarting", "dead"]


class ContextRequest(_Base, kw_only=True):
    language: Annotated[
        Language,
        Meta(
            description="python: an IPython kernel (the image needs ipykernel and "
            "jupyter_client); javascript: a Node.js process (the image needs node)"
        ),
    ] = "python"
    cwd: Path = "."
    env: Annotated[
        dict[EnvName, EnvValue], Meta(description="Added to the kernel's environment")
    ] = msgspec.field(default_factory=dict)


class Context(_Out, kw_only=True):
    id: str
    language: Language
    cwd: str
    status: Annotated[
        ContextStatus,
        Meta(
            description="starting (its kernel is coming up); idle; busy (running code); "
            "restarting; dead (its kernel ended: the next run starts a new one, without "
            "the old state; message says why)"
        ),
    ]
    created_at: str
    last_used_at: str | None = None
    executions: Annotated[int, Meta(description="Code runs in this context")]
    restarts: Annotated[int, Meta(description="Times its kernel was started again")]
    pid: int | None = None
    language_version: str | None = None
    message: str | None = None


class ContextList(_Out, kw_only=True):
    contexts: list[Context]


class CodeRequest(_Base, kw_only=True):
    code: Annotated[str, Meta(max_length=1 << 20, description="The code to run (a cell)")]
    context_id: (
        Annotated[
            str,
            Meta(
                pattern="^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
                description="The context to run in; none: the language's default context, "
                "started on first use",
            ),
        ]
        | None
    ) = None
    language: Annotated[Language, Meta(description="Without contextId: whose default context")] = (
        "python"
    )
    timeout_seconds: Annotated[
        float,
        Meta(
            gt=0,
            le=86400,
            description="Past it the kernel is interrupted (KeyboardInterrupt), and "
            "restarted if that does not end the run; finished says timed_out",
        ),
    ] = 300.0
    env: Annotated[
        dict[EnvName, EnvValue],
        Meta(
            max_length=256,
            description="Set in the kernel's environment for this run only: the values "
            "the variables had before come back when it ends",
        ),
    ] = msgspec.field(default_factory=dict)


CodeEventType = Literal["started", "stdout", "stderr", "result", "error", "finished"]
CodeStatus = Literal["ok", "error", "timed_out", "interrupted", "aborted"]


class CodeEvent(_Out, kw_only=True, omit_defaults=True):
    """One event of a code run, in the order the kernel produced them: started,
    then stdout/stderr text, results (display data, and the value of the last
    expression: isMain) and at most one error, then finished."""

    type: CodeEventType
    context_id: str | None = None
    text: str | None = None
    data: Annotated[
        dict[str, Any] | None,
        Meta(description="MIME type -> value: text/plain, text/html, image/png (base64), ..."),
    ] = None
    metadata: dict[str, Any] | None = None
    is_main: bool | None = None
    execution_count: int | None = None
    name: str | None = None
    value: str | None = None
    traceback: list[str] | None = None
    status: CodeStatus | None = None
    duration_ms: int | None = None
    dropped_bytes: Annotated[
        int | None,
        Meta(
            description="Output and results left out (their size, roughly in bytes) because "
            "the client read slower than the code produced them (16 MiB are held)"
        ),
    ] = None
    restarted: Annotated[
        bool | None, Meta(description="The kernel was started again (its state is gone)")
    ] = None
    message: str | None = None
