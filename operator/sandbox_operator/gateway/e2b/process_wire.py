"""The pure half of E2B's process service: its messages in and out.

Every field a caller sends is type- and bounds-checked here (the caller is
hostile; a bad field is `invalid_argument`, never a 500). proto3's JSON rules
apply: camelCase names, `uint32` as a number or a decimal string, enums by
name or number, `bytes` as base64 (either alphabet, padding optional).

Two things E2B's daemon keeps that the agent's records do not are carried in
the command line the agent records, so that any gateway replica reads them
back from the agent alone: a working directory outside the workspace (the
agent runs commands in the workspace only) and a process tag. Such a command
starts through a small `/bin/sh` launcher that changes directory and `exec`s
the command (same pid, nothing left running of the launcher); `unwrap` reads
the launcher's arguments back from a record.
"""

from __future__ import annotations

import base64
import binascii
import posixpath
import re
import signal
from dataclasses import dataclass
from typing import Any

from sandbox_operator.gateway.agent_table import AgentErrorCode
from sandbox_operator.gateway.e2b.connect import ConnectError
from sandbox_operator.gateway.e2b.core import whole

JSON = dict[str, Any]

UINT32 = (1 << 32) - 1
# Bounds of what a Start may carry (the agent's own, or below them).
MAX_ARGS = 1000
MAX_ARG_CHARS = 1 << 20
MAX_PTY_ARG_CHARS = 64 << 10
MAX_ENVS = 1000
MAX_ENV_VALUE_CHARS = 128 << 10
MAX_TAG_CHARS = 256
# A launcher's cwd stays short enough that the agent's record (4 KiB of argv)
# keeps it whole.
MAX_CWD_CHARS = 3072
# The agent's terminals take 1..1000 columns and rows.
MAX_PTY_SIDE = 1000
ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]{0,1023}")
_B64 = re.compile(r"[A-Za-z0-9+/_-]*={0,2}")

# The launcher: $1 the directory to change to ("" for none), $2 the tag ("" for
# none), then the command. `exec` keeps the pid E2B reports.
LAUNCHER = '[ -z "$1" ] || cd -- "$1" || exit 1; shift 2; exec "$@"'
LAUNCHER_HEAD = ["/bin/sh", "-c", LAUNCHER, "e2b-process"]

# Agent error codes whose meaning for E2B is not their HTTP status's.
AGENT_CODES: dict[str, str] = {
    AgentErrorCode.NOT_RUNNING: "not_found",
    AgentErrorCode.TERMINAL_ENDED: "not_found",
    AgentErrorCode.TERMINAL_NOT_FOUND: "not_found",
    AgentErrorCode.STDIN_CLOSED: "failed_precondition",
    AgentErrorCode.INVALID_CWD: "invalid_argument",
    AgentErrorCode.PATH_ESCAPE: "invalid_argument",
    AgentErrorCode.RUNNER_UNAVAILABLE: "unavailable",
    AgentErrorCode.RUNTIME_RESTARTING: "unavailable",
}

SIGNALS = {"SIGNAL_SIGKILL": "KILL", "SIGNAL_SIGTERM": "TERM", 9: "KILL", 15: "TERM"}

# E2B's users: the sandbox's one user runs every process; root is not there.
USER = "user"
# The agent's statuses of a process that runs.
RUNNING = ("running", "starting")


@dataclass(frozen=True)
class Pty:
    cols: int
    rows: int


@dataclass(frozen=True)
class StartSpec:
    """A StartRequest, checked."""

    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None
    pty: Pty | None
    tag: str | None
    stdin: bool


@dataclass(frozen=True)
class Selector:
    """A ProcessSelector: exactly one of pid and tag."""

    pid: int | None = None
    tag: str | None = None

    def __str__(self) -> str:
        return f"pid {self.pid}" if self.pid is not None else f"tag {self.tag}"


def invalid(message: str) -> ConnectError:
    return ConnectError("invalid_argument", message)


class AgentError(ConnectError):
    """An agent's error answer as a Connect error, keeping the agent's own code
    and details (some refusals are answered by trying again differently)."""

    def __init__(self, code: str, message: str, agent_code: str | None, details: JSON) -> None:
        super().__init__(code, message)
        self.agent_code, self.details = agent_code, details


def agent_error(status: int, body: Any) -> AgentError:
    """The Connect error for an agent's error answer (`{"error": {code, message,
    details}}`, or anything else: then the status says it)."""
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {}
    code, message, details = error.get("code"), error.get("message"), error.get("details")
    text = str(message) if message else f"the sandbox's agent answered {status}"
    agent_code = code if isinstance(code, str) else None
    details = details if isinstance(details, dict) else {}
    base = ConnectError.from_http(status, text)
    return AgentError(AGENT_CODES.get(agent_code or "", base.code), text, agent_code, details)


# -- fields ---------------------------------------------------------------------------


def _object(msg: JSON, name: str) -> JSON | None:
    value = msg.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(f"{name} must be an object")
    return value


def _string(value: Any, name: str, limit: int) -> str:
    if not isinstance(value, str):
        raise invalid(f"{name} must be a string")
    if len(value) > limit:
        raise invalid(f"{name} is longer than {limit} characters")
    if "\0" in value:
        raise invalid(f"{name} contains NUL")
    return value


def _uint32(value: Any, name: str) -> int:
    if isinstance(value, str):
        value = whole(value, 10)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= UINT32:
        raise invalid(f"{name} must be an unsigned 32-bit integer")
    return value


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false")
    return value


def b64bytes(value: Any, name: str) -> bytes:
    """A proto3 JSON `bytes` field: base64 of either alphabet, padding optional."""
    if not isinstance(value, str) or not _B64.fullmatch(value):
        raise invalid(f"{name} must be base64")
    text = value.rstrip("=").replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise invalid(f"{name} must be base64") from exc


# -- requests ---------------------------------------------------------------------------


def parse_pty(value: Any) -> Pty | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("pty must be an object")
    size = _object(value, "size") or {}
    cols = _uint32(size.get("cols", 0), "pty.size.cols")
    rows = _uint32(size.get("rows", 0), "pty.size.rows")
    if not (1 <= cols <= MAX_PTY_SIDE and 1 <= rows <= MAX_PTY_SIDE):
        raise invalid(f"pty.size: cols and rows must be 1..{MAX_PTY_SIDE}")
    return Pty(cols, rows)


def parse_start(msg: JSON) -> StartSpec:
    process = _object(msg, "process")
    if process is None:
        raise invalid("process is required")
    pty = parse_pty(msg.get("pty"))
    arg_limit = MAX_PTY_ARG_CHARS if pty else MAX_ARG_CHARS
    cmd = _string(process.get("cmd"), "process.cmd", arg_limit)
    if not cmd:
        raise invalid("process.cmd must not be empty")
    args = process.get("args")
    if args is None:
        args = []
    if not isinstance(args, list) or len(args) > MAX_ARGS:
        raise invalid(f"process.args must be a list of at most {MAX_ARGS} strings")
    args = [_string(a, "process.args[]", arg_limit) for a in args]
    envs = _object(process, "envs") or {}
    if len(envs) > MAX_ENVS:
        raise invalid(f"process.envs holds at most {MAX_ENVS} variables")
    for key, val in envs.items():
        if not ENV_NAME.fullmatch(key):
            raise invalid(f"process.envs: {key[:100]!r} is not a variable name")
        _string(val, f"process.envs[{key}]", MAX_ENV_VALUE_CHARS)
    cwd = process.get("cwd")
    if cwd is not None:
        cwd = _string(cwd, "process.cwd", 4096)
    tag = msg.get("tag")
    if tag is not None:
        tag = _string(tag, "tag", MAX_TAG_CHARS) or None
    # Absent means open: older SDKs do not send the field (E2B's daemon's rule).
    stdin = True if msg.get("stdin") is None else _bool(msg["stdin"], "stdin")
    return StartSpec(cmd, args, dict(envs), cwd, pty, tag, stdin and pty is None)


def parse_selector(msg: JSON) -> Selector:
    process = _object(msg, "process")
    if process is None:
        raise invalid("process (a pid or a tag) is required")
    has_pid, has_tag = process.get("pid") is not None, process.get("tag") is not None
    if has_pid == has_tag:
        raise invalid("process must name exactly one of pid and tag")
    if has_pid:
        return Selector(pid=_uint32(process["pid"], "process.pid"))
    return Selector(tag=_string(process["tag"], "process.tag", MAX_TAG_CHARS))


def parse_input(value: Any) -> tuple[str, bytes]:
    """A ProcessInput: ("stdin" | "pty", the bytes)."""
    if not isinstance(value, dict):
        raise invalid("input is required: {stdin} or {pty}")
    kinds = [k for k in ("stdin", "pty") if value.get(k) is not None]
    if len(kinds) != 1:
        raise invalid("input must hold exactly one of stdin and pty")
    return kinds[0], b64bytes(value[kinds[0]], f"input.{kinds[0]}")


def parse_signal(value: Any) -> str:
    """The agent's name of a Signal enum value (E2B knows SIGKILL and SIGTERM)."""
    if isinstance(value, str) and whole(value, 10) is not None:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise invalid("signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM")
    name = SIGNALS.get(value)
    if name is None and isinstance(value, str) and value != "SIGNAL_UNSPECIFIED":
        # Not a name of E2B's Signal enum: its daemon's JSON decoding refuses the
        # message, as invalid_argument (the caller's mistake, not a 501).
        raise invalid(f"signal {value[:40]!r} is not a Signal: SIGNAL_SIGKILL or SIGNAL_SIGTERM")
    if name is None:
        # E2B's daemon answers an unset signal, or a number its enum does not
        # name (proto3 enums are open), with `unimplemented`.
        raise ConnectError("unimplemented", f"invalid signal: {str(value)[:40]}")
    return name


def user_of(authorization: str | None) -> str | None:
    """The user an `Authorization: Basic` header names (E2B's way to pick one),
    or None when it names none."""
    if not authorization or authorization[:6].lower() != "basic ":
        return None
    try:
        decoded = base64.b64decode(authorization[6:].strip(), validate=True).decode()
    except (binascii.Error, ValueError):
        raise ConnectError("unauthenticated", "the Authorization header is not Basic") from None
    return decoded.partition(":")[0] or None


def check_user(authorization: str | None) -> None:
    """Processes run as the sandbox's one user: `user` (or nobody named) is fine,
    root is refused with the reason, any other name is unknown."""
    user = user_of(authorization)
    if user is None or user == USER:
        return
    if user == "root":
        raise ConnectError(
            "permission_denied",
            "processes run as the sandbox's user 'user'; root is not available "
            "(sandboxes run under Pod Security 'restricted': no root, no sudo)",
        )
    raise ConnectError("unauthenticated", f"invalid username: '{user[:64]}'")


# -- the working directory and the launcher -------------------------------------------


def resolve_cwd(cwd: str | None, workspace: str) -> tuple[str, str | None]:
    """Where a process starts: (the agent's cwd, relative to the workspace; an
    absolute directory outside it, or None). E2B's rules: nothing is the home
    directory, which is the workspace here; `~` and `~/...` are in it; a relative
    path is relative to it; `..` is resolved by name."""
    home = _normal(workspace)
    if not cwd:
        return ".", None
    if cwd.startswith("~"):
        if len(cwd) > 1 and cwd[1] != "/":
            raise invalid(f"cwd {cwd[:100]!r}: only the user's own home (~) can be expanded")
        cwd = home + cwd[1:]
    path = _normal(cwd if cwd.startswith("/") else posixpath.join(home, cwd))
    if path == home:
        return ".", None
    inside = home.rstrip("/") + "/"
    if path.startswith(inside):
        return path[len(inside) :], None
    if len(path) > MAX_CWD_CHARS:
        raise invalid(f"cwd outside the home directory is at most {MAX_CWD_CHARS} characters")
    return ".", path


def _normal(path: str) -> str:
    out = posixpath.normpath(path)
    return "/" + out.lstrip("/") if out.startswith("/") else out


def launch(argv: list[str], outside: str | None, tag: str | None) -> list[str]:
    """The argv the agent runs: `argv` itself, or through the launcher when a
    directory outside the workspace or a tag must travel with it."""
    if outside is None and tag is None:
        return argv
    return [*LAUNCHER_HEAD, outside or "", tag or "", *argv]


def unwrap(argv: list[str]) -> tuple[list[str], str | None, str | None]:
    """(the process's own argv, its directory outside the workspace, its tag)."""
    if len(argv) >= len(LAUNCHER_HEAD) + 3 and argv[: len(LAUNCHER_HEAD)] == LAUNCHER_HEAD:
        rest = argv[len(LAUNCHER_HEAD) :]
        return rest[2:], rest[0] or None, rest[1] or None
    return argv, None, None


def absolute_cwd(rel: str, workspace: str) -> str:
    home = _normal(workspace)
    return home if rel in ("", ".") else posixpath.join(home, rel)


# -- events ---------------------------------------------------------------------------


def start_event(pid: int) -> JSON:
    return {"event": {"start": {"pid": pid}}}


def data_event(kind: str, data_base64: str) -> JSON:
    """Output as E2B sends it: `kind` stdout, stderr or pty; the bytes already base64."""
    return {"event": {"data": {kind: data_base64}}}


KEEPALIVE: JSON = {"event": {"keepalive": {}}}


def signal_name(sig: int) -> str:
    """A signal as Go's os.ProcessState says it ("killed", "terminated")."""
    try:
        text = signal.strsignal(sig)
    except ValueError:
        text = None
    if not text or text.startswith("Unknown signal") or text.startswith("Real-time signal"):
        return f"signal {sig}"
    return text[0].lower() + text[1:]


def end_event(exit_code: int | None, sig: int | None, error: str | None = None) -> JSON:
    """E2B's EndEvent for a process that exited with `exit_code` or died of
    `sig` (-1 and `exited: false` then, as E2B's daemon reports it)."""
    if sig is not None:
        status = f"signal: {signal_name(sig)}"
        end: JSON = {"exitCode": -1, "exited": False, "status": status, "error": error or status}
    elif exit_code is not None:
        status = f"exit status {exit_code}"
        end = {"exitCode": exit_code, "exited": True, "status": status}
        if exit_code != 0 or error:
            end["error"] = error or status
    else:
        end = {"exitCode": -1, "exited": False, "status": "unknown", "error": error or "unknown"}
    return {"event": {"end": end}}


def execution_end(record: JSON, *, own_deadline: bool) -> JSON:
    """The EndEvent of a finished agent execution. A command killed at its
    Start's deadline ends that stream with `deadline_exceeded` (as E2B's daemon
    does: the call's deadline is the process's); seen from another stream it
    died of SIGKILL."""
    status = record.get("status")
    error = record.get("error") if isinstance(record.get("error"), dict) else None
    message = f"{error.get('code')}: {error.get('message')}" if error else None
    if status == "timed_out":
        if own_deadline:
            raise ConnectError(
                "deadline_exceeded", "the process reached its timeout and was killed"
            )
        return end_event(None, signal.SIGKILL)
    if status == "cancelled":
        return end_event(None, signal.SIGKILL)
    if status == "failed":
        raise invalid(f"the process did not start: {message or 'spawn failed'}")
    sig = record.get("signal")
    code = record.get("exitCode")
    if status == "completed" and (isinstance(sig, int) or isinstance(code, int)):
        return end_event(
            code if isinstance(code, int) else None, sig if isinstance(sig, int) else None
        )
    return end_event(None, None, message or f"the process ended as {status}")


def terminal_end(view: JSON) -> JSON:
    """The EndEvent of an ended agent terminal (a record or an output page)."""
    sig, code = view.get("signal"), view.get("exitCode")
    if isinstance(sig, int) or isinstance(code, int):
        return end_event(
            code if isinstance(code, int) else None, sig if isinstance(sig, int) else None
        )
    message = view.get("message")
    return end_event(None, None, str(message) if message else f"the terminal {view.get('status')}")


def may_be_shutdown(view: JSON) -> bool:
    """Whether an ended execution or terminal may have died with its sandbox: a
    pod's end sends SIGTERM (then SIGKILL), and takes the runner along."""
    sig = view.get("signal")
    return (
        view.get("status") == "lost"
        or sig == signal.SIGTERM
        or (sig == signal.SIGKILL and view.get("oomKilled") is True)
    )


def process_info(argv: list[str], cwd_rel: str, pid: int, workspace: str) -> JSON:
    """A ProcessInfo of List. The environment a process got is not recorded by
    the agent, so `envs` is empty."""
    own, outside, tag = unwrap(argv)
    config: JSON = {
        "cmd": own[0] if own else "",
        "args": own[1:],
        "envs": {},
        "cwd": outside or absolute_cwd(cwd_rel, workspace),
    }
    info: JSON = {"config": config, "pid": pid}
    if tag is not None:
        info["tag"] = tag
    return info


# -- the agent's records ----------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    """A process of the sandbox as the agent records it."""

    kind: str  # "execution" | "terminal"
    id: str
    pid: int
    argv: list[str]
    cwd: str  # the agent's, relative to the workspace
    running: bool
    record: JSON

    @property
    def tag(self) -> str | None:
        return unwrap(self.argv)[2]

    @property
    def pty(self) -> bool:
        return self.kind == "terminal"


def _strings(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def proc_of(kind: str, record: Any) -> Proc | None:
    """A Proc from an agent record, or None when it has no pid (not started)."""
    if not isinstance(record, dict):
        return None
    pid, rid = record.get("pid"), record.get("id")
    if isinstance(pid, bool) or not isinstance(pid, int) or not isinstance(rid, str):
        return None
    argv = _strings(record.get("argv"))
    if not argv and isinstance(record.get("command"), str):
        argv = ["/bin/sh", "-c", record["command"]]
    cwd = record.get("cwd")
    cwd = cwd if isinstance(cwd, str) else "."
    running = record.get("status") in RUNNING
    return Proc(kind, rid, pid, argv, cwd, running, record)
