"""Domain errors: what went wrong, as a stable code and a sentence, never an HTTP status.

Modules below the HTTP edge (files, executions, paths, ...) raise these. The
edge (app.py, ``STATUS``) maps each kind to a status in one table, so a
domain module never decides how the web answers, and every error reaches the
caller as ``{"error": {"code", "message", "details"?}}``.

``CODES`` is the one list of the codes the agent answers with, each with its
status and meaning. ``openapi.json`` publishes it (the enum of
``ErrorDetail.code``), and the SDK and the gateway generate their names from
there. ``Code`` is the same list as a type, so mypy refuses a code that is not
in it, dynamic ones included; ``tests/test_error_codes.py`` keeps the two
lists, the raises and the statuses in agreement.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

Code = Literal[
    "already_exists",
    "ambiguous_match",
    "archive_entry_refused",
    "archive_too_large",
    "bad_http",
    "body_too_large",
    "busy",
    "client_disconnected",
    "command_too_large",
    "context_busy",
    "context_not_found",
    "cross_device",
    "directory_not_empty",
    "environment_not_saved",
    "environment_too_large",
    "file_too_large",
    "files_busy",
    "http_error",
    "idempotency_key_reused",
    "inotify_limit",
    "internal_error",
    "invalid_archive",
    "invalid_cursor",
    "invalid_cwd",
    "invalid_environment",
    "invalid_json",
    "invalid_mode",
    "invalid_operation",
    "invalid_patch",
    "invalid_path",
    "invalid_regex",
    "invalid_replacement",
    "invalid_request",
    "invalid_signal",
    "io_error",
    "is_a_directory",
    "kernel_unavailable",
    "log_pruned",
    "match_count_mismatch",
    "method_not_allowed",
    "no_match",
    "no_space",
    "not_a_directory",
    "not_a_file",
    "not_found",
    "not_running",
    "not_text",
    "patch_conflict",
    "patch_too_large",
    "path_escape",
    "path_traversal",
    "permission_denied",
    "quota_exceeded",
    "read_only",
    "read_too_large",
    "replace_too_large",
    "runner_backlogged",
    "runner_unavailable",
    "runner_unresponsive",
    "runtime_restarting",
    "spawn_failed",
    "stdin_backlogged",
    "stdin_closed",
    "still_running",
    "terminal_backlogged",
    "terminal_ended",
    "terminal_not_found",
    "timeout_too_large",
    "too_many_connections",
    "too_many_contexts",
    "too_many_executions",
    "too_many_terminals",
    "too_many_watched_directories",
    "too_many_watched_entries",
    "too_many_watchers",
    "too_many_watches",
    "unauthorized",
    "watcher_not_found",
    "websocket_required",
]


class Listed(NamedTuple):
    """A code's entry: the status it is answered with (several when the kind
    of error depends on the cause; "4xx" for any client error) and what it means."""

    status: str
    meaning: str


# In the order of ``Code``.
CODES: dict[Code, Listed] = {
    "already_exists": Listed("409", "The path (or a move's destination) exists already."),
    "ambiguous_match": Listed(
        "409", "A replace's search text occurs more than once: pass all or expectedCount."
    ),
    "archive_entry_refused": Listed(
        "400",
        "An archive member that is refused (a device, a sparse file...): details.entry names it.",
    ),
    "archive_too_large": Listed(
        "413", "The archive unpacks to more than allowed, or its headers are too large."
    ),
    "bad_http": Listed(
        "400, 431", "Not well-formed HTTP, or headers too large (answered before any route)."
    ),
    "body_too_large": Listed("413", "The request body is over its limit."),
    "busy": Listed("409", "The file is in use (EBUSY, ETXTBSY)."),
    "client_disconnected": Listed("400", "The client went away while its request body was read."),
    "command_too_large": Listed(
        "413", "The command, its arguments and environment do not fit in one request to the runner."
    ),
    "context_busy": Listed(
        "429", "As many runs as allowed already wait for this code context; retry later."
    ),
    "context_not_found": Listed("404", "No code context with this ID."),
    "cross_device": Listed("400", "A move across file systems (EXDEV)."),
    "directory_not_empty": Listed("409", "The directory is not empty (remove it recursively)."),
    "environment_not_saved": Listed(
        "500, 507", "The environment overlay could not be saved (507: the disk is full)."
    ),
    "environment_too_large": Listed(
        "413", "The overlay's names and values together are over the limit."
    ),
    "file_too_large": Listed(
        "413", "The file is over the operation's size limit (or the file system's)."
    ),
    "files_busy": Listed(
        "429",
        "As many searches, patches and replaces run as allowed; retry later.",
    ),
    "http_error": Listed("4xx", "Another refusal at the HTTP level, with its own status."),
    "idempotency_key_reused": Listed(
        "409",
        "The idempotency key was used for a different command: details.id names that execution.",
    ),
    "inotify_limit": Listed(
        "429", "The kernel refuses another inotify instance or watch; retry later."
    ),
    "internal_error": Listed(
        "500", "An unexpected failure of the agent (a bug: its log says more)."
    ),
    "invalid_archive": Listed("400", "Not a valid tar archive, or a truncated one."),
    "invalid_cursor": Listed(
        "400", "The cursor is outside the execution's output log, or not at a record boundary."
    ),
    "invalid_cwd": Listed("400", "The working directory is not a directory in the workspace."),
    "invalid_environment": Listed(
        "400", "The environment overlay is not consistent (a name unset twice)."
    ),
    "invalid_json": Listed("400", "The body is not well-formed JSON."),
    "invalid_mode": Listed("400", "The file mode asks for set-user-ID or set-group-ID bits."),
    "invalid_operation": Listed(
        "400", "Not possible on this path (a directory moved into itself; EINVAL)."
    ),
    "invalid_patch": Listed(
        "400", "The patch cannot be read (no file headers, a malformed hunk, not Unicode)."
    ),
    "invalid_path": Listed(
        "400",
        "A malformed path (too long, NUL, backslash), or the workspace root where it cannot be.",
    ),
    "invalid_regex": Listed("400", "The regular expression is not valid RE2."),
    "invalid_replacement": Listed(
        "400", "The replacement is not valid for the regular expression (e.g. an unknown group)."
    ),
    "invalid_request": Listed(
        "400",
        "The request does not fit the operation: a parameter, a body field, a combination.",
    ),
    "invalid_signal": Listed("400", "Not a known signal name or number."),
    "io_error": Listed("500", "An unexpected operating-system failure on a file."),
    "is_a_directory": Listed("400", "The path is a directory where a file is needed."),
    "kernel_unavailable": Listed(
        "409, 503",
        "The code context's kernel did not start (409: the image has none for the language).",
    ),
    "log_pruned": Listed(
        "410", "That part of the output log is no longer kept (its cap, or an agent restart)."
    ),
    "match_count_mismatch": Listed(
        "409", "A replace's search text occurs another number of times than expectedCount."
    ),
    "method_not_allowed": Listed("405", "The path is served, but not with this method."),
    "no_match": Listed("409", "A replace's search text does not occur."),
    "no_space": Listed("507", "The workspace's disk is full."),
    "not_a_directory": Listed("400", "The path, or one of its parents, is not a directory."),
    "not_a_file": Listed("400", "The path is not a regular file (a socket, a device...)."),
    "not_found": Listed("404", "No such file, directory, execution or route."),
    "not_running": Listed("409", "The execution has ended already."),
    "not_text": Listed("400", "The file is not UTF-8 text."),
    "patch_conflict": Listed("409", "The patch does not apply to the files as they are."),
    "patch_too_large": Listed("413", "The patch, or a file it edits, has more lines than allowed."),
    "path_escape": Listed(
        "403",
        "The path leads out of the workspace (through a symbolic link), or through too many links.",
    ),
    "path_traversal": Listed(
        "400", "An absolute path or '..': paths are relative to the workspace."
    ),
    "permission_denied": Listed("403", "The file's permissions do not allow it."),
    "quota_exceeded": Listed("507", "The workspace's quota is used up."),
    "read_only": Listed("403", "That part of the file system is read-only."),
    "read_too_large": Listed(
        "413",
        "The read is over the limit (SANDBOX_AGENT_MAX_READ_BYTES), or a line range scans too far.",
    ),
    "replace_too_large": Listed("413", "The replacement would grow the file past its limit."),
    "runner_backlogged": Listed(
        "429", "The runner is not reading: as many commands as allowed wait for it; retry later."
    ),
    "runner_unavailable": Listed(
        "503", "The runner (in the sandbox container) is not connected; retry later."
    ),
    "runner_unresponsive": Listed("503", "The runner did not answer in time."),
    "runtime_restarting": Listed(
        "503",
        "The sandbox container is to be restarted (a command would die with it); retry later.",
    ),
    "spawn_failed": Listed("400", "The terminal's program did not start."),
    "stdin_backlogged": Listed(
        "429", "The runner is not reading: as much stdin as allowed waits for it; retry later."
    ),
    "stdin_closed": Listed("409", "The execution's stdin is not open."),
    "still_running": Listed("409", "The execution is running: cancel it before deleting it."),
    "terminal_backlogged": Listed(
        "429", "The terminal takes input slower than it is sent; retry later."
    ),
    "terminal_ended": Listed("409", "The terminal's program has ended."),
    "terminal_not_found": Listed("404", "No terminal with this ID."),
    "timeout_too_large": Listed(
        "400",
        "The timeout is over the agent's limit (SANDBOX_AGENT_MAX_TIMEOUT): details.maximum.",
    ),
    "too_many_connections": Listed("503", "The agent holds as many connections as it takes."),
    "too_many_contexts": Listed("429", "As many code contexts exist as allowed: delete one."),
    "too_many_executions": Listed("429", "As many executions run as allowed; retry later."),
    "too_many_terminals": Listed("429", "As many terminals run as allowed: kill one."),
    "too_many_watched_directories": Listed(
        "429", "The watched tree has more directories than a watch takes: watch a smaller tree."
    ),
    "too_many_watched_entries": Listed(
        "429", "The polled tree has more entries than a watch scans: watch a smaller tree."
    ),
    "too_many_watchers": Listed("429", "As many watchers exist as allowed: remove one."),
    "too_many_watches": Listed("429", "As many watches are open as allowed: close one."),
    "unauthorized": Listed("401", "The bearer token is missing or wrong."),
    "watcher_not_found": Listed("404", "No watcher with this ID (removed, or idle too long)."),
    "websocket_required": Listed("426", "The path is a WebSocket: upgrade the request."),
}


def error_body(code: Code, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """An error answer: ``{"error": {"code", "message", "details"?}}``."""
    err: dict[str, Any] = {"code": code, "message": message}
    if details is not None:
        err["details"] = details
    return {"error": err}


class AgentError(Exception):
    """Base of every error a caller is meant to see; ``code`` is machine-readable."""

    def __init__(self, code: Code, message: str, **details: Any) -> None:
        super().__init__(message)
        self.code: Code = code
        self.message = message
        self.details = details or None

    def body(self) -> dict[str, Any]:
        return error_body(self.code, self.message, self.details)


class Invalid(AgentError):
    """The request itself is wrong: syntax, ranges, combinations."""


class Forbidden(AgentError):
    """Well-formed but refused: the path leaves the workspace, permissions."""


class NotFound(AgentError):
    """The thing named does not exist."""


class Conflict(AgentError):
    """The current state does not allow it (exists, still running, no match)."""


class Gone(AgentError):
    """It existed but is no longer kept (a pruned output log)."""


class TooLarge(AgentError):
    """Over a size limit."""


class Busy(AgentError):
    """Over a limit on concurrent work; retry later."""


class Unavailable(AgentError):
    """Something the request needs is not there right now (the runner); retry later."""


class NoSpace(AgentError):
    """The disk or quota is full."""


class IOFailure(AgentError):
    """An unexpected operating-system failure (not the caller's fault)."""
