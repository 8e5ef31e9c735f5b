"""The tools: their JSON schemas (what a model reads) and what each does with
the session's sandbox through the SDK. Failures become `ToolFailure` with a
reason the model can act on; `server.py` turns them into `isError` results."""

from __future__ import annotations

import re
import shlex
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
from jsonschema import Draft202012Validator, ValidationError  # type: ignore[import-untyped]

from sandbox_sdk import AsyncSandbox
from sandbox_sdk._async.code import DEFAULT_CODE_TIMEOUT
from sandbox_sdk._async.executions import DEFAULT_TIMEOUT, AsyncJob
from sandbox_sdk._async.files import AsyncFiles
from sandbox_sdk._wire import MAX_TIMEOUT
from sandbox_sdk.errors import (
    CommandLost,
    CommandTimeout,
    Conflict,
    Forbidden,
    Gone,
    Invalid,
    NotFound,
    NotReady,
    Paused,
    SandboxError,
    Timeout,
    Unauthorized,
)
from sandbox_sdk.models import agent
from sandbox_sdk.models.agent_codes import AgentErrorCode
from sandbox_sdk.types import CommandResult

JSON = dict[str, Any]
FILE_TIMEOUT = 60.0  # every file operation's bound
READ_LIMIT = 256 * 1024  # characters of one read returned to the model
OUTPUT_LIMIT = 64 * 1024  # characters of each stream of a command's result
# The script is bash's argument (`bash -c SCRIPT`: the agent's own `command`
# form runs its configured shell, /bin/sh), and Linux refuses one argument of
# more than 128 KiB with its NUL (MAX_ARG_STRLEN).
SHELL = "bash"
MAX_SCRIPT_BYTES = 128 * 1024 - 1
# (how far it got since the last report, what to say): MCP progress notifications
# while a call waits (seconds) or a command runs (characters of output); the
# server adds them up, since a notification's progress must only grow.
Progress = Callable[[float, str], Awaitable[None]]


class ToolFailure(Exception):
    """A tool's failure, worded for the model: `kind` (timeout, not_found,
    forbidden, not_ready, command_failed, interrupted, invalid, conflict...) and
    what to do."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message

    def text(self) -> str:
        return f"{self.kind}: {self.message}"


def _with_output(kind: str, message: str, result: object) -> ToolFailure:
    """A failure of a command, followed by what output it left."""
    output = _command_text(result) if isinstance(result, CommandResult) else ""
    return ToolFailure(kind, f"{message}\n{output}".rstrip())


# The agent's 403s (sandbox-agent's paths.py and files.py): its file system's
# refusals, with what the model can do instead.
AGENT_REFUSALS: dict[str, str] = {
    AgentErrorCode.PATH_ESCAPE: "it leads outside the workspace (through a symbolic link);"
    " only paths inside the workspace can be used",
    AgentErrorCode.PERMISSION_DENIED: "the file's permissions do not allow it (see `ls -l`;"
    " chmod it with sandbox_run_command if it is yours)",
    AgentErrorCode.READ_ONLY: "that part of the file system is read-only",
}


def failure(exc: SandboxError) -> ToolFailure:
    """The SDK's typed error as the model should read it."""
    if isinstance(exc, CommandTimeout):
        return _with_output(
            "timeout",
            f"{exc.message}; run it in the background (`nohup ... &`) or pass a larger"
            f" timeout_seconds (at most {MAX_TIMEOUT:.0f}).",
            exc.result,
        )
    if isinstance(exc, CommandLost) and exc.code == "spawn_failed":
        # Nothing ran: not the "may have partly run" of a restart.
        return ToolFailure("error", f"the command could not be started: {exc}")
    if isinstance(exc, CommandLost):
        return _with_output(
            "interrupted",
            f"{exc}; it may have partly run: check what it changed before running it again.",
            exc.result,
        )
    if isinstance(exc, NotFound):
        return ToolFailure("not_found", str(exc))
    if isinstance(exc, Forbidden) and exc.code in AGENT_REFUSALS:
        # The sandbox's own file system said no, not Kubernetes: RBAC would
        # send the model looking for permissions it cannot change.
        return ToolFailure("forbidden", f"{exc}: {AGENT_REFUSALS[exc.code]}")
    if isinstance(exc, Unauthorized | Forbidden):
        return ToolFailure("forbidden", f"{exc} (the caller's Kubernetes RBAC decides this)")
    if isinstance(exc, Paused):
        return ToolFailure("not_ready", f"{exc}; the session resumes it on the next call")
    if isinstance(exc, NotReady):
        # A wait that ran out leaves the sandbox starting: the next call waits on.
        more = "; it goes on starting: call again to wait longer" if exc.code == "timeout" else ""
        return ToolFailure(
            "not_ready", f"the sandbox is not ready ({exc.reason or exc.code}): {exc}{more}"
        )
    if isinstance(exc, Timeout):
        return ToolFailure("timeout", str(exc))
    if isinstance(exc, Invalid):
        return ToolFailure("invalid", str(exc))
    if isinstance(exc, Conflict):
        return ToolFailure("conflict", str(exc))
    return ToolFailure("error", str(exc))


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    schema: JSON
    read_only: bool = False


def _schema(required: list[str], **properties: JSON) -> JSON:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


# The agent's and the gateway's own limits (sandbox-agent/openapi.json, made
# from the agent's code; tests/unit/test_mcp_limits.py holds these to it), so
# that a model learns them from the schema instead of from a refusal.
MAX_PATH = 4096  # the agent's Path
STATUSES = ("running", "completed", "failed", "timed_out", "cancelled", "lost")  # Execution
MAX_LISTED = 200  # commands one listing shows (the agent keeps up to 1,000)
ATTACH_WAIT = 60.0  # a re-attach's default wait for the end
MAX_DEPTH = 64  # GET /v1/files/list ?depth
MAX_SEARCH_RESULTS = 1000  # SANDBOX_AGENT_SEARCH_MAX_RESULTS: more are cut there
MAX_REGEX = 4096  # SearchRequest.pattern
MAX_GLOB = 1024  # SearchRequest.glob, FindRequest.pattern
# A fuzzy query becomes a glob of up to 5 characters a letter ('*[mM]'), within MAX_GLOB.
MAX_FUZZY_QUERY = (MAX_GLOB - 1) // 5
MAX_STRIP = 32  # PatchRequest.strip
MAX_URL_SECONDS = 86400  # the gateway's max_token_seconds (its default)
OCTAL_MODE = "^0?[0-7]{3,4}$"  # the agent's OctalMode
SNAPSHOT_TAG = "^[A-Za-z0-9][-._A-Za-z0-9]*$"  # Snapshot spec.tag (at most 128)
MAX_CODE = 1 << 20  # CodeRequest.code
MAX_CODE_TIMEOUT = 86400  # CodeRequest.timeoutSeconds
CONTEXT_ID = "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # CodeRequest.contextId
# Images a code run returns to the model, at most (each is base64 in the reply).
MAX_IMAGES = 8

PATH = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_PATH,
    "description": "Path relative to the workspace root ('.' is the root)",
}

TOOLS = [
    Tool(
        "sandbox_read_file",
        "Read a text file of the sandbox's workspace, with line numbers. Pass start_line"
        " and line_count to read a range of a long file.",
        _schema(
            ["path"],
            path=PATH,
            start_line={"type": "integer", "minimum": 1, "description": "First line, 1-based"},
            line_count={"type": "integer", "minimum": 1, "description": "How many lines"},
            line_numbers={
                "type": "boolean",
                "default": True,
                "description": "Prefix each line with its number and a tab",
            },
        ),
        read_only=True,
    ),
    Tool(
        "sandbox_write_file",
        "Create or overwrite a file (atomically; parent directories are created).",
        _schema(
            ["path", "content"],
            path=PATH,
            content={"type": "string", "description": "The whole new content"},
            mode={
                "type": "string",
                "pattern": OCTAL_MODE,
                "description": "Octal permissions, e.g. '755'",
            },
        ),
    ),
    Tool(
        "sandbox_delete_file",
        "Delete a file, or a directory with everything in it.",
        _schema(["path"], path=PATH),
    ),
    Tool(
        "sandbox_list_directory",
        "List a directory: one entry a line, directories ending in '/', files with their size.",
        _schema(
            [],
            path={**PATH, "default": "."},
            depth={"type": "integer", "minimum": 1, "maximum": MAX_DEPTH, "default": 1},
        ),
        read_only=True,
    ),
    Tool(
        "sandbox_run_command",
        "Run a bash script (`bash -c SCRIPT`: [[ ]], arrays and `set -o pipefail` work) in the"
        " workspace and return its exit code and output."
        f" It is stopped after timeout_seconds ({DEFAULT_TIMEOUT:.0f} by default, at most"
        f" {MAX_TIMEOUT:.0f}); start long servers in the background. Output arrives as"
        " progress notifications while it runs. Installed packages and files persist for the"
        " session. A call cut off before its result (a lost connection, a restarted server)"
        " leaves the command running: find it with sandbox_list_commands instead of running"
        " it again.",
        _schema(
            ["command"],
            command={
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_SCRIPT_BYTES,
                "description": "A bash script, at most 128 KiB (UTF-8): write a longer one to"
                " a file and run `bash FILE`",
            },
            cwd={
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_PATH,
                "description": "Working directory relative to the workspace",
            },
            timeout_seconds={
                "type": "number",
                "exclusiveMinimum": 0,
                "maximum": MAX_TIMEOUT,
                "default": DEFAULT_TIMEOUT,
            },
            env={
                "type": "object",
                # What the agent refuses: empty names, '=' in a name, NUL anywhere.
                "propertyNames": {"pattern": "^[^=\\x00]+$"},
                "additionalProperties": {"type": "string", "pattern": "^[^\\x00]*$"},
                "description": "Extra environment variables",
            },
            stdin={"type": "string", "description": "Text on the command's standard input"},
        ),
    ),
    Tool(
        "sandbox_run_code",
        "Run Python code in a Jupyter kernel whose state stays between calls: variables,"
        " imports, functions and loaded data from earlier calls are still there (like cells"
        " of a notebook). Returns what it printed, the value of the last expression, figures"
        " (matplotlib) as images and tables as text, or the exception with its traceback;"
        " the kernel stays usable after an error. Past timeout_seconds the code is interrupted"
        " (KeyboardInterrupt) and its state kept. Use sandbox_run_command for shell work.",
        _schema(
            ["code"],
            code={
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_CODE,
                "description": "Python source, run as one notebook cell",
            },
            context_id={
                "type": "string",
                "pattern": CONTEXT_ID,
                "description": "A separate kernel to run in (made with the SDK); default: the"
                " session's shared kernel",
            },
            timeout_seconds={
                "type": "number",
                "exclusiveMinimum": 0,
                "maximum": MAX_CODE_TIMEOUT,
                "default": DEFAULT_CODE_TIMEOUT,
            },
        ),
    ),
    Tool(
        "sandbox_list_commands",
        "List the commands of this session's sandbox, newest first: those running and those"
        " finished recently, each with its id, status, exit code, start time and script."
        " After a call that was cut off (a lost connection, a restarted MCP server) look"
        " here before running a command again: one still running or already finished must"
        " not run twice; sandbox_command_output re-attaches to it by id.",
        _schema(
            [],
            status={"type": "string", "enum": list(STATUSES), "description": "Only these"},
            limit={"type": "integer", "minimum": 1, "maximum": MAX_LISTED, "default": 20},
        ),
        read_only=True,
    ),
    Tool(
        "sandbox_command_output",
        "Re-attach to a command of sandbox_list_commands by its id (it is never run again):"
        " wait up to wait_seconds for it to finish, its output arriving as progress"
        " notifications, and return its exit code and output as sandbox_run_command does;"
        " one still running then answers with its output so far (call again to wait more).",
        _schema(
            ["id"],
            id={"type": "string", "minLength": 1, "description": "From sandbox_list_commands"},
            wait_seconds={
                "type": "number",
                "minimum": 0,
                "maximum": MAX_TIMEOUT,
                "default": ATTACH_WAIT,
            },
        ),
        read_only=True,
    ),
    Tool(
        "sandbox_grep_files",
        "Search file contents by regular expression: RE2 syntax (as Go's regexp and ripgrep:"
        " no backreferences, no lookahead or lookbehind); one match a line as"
        " path:line:column: text. Binary files, files over 8 MiB and dot files are skipped.",
        _schema(
            ["pattern"],
            pattern={
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_REGEX,
                "description": "An RE2 regular expression",
            },
            path={**PATH, "default": "."},
            glob={
                "type": "string",
                "maxLength": MAX_GLOB,
                "description": "Only files whose name matches, e.g. '*.py'",
            },
            ignore_case={"type": "boolean", "default": False},
            fixed_string={"type": "boolean", "default": False, "description": "Not a regex"},
            max_results={
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_SEARCH_RESULTS,
                "default": 200,
            },
        ),
        read_only=True,
    ),
    Tool(
        "sandbox_find_files",
        "Find files by approximate name: the query's characters in order, any case"
        " ('mdl' finds models.py); a query with * ? or [ is a glob instead. Best matches first.",
        _schema(
            ["query"],
            query={"type": "string", "minLength": 1, "maxLength": MAX_FUZZY_QUERY},
            path={**PATH, "default": "."},
            max_results={
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_SEARCH_RESULTS,
                "default": 50,
            },
        ),
        read_only=True,
    ),
    Tool(
        "sandbox_apply_patch",
        "Apply a unified diff (as `git diff` or `diff -u` write it) to any number of files:"
        " all hunks apply or none, and a conflict names the hunk that does not.",
        _schema(
            ["patch"],
            patch={"type": "string", "minLength": 1, "description": "The unified diff"},
            strip={
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_STRIP,
                "default": 1,
                "description": "Leading path components to strip (1 for a/ b/ prefixes)",
            },
        ),
    ),
    Tool(
        "sandbox_find_replace",
        "Replace text in one file. Fails when nothing matches, or when several places"
        " match and `all` is not set (then make `find` longer to be unique).",
        _schema(
            ["path", "find", "replace"],
            path=PATH,
            find={"type": "string", "minLength": 1},
            replace={"type": "string"},
            all={"type": "boolean", "default": False, "description": "Replace every match"},
            regex={"type": "boolean", "default": False, "description": "`find` is a regex"},
        ),
    ),
    Tool(
        "sandbox_download_url",
        "A URL that downloads a file (a directory: as a tar) of the workspace without"
        " credentials until it expires: give it to the user.",
        _schema(
            ["path"],
            path=PATH,
            ttl_seconds={
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_URL_SECONDS,
                "default": 600,
            },
        ),
        read_only=True,
    ),
    Tool(
        "sandbox_create",
        "Create this session's sandbox now, with a runtime, image or snapshot of your choice"
        " (otherwise the first tool call creates one from the server's defaults). Fails when"
        " the session has one already: sandbox_destroy it first.",
        _schema(
            [],
            runtime={"type": "string", "description": "A runtime of the operator's catalog"},
            image={"type": "string", "description": "A container image instead"},
            from_snapshot={"type": "string", "description": "Start from this Snapshot"},
        ),
    ),
    Tool(
        "sandbox_snapshot",
        "Snapshot the session's workspace (files and installed packages); returns the"
        " Snapshot's name for sandbox_restore.",
        _schema(
            [],
            tag={
                "type": "string",
                "pattern": SNAPSHOT_TAG,
                "maxLength": 128,
                "description": "A label for it, e.g. 'before-refactor'",
            },
            description={"type": "string", "maxLength": 1024},
        ),
    ),
    Tool(
        "sandbox_restore",
        "Roll the session's workspace back to a snapshot (running commands are stopped).",
        _schema(
            ["snapshot"],
            snapshot={"type": "string", "minLength": 1, "description": "The Snapshot's name"},
        ),
    ),
    Tool(
        "sandbox_destroy",
        "Delete the session's sandbox and its workspace; the next tool call starts a new one.",
        _schema([]),
    ),
]
BY_NAME = {tool.name: tool for tool in TOOLS}
# Compiled once: a call is checked against its tool's schema in microseconds.
_VALIDATORS = {tool.name: Draft202012Validator(tool.schema) for tool in TOOLS}


def _takes(tool: Tool) -> str:
    required = set(tool.schema["required"])
    names = [f"{n} (required)" if n in required else n for n in tool.schema["properties"]]
    return f"{tool.name} takes: {', '.join(names) or 'no arguments'}"


def _why(error: ValidationError) -> str:
    """One schema error in words naming the argument, without echoing a long value."""
    where = error.absolute_path
    arg = ".".join(str(p) for p in where) if where else ""
    value = error.instance
    kind = error.validator
    if kind in ("maxLength", "minLength") and isinstance(value, str):
        bound = "at most" if kind == "maxLength" else "at least"
        limit = error.validator_value
        return f"argument {arg!r} is {len(value)} characters long; it takes {bound} {limit}"
    if kind == "pattern" and "propertyNames" in error.schema_path:
        return f"argument {arg!r}: the name {value[:100]!r} does not match {error.validator_value}"
    if kind == "pattern":
        return f"argument {arg!r} does not match {error.validator_value}"
    message = error.message if len(error.message) <= 300 else error.message[:300] + "..."
    return f"argument {arg!r}: {message}" if arg else message


def check(name: str, args: Mapping[str, Any]) -> Tool:
    """The tool, when the arguments are what its schema declares: else the one
    ToolFailure naming every missing, unknown or wrong argument."""
    tool = BY_NAME.get(name)
    if tool is None:
        raise ToolFailure("invalid", f"no tool named {name!r}; see tools/list")
    properties = tool.schema["properties"]
    missing = [n for n in tool.schema["required"] if n not in args]
    unknown = sorted(n for n in args if n not in properties)
    problems = [f"missing argument {n!r}" for n in missing]
    problems += [f"unknown argument {n!r}" for n in unknown]
    # The rest (types, limits) of the arguments it does take.
    known = {k: v for k, v in args.items() if k in properties}
    errors = sorted(_VALIDATORS[name].iter_errors(known), key=lambda e: list(e.absolute_path))
    problems += [_why(e) for e in errors if e.validator != "required"]
    if problems:
        raise ToolFailure("invalid", f"{'; '.join(problems)}. {_takes(tool)}")
    return tool


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"[... {len(text) - limit} characters cut ...]\n{text[-limit:]}"


def _command_text(result: CommandResult) -> str:
    parts = [
        f"exit code: {result.exit_code}" + (f" (signal {result.signal})" if result.signal else "")
    ]
    if result.stdout:
        parts.append(f"stdout:\n{_clip(result.stdout, OUTPUT_LIMIT)}")
    if result.stderr:
        parts.append(f"stderr:\n{_clip(result.stderr, OUTPUT_LIMIT)}")
    return "\n".join(parts)


def fuzzy_glob(query: str) -> str:
    """The glob of names holding the query's characters in order, any case."""
    if any(c in query for c in "*?["):
        return query
    classes = [
        f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.sub(r"([\]\\])", r"[\1]", c)
        for c in query
    ]
    return "*" + "*".join(classes) + "*"


def fuzzy_rank(query: str, paths: list[str]) -> list[str]:
    """Contiguous matches of the name first, then shorter names and paths."""
    q = query.lower()

    def key(path: str) -> tuple[int, int, int, str]:
        name = path.rsplit("/", 1)[-1].lower()
        return (
            0 if q in name else 1,
            0 if name.startswith(q) else 1,
            len(name) + path.count("/"),
            path,
        )

    return sorted(paths, key=key)


async def _file_op(operation: Awaitable[Any], what: str) -> Any:
    try:
        with anyio.fail_after(FILE_TIMEOUT):
            return await operation
    except TimeoutError:
        raise ToolFailure(
            "timeout", f"{what} took longer than {FILE_TIMEOUT:.0f} seconds and was abandoned"
        ) from None


BINARY_PROBE = 8192  # the agent's search calls a file binary by a NUL in this much


def is_binary(head: bytes) -> bool:
    """A NUL in the first 8 KiB (the agent's own test, so read and grep agree),
    or bytes that are no UTF-8 (a character cut at the probe's end aside)."""
    if b"\0" in head[:BINARY_PROBE]:
        return True
    try:
        head[:BINARY_PROBE].decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start < min(len(head), BINARY_PROBE) - 3
    return False


async def _refuse_binary(files: AsyncFiles, path: str) -> None:
    head: bytes = await _file_op(files.read_bytes(path, length=BINARY_PROBE), f"reading {path}")
    if not is_binary(head):
        return  # text that holds U+FFFD or a NUL further on: shown as it is
    info = await _file_op(files.stat(path), f"looking up {path}")
    quoted = shlex.quote(path)
    raise ToolFailure(
        "binary",
        f"{path} is a binary file ({info.size} bytes), not text: this tool shows text only."
        " Give it to the user with sandbox_download_url, or look into it with"
        f" sandbox_run_command (`file {quoted}`, `xxd {quoted} | head -40`,"
        f" `base64 {quoted}`).",
    )


async def run_command(
    sandbox: AsyncSandbox, args: Mapping[str, Any], progress: Progress | None
) -> str:
    timeout = float(args.get("timeout_seconds") or DEFAULT_TIMEOUT)
    script = str(args["command"])
    size = len(script.encode("utf-8", "surrogateescape"))
    if size > MAX_SCRIPT_BYTES:
        raise ToolFailure(
            "invalid",
            f"command is {size} bytes; a command line holds at most {MAX_SCRIPT_BYTES}: write"
            " the script to a file (sandbox_write_file) and run `bash FILE`",
        )
    argv = [SHELL, "-c", script]
    options: JSON = {"cwd": args.get("cwd"), "env": args.get("env"), "stdin": args.get("stdin")}
    result: CommandResult | None
    if progress is None:
        # One request, no stream: nothing to report while it runs.
        result = await sandbox.execute(argv, timeout=timeout, **options)
    else:
        result = None
        async for event in sandbox.stream(argv, timeout=timeout, **options):
            if event.result is not None:
                result = event.result
            elif event.data:
                await progress(len(event.data), event.data)
        if result is None:
            raise ToolFailure("error", "the command's output stream ended before the command did")
    return _outcome(result)


def _outcome(result: CommandResult) -> str:
    """A finished command's result for the model; a failure unless it succeeded."""
    if result.timed_out or result.status == "timed_out":
        raise failure(
            CommandTimeout(
                "the command ran past its timeout"
                f" ({result.execution.timeout_seconds:.0f}s) and was stopped",
                result=result,
                code="timed_out",
            )
        )
    if result.lost:  # as `execute` raises it
        raise failure(CommandLost.of(result))
    if not result.ok:
        raise ToolFailure(
            "command_failed",
            f"the command did not succeed (status {result.status}).\n{_command_text(result)}",
        )
    return _command_text(result)


def _script(execution: agent.Execution) -> str:
    """What a command ran, as the model wrote it (run_command's `bash -c SCRIPT`)."""
    if execution.command is not None:
        return execution.command
    if execution.argv[:2] == [SHELL, "-c"] and len(execution.argv) == 3:
        return execution.argv[2]
    return shlex.join(execution.argv)


async def list_commands(sandbox: AsyncSandbox, args: Mapping[str, Any]) -> str:
    status = args.get("status")
    found = await _file_op(sandbox.jobs(status=status), "listing the commands")
    found.sort(key=lambda e: e.created_at, reverse=True)
    limit = int(args.get("limit", 20))
    lines = []
    for e in found[:limit]:
        state = e.status
        if e.exit_code is not None:
            state += f" (exit code {e.exit_code})"
        elif e.error is not None:
            state += f" ({e.error.code})"
        took = "" if e.duration_seconds is None else f", {e.duration_seconds:.1f}s"
        script = _script(e)
        first = script.strip().splitlines()[0] if script.strip() else script
        if len(first) > 200 or first != script.strip():
            first = first[:200] + " ..."
        lines.append(f"{e.id}  {state}  started {e.created_at}{took}  $ {first}")
    if len(found) > limit:
        lines.append(f"[{len(found) - limit} older: pass a larger limit, or a status]")
    return "\n".join(lines) or ("no commands" + (f" {status}" if status else ""))


async def command_output(
    sandbox: AsyncSandbox, args: Mapping[str, Any], progress: Progress | None
) -> str:
    job = sandbox.job(str(args["id"]))
    await _file_op(job.info(), "looking up the command")  # an unknown id: not_found now
    result: CommandResult | None = None
    with anyio.move_on_after(float(args.get("wait_seconds", ATTACH_WAIT))):
        if progress is not None:
            await _relay_output(job, progress)
        result = await job.wait()
    if result is None:
        info = await _file_op(job.info(), "looking up the command")
        if info.status == "running":
            so_far = await _file_op(job.logs(), "reading its output")
            return (
                f"command {job.id} is still running (started {info.created_at}); call again to"
                " wait more (it is not run again).\n"
                f"output so far:\n{_clip(so_far, OUTPUT_LIMIT)}"
            ).rstrip()
        result = await _file_op(job.wait(), "reading its result")
    return _outcome(result)


async def _relay_output(job: AsyncJob, progress: Progress) -> None:
    """The job's output, all of it from the start, as progress until it ends."""
    cursor = 0
    try:
        while True:
            page = await job.output(cursor, wait=30.0)
            for chunk in page.chunks:
                if chunk.data:
                    await progress(len(chunk.data), chunk.data)
            cursor = page.cursor
            if page.finished or (page.status != "running" and not page.chunks):
                return
    except Gone:
        return  # its log is gone (pruned, or an agent restart): the record still tells


@dataclass(frozen=True)
class CodeReply:
    """A code run for the model: its text, and the images it displayed."""

    text: str
    images: list[tuple[str, str]]  # (MIME type, base64)
    failed: bool


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


async def run_code(sandbox: AsyncSandbox, args: Mapping[str, Any]) -> CodeReply:
    # No progress notifications: a cell's output comes with its result (a
    # long-running job belongs in sandbox_run_command, which streams).
    execution = await sandbox.run_code(
        str(args["code"]),
        context=args.get("context_id"),
        timeout=float(args.get("timeout_seconds") or DEFAULT_CODE_TIMEOUT),
    )
    parts: list[str] = []
    if execution.restarted:
        parts.append(
            "[the kernel was started again: variables from earlier calls are gone"
            + (f" ({execution.message})" if execution.message else "")
            + "]"
        )
    if execution.logs.stdout:
        parts.append("stdout:\n" + _clip("".join(execution.logs.stdout), READ_LIMIT))
    if execution.logs.stderr:
        parts.append("stderr:\n" + _clip("".join(execution.logs.stderr), READ_LIMIT))
    images: list[tuple[str, str]] = []
    for result in execution.results:
        image = next(
            ((m, result.data[m]) for m in ("image/png", "image/jpeg") if m in result.data), None
        )
        if image is not None and isinstance(image[1], str) and len(images) < MAX_IMAGES:
            images.append((image[0], image[1].replace("\n", "")))
            parts.append(f"[image {len(images)}: {image[0]}]")
        elif result.text is not None:
            label = f"Out[{result.execution_count}]" if result.is_main else "display"
            parts.append(f"{label}:\n" + _clip(result.text, READ_LIMIT))
    if execution.error is not None:
        trace = _ANSI.sub("", "\n".join(execution.error.traceback))
        parts.append(
            f"error: {execution.error.name}: {execution.error.value}\n" + _clip(trace, READ_LIMIT)
        )
    if execution.dropped_bytes:
        parts.append(f"[{execution.dropped_bytes} characters of output were left out]")
    text = "\n\n".join(parts) or "(no output)"
    if execution.status == "ok":
        return CodeReply(text, images, failed=False)
    # A failure starts as every tool's does: "kind: what happened".
    seconds = float(args.get("timeout_seconds") or DEFAULT_CODE_TIMEOUT)
    why = {
        "timed_out": f"timeout: the code was interrupted at its timeout ({seconds:g}s)",
        "error": "code_failed: the code raised an exception (the kernel's state is kept)",
        "interrupted": "interrupted: the code was interrupted",
    }.get(execution.status, f"code_failed: the run ended {execution.status}")
    return CodeReply(f"{why}.\n{text}", images, failed=True)


async def call(
    name: str, sandbox: AsyncSandbox, args: Mapping[str, Any], progress: Progress | None
) -> str:
    """Run a sandbox tool (not a lifecycle one) and return its text for the model."""
    files = sandbox.files
    path = str(args.get("path", "."))
    if name == "sandbox_run_command":
        return await run_command(sandbox, args, progress)
    if name == "sandbox_list_commands":
        return await list_commands(sandbox, args)
    if name == "sandbox_command_output":
        return await command_output(sandbox, args, progress)
    if name == "sandbox_read_file":
        start, count = args.get("start_line"), args.get("line_count")
        text: str = await _file_op(
            files.read(path, start_line=start, line_count=count), f"reading {path}"
        )
        if "\0" in text or "\ufffd" in text:
            # Bytes that are not UTF-8 text came back replaced: say what the file is.
            await _refuse_binary(files, path)
        first = int(start or 1)
        lines = text.splitlines()
        if args.get("line_numbers", True):
            width = len(str(first + len(lines)))
            text = "\n".join(f"{n:>{width}}\t{line}" for n, line in enumerate(lines, first))
        if not lines:
            return f"({path} is empty)" if first == 1 else f"({path} has fewer than {first} lines)"
        return _clip(text, READ_LIMIT)
    if name == "sandbox_write_file":
        info = await _file_op(
            files.write(path, args["content"], mode=args.get("mode")), f"writing {path}"
        )
        return f"wrote {info.size} bytes to {info.path}"
    if name == "sandbox_delete_file":
        removed = await _file_op(files.remove(path, recursive=True), f"deleting {path}")
        if not removed:
            raise ToolFailure("not_found", f"{path} does not exist")
        return f"deleted {path}"
    if name == "sandbox_list_directory":
        try:
            entries = await _file_op(
                files.list(path, depth=int(args.get("depth", 1))), f"listing {path}"
            )
        except Invalid as exc:
            # The agent says "not a directory" for a path that is not there at all.
            not_a_dir = exc.code == AgentErrorCode.NOT_A_DIRECTORY
            if not_a_dir and not await _file_op(files.exists(path), path):
                raise ToolFailure("not_found", f"{path} does not exist") from exc
            raise
        lines = [
            f"{e.path}/" if e.type == "directory" else f"{e.path}  ({e.size} bytes)"
            for e in entries
        ]
        return "\n".join(lines) or f"({path} is empty)"
    if name == "sandbox_grep_files":
        found = await _file_op(
            files.grep(
                args["pattern"],
                path,
                glob=args.get("glob"),
                ignore_case=bool(args.get("ignore_case")),
                fixed=bool(args.get("fixed_string")),
                max_results=int(args.get("max_results", 200)),
            ),
            "the search",
        )
        lines = [f"{m.path}:{m.line}:{m.column}: {m.text}" for m in found.matches]
        if found.truncated:
            lines.append("[more matches: narrow the pattern, path or glob]")
        return "\n".join(lines) or "no matches"
    if name == "sandbox_find_files":
        query = str(args["query"])
        paths = await _file_op(files.find(fuzzy_glob(query), path, kind="file"), "finding files")
        ranked = fuzzy_rank(query, paths)[: int(args.get("max_results", 50))]
        return "\n".join(ranked) or "no files match"
    if name == "sandbox_apply_patch":
        patched = await _file_op(
            files.apply_patch(args["patch"], strip=int(args.get("strip", 1))), "applying the patch"
        )
        lines = [f"{f.status} {f.path} ({f.hunks} hunks)" for f in patched.files]
        return "\n".join(lines) or "the patch changed nothing"
    if name == "sandbox_find_replace":
        count = await _file_op(
            files.replace(
                path,
                args["find"],
                args["replace"],
                all=bool(args.get("all")),
                regex=bool(args.get("regex")),
            ),
            f"replacing in {path}",
        )
        return f"{count} replacement{'s' if count != 1 else ''} in {path}"
    if name == "sandbox_download_url":
        # The gateway signs any path: a URL to nothing would only fail in the user's hands.
        await _file_op(files.stat(path), f"looking up {path}")
        return str(
            await _file_op(
                files.download_url(path, ttl=int(args.get("ttl_seconds", 600))), "signing the URL"
            )
        )
    raise ToolFailure("invalid", f"no tool named {name!r}")
