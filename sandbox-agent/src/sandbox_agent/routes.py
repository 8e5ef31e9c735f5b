"""The route table: every operation of the HTTP API, as data.

app.py builds the Starlette routes from it, openapi.py the document, the auth
middleware its public paths, and requests' parameters are parsed and bounded
from the ``Param``s declared here. Summaries and descriptions are the
handlers' docstrings. Adding an endpoint means a handler in an ``api_*``
module and an entry here; nothing else lists routes.
"""

from __future__ import annotations

from . import (
    api_contexts,
    api_environment,
    api_exec,
    api_files,
    api_health,
    api_info,
    api_terminals,
    api_workspace,
    models,
)
from .routing import GatewayAccess, Op, Param

# -- parameters (the bounds declared here are the ones enforced) --------------
# The gateway matches a path segment against this pattern before it forwards.
ID = Param(
    "id",
    "string",
    "Execution id",
    required=True,
    location="path",
    pattern="^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
)
TERMINAL_ID = Param(
    "id", "string", "Terminal id", required=True, location="path", pattern=ID.pattern
)
WATCHER_ID = Param("id", "string", "Watcher id", required=True, location="path", pattern=ID.pattern)
CONTEXT_ID = Param(
    "id", "string", "Code context id", required=True, location="path", pattern=ID.pattern
)
PATH = Param("path", "string", "Path relative to the workspace", required=True)
DIR = Param("path", "string", "Directory relative to the workspace", default=".")
ENCODING = Param("encoding", "string", "Output encoding in JSON", enum=("utf-8", "base64"))
STATUS = Param(
    "status",
    "string",
    "Only this status",
    enum=("running", "completed", "timed_out", "cancelled", "failed", "lost"),
)
WAIT_READY = Param(
    "waitSeconds",
    "number",
    "Hold the answer until the runner connects, up to this long",
    default=0.0,
    minimum=0,
    maximum=5,
)
OUTPUT = Param("output", "boolean", "Include stdout/stderr", default=True)
WAIT_EXIT = Param(
    "waitSeconds",
    "number",
    "Wait up to this long for the exit",
    default=0.0,
    minimum=0,
    maximum=600,
)
WAIT_OUTPUT = Param(
    "waitSeconds", "number", "Wait for new output", default=0.0, minimum=0, maximum=60
)
CURSOR = Param("cursor", "integer", "From outputCursor / a previous page", default=0, minimum=0)
MAX_BYTES = Param("maxBytes", "integer", "Page size", default=1 << 20, minimum=1, maximum=16 << 20)
BYTE_RANGE = (
    Param("offset", "integer", "First byte", minimum=0),
    Param("length", "integer", "Number of bytes", minimum=0),
)
LINE_RANGE = (
    Param("startLine", "integer", "First line (1-based)", minimum=1),
    Param("lineCount", "integer", "Number of lines", minimum=0),
)
MODE = Param("mode", "string", "Octal permission bits, e.g. 0644", pattern="^0?[0-7]{3,4}$")
FOLLOW = Param(
    "follow",
    "boolean",
    "Describe what a final symlink points to (inside the workspace)",
    default=False,
)
PARENTS = Param("parents", "boolean", "Create missing parent directories", default=True)
DEPTH = Param("depth", "integer", "Levels to descend", default=1, minimum=1, maximum=64)
HIDDEN = Param("hidden", "boolean", "Include dot files", default=True)
GZIP = Param("gzip", "boolean", "gzip the tar", default=False)
RECURSIVE = Param(
    "recursive", "boolean", "Watch subdirectories too, and those made later", default=False
)
WATCH_TIMEOUT = Param(
    "timeoutSeconds",
    "number",
    "End the stream (finished) after this long; 0: never",
    default=0.0,
    minimum=0,
    maximum=86400,
)

# -- what the gateway demands before it forwards (None: never forwarded) -------
VIEW: GatewayAccess = "view"
EXEC_ACCESS: GatewayAccess = "exec"
READS: GatewayAccess = "files:read"
WRITES: GatewayAccess = "files:write"

# -- documented error statuses ---------------------------------------------------
EXEC = (409, 413, 429, 503)  # starting a command
RUNNING = (404, 409)  # acting on an execution that may have ended
READ = (400, 403, 404)  # naming a path
WRITE = (*READ, 409, 413)

# One operation, one or two lines: a table reads better than one argument a line.
# fmt: off
OPS: tuple[Op, ...] = (
    # health and info: the probes need no token; none of this is user activity
    Op("GET", "/healthz", api_health.healthz, models.Health, access="public"),
    Op("GET", "/readyz", api_health.readyz, models.Readiness,
       more={503: models.Readiness}, params=(WAIT_READY,), access="public"),
    Op("GET", "/livez/runtime", api_health.runtime_liveness, models.RuntimeLiveness,
       more={503: models.RuntimeLiveness}, access="public"),
    Op("GET", "/metrics", api_info.metrics_text, "prometheus", access="metrics"),
    Op("GET", "/openapi.json", api_info.openapi_json, "object"),
    Op("GET", "/v1/info", api_info.info, models.Info, gateway=VIEW),
    # the workspace as a whole
    Op("POST", "/v1/workspace/sync", api_workspace.workspace_sync, models.SyncResult),
    Op("POST", "/v1/workspace/quiesce", api_workspace.workspace_quiesce, models.QuiesceResult,
       errors=(503,), body=models.QuiesceRequest, body_required=False),
    Op("POST", "/v1/workspace/resume", api_workspace.workspace_resume, models.QuiesceResult),
    Op("GET", "/v1/environment", api_environment.environment_get, models.EnvironmentView),
    Op("PUT", "/v1/environment", api_environment.environment_put, models.EnvironmentView,
       errors=(413, 507), body=models.EnvironmentRequest),
    # executions
    Op("POST", "/v1/executions", api_exec.exec_create, models.Execution,
       more={202: models.Execution}, errors=EXEC, body=models.ExecRequest, writes=True,
       gateway=EXEC_ACCESS),
    Op("POST", "/v1/executions/stream", api_exec.exec_stream, "events",
       errors=EXEC, body=models.ExecRequest, params=(ENCODING,), writes=True, gateway=EXEC_ACCESS),
    Op("GET", "/v1/executions", api_exec.exec_list, models.ExecutionList, params=(STATUS,),
       gateway=EXEC_ACCESS),
    Op("GET", "/v1/executions/{id}", api_exec.exec_get, models.Execution,
       errors=(404,), params=(ID, OUTPUT, WAIT_EXIT), gateway=EXEC_ACCESS),
    Op("DELETE", "/v1/executions/{id}", api_exec.exec_delete, None,
       status=204, errors=RUNNING, params=(ID,), gateway=EXEC_ACCESS),
    Op("GET", "/v1/executions/{id}/output", api_exec.exec_output, models.OutputPage,
       errors=(404, 410), params=(ID, CURSOR, MAX_BYTES, WAIT_OUTPUT, ENCODING),
       gateway=EXEC_ACCESS),
    Op("GET", "/v1/executions/{id}/stream", api_exec.exec_attach, "events",
       errors=(404, 410), params=(ID, CURSOR, ENCODING), gateway=EXEC_ACCESS),
    Op("POST", "/v1/executions/{id}/stdin", api_exec.exec_stdin, models.StdinResult,
       errors=(*RUNNING, 429), body=models.StdinRequest, params=(ID,), gateway=EXEC_ACCESS),
    Op("POST", "/v1/executions/{id}/signal", api_exec.exec_signal, models.Execution,
       errors=RUNNING, body=models.SignalRequest, params=(ID,), gateway=EXEC_ACCESS),
    Op("POST", "/v1/executions/{id}/cancel", api_exec.exec_cancel, models.Execution,
       errors=(404,), body=models.CancelRequest, body_required=False, params=(ID,),
       gateway=EXEC_ACCESS),
    # terminals
    Op("POST", "/v1/terminals", api_terminals.terminal_create, models.Terminal, status=201,
       errors=(*EXEC, 400), body=models.TerminalRequest, writes=True, gateway=EXEC_ACCESS),
    Op("GET", "/v1/terminals", api_terminals.terminal_list, models.TerminalList,
       gateway=EXEC_ACCESS),
    Op("GET", "/v1/terminals/{id}", api_terminals.terminal_get, models.Terminal,
       errors=(404,), params=(TERMINAL_ID,), gateway=EXEC_ACCESS),
    Op("DELETE", "/v1/terminals/{id}", api_terminals.terminal_delete, None, status=204,
       errors=(404,), params=(TERMINAL_ID,), gateway=EXEC_ACCESS),
    Op("GET", "/v1/terminals/{id}/attach", api_terminals.terminal_attach, "websocket",
       status=101, errors=(404, 426), params=(TERMINAL_ID, CURSOR), gateway=EXEC_ACCESS),
    Op("POST", "/v1/terminals/{id}/input", api_terminals.terminal_input, None, status=204,
       errors=(*RUNNING, 429, 503), body=models.TerminalInput, params=(TERMINAL_ID,),
       gateway=EXEC_ACCESS),
    Op("GET", "/v1/terminals/{id}/output", api_terminals.terminal_output, models.TerminalOutput,
       errors=(404,), params=(TERMINAL_ID, CURSOR, MAX_BYTES, WAIT_OUTPUT),
       gateway=EXEC_ACCESS),
    Op("POST", "/v1/terminals/{id}/resize", api_terminals.terminal_resize, models.Terminal,
       errors=RUNNING, body=models.TerminalResize, params=(TERMINAL_ID,), gateway=EXEC_ACCESS),
    Op("POST", "/v1/terminals/{id}/signal", api_terminals.terminal_signal, models.Terminal,
       errors=RUNNING, body=models.SignalRequest, params=(TERMINAL_ID,), gateway=EXEC_ACCESS),
    # code contexts (a kernel each: stateful code)
    Op("POST", "/v1/code/run", api_contexts.code_run, "code",
       errors=(400, 404, 409, 429, 503), body=models.CodeRequest, writes=True, gateway=EXEC_ACCESS),
    Op("POST", "/v1/contexts", api_contexts.context_create, models.Context, status=201,
       errors=(400, 409, 429, 503), body=models.ContextRequest, writes=True, gateway=EXEC_ACCESS),
    Op("GET", "/v1/contexts", api_contexts.context_list, models.ContextList,
       gateway=EXEC_ACCESS),
    Op("GET", "/v1/contexts/{id}", api_contexts.context_get, models.Context,
       errors=(404,), params=(CONTEXT_ID,), gateway=EXEC_ACCESS),
    Op("DELETE", "/v1/contexts/{id}", api_contexts.context_delete, None, status=204,
       errors=(404,), params=(CONTEXT_ID,), gateway=EXEC_ACCESS),
    Op("POST", "/v1/contexts/{id}/restart", api_contexts.context_restart, models.Context,
       errors=(404, 409, 503), params=(CONTEXT_ID,), gateway=EXEC_ACCESS),
    Op("POST", "/v1/contexts/{id}/interrupt", api_contexts.context_interrupt, models.Context,
       errors=(404, 503), params=(CONTEXT_ID,), gateway=EXEC_ACCESS),
    # files
    Op("GET", "/v1/files/content", api_files.file_read, "binary",
       errors=(*READ, 413), params=(PATH, *BYTE_RANGE, *LINE_RANGE), gateway=READS),
    Op("PUT", "/v1/files/content", api_files.file_write_raw, models.FileInfo,
       errors=WRITE, body="binary", params=(PATH, MODE, PARENTS), writes=True, gateway=WRITES),
    Op("POST", "/v1/files/write", api_files.file_write_json, models.FileInfo,
       errors=WRITE, body=models.WriteRequest, writes=True, gateway=WRITES),
    Op("GET", "/v1/files/stat", api_files.file_stat, models.FileInfo,
       errors=READ, params=(PATH, FOLLOW), gateway=READS),
    Op("GET", "/v1/files/list", api_files.file_list, models.FileList,
       errors=READ, params=(DIR, DEPTH, HIDDEN), gateway=READS),
    Op("POST", "/v1/files/mkdir", api_files.file_mkdir, models.FileInfo,
       errors=WRITE, body=models.MkdirRequest, writes=True, gateway=WRITES),
    Op("POST", "/v1/files/remove", api_files.file_remove, models.Removed,
       errors=WRITE, body=models.RemoveRequest, writes=True, gateway=WRITES),
    Op("POST", "/v1/files/move", api_files.file_move, models.FileInfo,
       errors=WRITE, body=models.MoveRequest, writes=True, gateway=WRITES),
    Op("POST", "/v1/files/search", api_files.file_search, models.SearchResult,
       errors=READ, body=models.SearchRequest, gateway=READS),
    Op("POST", "/v1/files/find", api_files.file_find, models.FindResult,
       errors=READ, body=models.FindRequest, gateway=READS),
    Op("POST", "/v1/files/patch", api_files.file_patch, models.PatchResult,
       errors=WRITE, body=models.PatchRequest, writes=True, gateway=WRITES),
    Op("POST", "/v1/files/replace", api_files.file_replace, models.ReplaceResult,
       errors=WRITE, body=models.ReplaceRequest, writes=True, gateway=WRITES),
    Op("GET", "/v1/files/archive", api_files.archive_download, "tar",
       errors=READ, params=(DIR, GZIP), gateway=READS),
    Op("PUT", "/v1/files/archive", api_files.archive_upload, models.ArchiveResult,
       errors=WRITE, body="tar", params=(DIR,), writes=True, gateway=WRITES),
    Op("GET", "/v1/files/watch", api_files.file_watch, "watch",
       errors=(*READ, 429), params=(DIR, RECURSIVE, WATCH_TIMEOUT), gateway=READS),
    Op("POST", "/v1/files/watchers", api_files.watcher_create, models.PolledWatcher, status=201,
       errors=(*READ, 429), body=models.WatcherRequest, gateway=READS),
    Op("GET", "/v1/files/watchers", api_files.watcher_list, models.WatcherList, gateway=READS),
    Op("GET", "/v1/files/watchers/{id}/events", api_files.watcher_events, models.WatcherEvents,
       errors=(404,), params=(WATCHER_ID,), gateway=READS),
    Op("DELETE", "/v1/files/watchers/{id}", api_files.watcher_delete, None, status=204,
       errors=(404,), params=(WATCHER_ID,), gateway=READS),
)
# fmt: on
