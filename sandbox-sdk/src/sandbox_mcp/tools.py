"""The tools: their JSON schemas (what a model reads) and what each does with
the session's sandbox through the SDK. Failures become `ToolFailure` with a
reason the model can act on; `server.py` turns them into `isError` results."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from sandbox_sdk import AsyncSandbox
from sandbox_sdk._async.client import DEFAULT_TIMEOUT, MAX_TIMEOUT
from sandbox_sdk.errors import (
    CommandLost,
    CommandTimeout,
    Conflict,
    Forbidden,
    Invalid,
    NotFound,
    NotReady,
    Paused,
    SandboxError,
    Timeout,
    Unauthorized,
)
from sandbox_sdk.types import CommandResult

JSON = dict[str, Any]
FILE_TIMEOUT = 60.0  # every file operation's bound
READ_LIMIT = 256 * 1024  # characters of one read returned to the model
OUTPUT_LIMIT = 64 * 1024  # characters of each stream of a command's result
# (progress so far, the new output): MCP progress notifications while a command runs.
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


def failure(exc: SandboxError) -> ToolFailure:
    """The SDK's typed error as the model should read it."""
    if isinstance(exc, CommandTimeout):
        return _with_output(
            "timeout",
            f"{exc.message}; run it in the background (`nohup ... &`) or pass a larger"
            f" timeout_seconds (at most {MAX_TIMEOUT:.0f}).",
            exc.result,
        )
    if isinstance(exc, CommandLost):
        return _with_output(
            "interrupted",
            f"{exc}; it may have partly run: check what it changed before running it again.",
            exc.result,
        )
    if isinstance(exc, NotFound):
        return ToolFailure("not_found", str(exc))
    if isinstance(exc, Unauthorized | Forbidden):
        return ToolFailure("forbidden", f"{exc} (the caller's Kubernetes RBAC decides this)")
    if isinstance(exc, Paused):
        return ToolFailure("not_ready", f"{exc}; the session resumes it on the next call")
    if isinstance(exc, NotReady):
        return ToolFailure(
            "not_ready", f"the sandbox is not ready ({exc.reason or exc.code}): {exc}"
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


PATH = {"type": "string", "description": "Path relative to the workspace root ('.' is the root)"}

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
            mode={"type": "string", "description": "Octal permissions, e.g. '755'"},
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
            depth={"type": "integer", "minimum": 1, "maximum": 10, "default": 1},
        ),
        read_only=True,
    ),
    Tool(
        "sandbox_run_command",
        "Run a shell command (bash -c) in the workspace and return its exit code and output."
        f" It is stopped after timeout_seconds ({DEFAULT_TIMEOUT:.0f} by default, at most"
        f" {MAX_TIMEOUT:.0f}); start long servers in the background. Output arrives as"
        " progress notifications while it runs. Installed packages and files persist for the"
        " session.",
        _schema(
            ["command"],
            command={"type": "string", "description": "A shell script"},
            cwd={"type": "string", "description": "Working directory relative to the workspace"},
            timeout_seconds={
                "type": "number",
                "exclusiveMinimum": 0,
                "maximum": MAX_TIMEOUT,
                "default": DEFAULT_TIMEOUT,
            },
            env={
                "type": "object",
                "additionalProperties": {"type": "string"},
                "description": "Extra environment variables",
            },
            stdin={"type": "string", "description": "Text on the command's standard input"},
        ),
    ),
    Tool(
        "sandbox_grep_files",
        "Search file contents by regular expression (Python syntax); one match a line as"
        " path:line:column: text.",
        _schema(
            ["pattern"],
            pattern={"type": "string", "description": "Regular expression"},
            path={**PATH, "default": "."},
            glob={"type": "string", "description": "Only files whose name matches, e.g. '*.py'"},
            ignore_case={"type": "boolean", "default": False},
            fixed_string={"type": "boolean", "default": False, "description": "Not a regex"},
            max_results={"type": "integer", "minimum": 1, "maximum": 5000, "default": 200},
        ),
        read_only=True,
    ),
    Tool(
        "sandbox_find_files",
        "Find files by approximate name: the query's characters in order, any case"
        " ('mdl' finds models.py); a query with * ? or [ is a glob instead. Best matches first.",
        _schema(
            ["query"],
            query={"type": "string", "minLength": 1},
            path={**PATH, "default": "."},
            max_results={"type": "integer", "minimum": 1, "maximum": 1000, "default": 50},
        ),
        read_only=True,
    ),
    Tool(
        "sandbox_apply_patch",
        "Apply a unified diff (as `git diff` or `diff -u` write it) to any number of files:"
        " all hunks apply or none, and a conflict names the hunk that does not.",
        _schema(
            ["patch"],
            patch={"type": "string", "description": "The unified diff"},
            strip={
                "type": "integer",
                "minimum": 0,
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
            ttl_seconds={"type": "integer", "minimum": 1, "maximum": 86400, "default": 600},
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
            tag={"type": "string", "description": "A label for it, e.g. 'before-refactor'"},
            description={"type": "string"},
        ),
    ),
    Tool(
        "sandbox_restore",
        "Roll the session's workspace back to a snapshot (running commands are stopped).",
        _schema(["snapshot"], snapshot={"type": "string", "description": "The Snapshot's name"}),
    ),
    Tool(
        "sandbox_destroy",
        "Delete the session's sandbox and its workspace; the next tool call starts a new one.",
        _schema([]),
    ),
]
BY_NAME = {tool.name: tool for tool in TOOLS}


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


async def run_command(
    sandbox: AsyncSandbox, args: Mapping[str, Any], progress: Progress | None
) -> str:
    timeout = float(args.get("timeout_seconds") or DEFAULT_TIMEOUT)
    options: JSON = {"cwd": args.get("cwd"), "env": args.get("env"), "stdin": args.get("stdin")}
    result: CommandResult | None
    if progress is None:
        # One request, no stream: nothing to report while it runs.
        result = await sandbox.execute(args["command"], timeout=timeout, **options)
    else:
        result = None
        done = 0.0
        async for event in sandbox.stream(args["command"], timeout=timeout, **options):
            if event.result is not None:
                result = event.result
            elif event.data:
                done += len(event.data)
                await progress(done, event.data)
        if result is None:
            raise ToolFailure("error", "the command's output stream ended before the command did")
        if result.timed_out or result.status == "timed_out":
            raise failure(
                CommandTimeout(
                    f"the command ran past its timeout ({timeout:.0f}s) and was stopped",
                    result=result,
                    code="timed_out",
                )
            )
    assert result is not None
    if not result.ok:
        raise ToolFailure(
            "command_failed",
            f"the command did not succeed (status {result.status}).\n{_command_text(result)}",
        )
    return _command_text(result)


async def call(
    name: str, sandbox: AsyncSandbox, args: Mapping[str, Any], progress: Progress | None
) -> str:
    """Run a sandbox tool (not a lifecycle one) and return its text for the model."""
    files = sandbox.files
    path = str(args.get("path", "."))
    if name == "sandbox_run_command":
        return await run_command(sandbox, args, progress)
    if name == "sandbox_read_file":
        start, count = args.get("start_line"), args.get("line_count")
        text: str = await _file_op(
            files.read(path, start_line=start, line_count=count), f"reading {path}"
        )
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
            if exc.code == "not_a_directory" and not await _file_op(files.exists(path), path):
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
