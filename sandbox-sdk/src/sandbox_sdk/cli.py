"""`kubectl sandbox`: the kubectl plugin (the `kubectl-sandbox` executable).

    kubectl sandbox create demo --runtime python
    kubectl sandbox exec demo -- python3 -c 'print(6*7)'
    kubectl sandbox cp ./src demo:src
    kubectl sandbox get -o wide

Global flags as kubectl's: `-n/--namespace`, `--context`, `--kubeconfig`,
`-o json|yaml|wide|name`. Errors are one line on stderr and a non-zero exit;
`exec` and `run` exit with the command's own exit code (124 when it timed out,
as `timeout(1)` does; 125 when it never reached an exit code, e.g. the
sandbox's agent restarted under it); 141 when stdout's reader went away
(`| head`), as after SIGPIPE; `logs` exits 3 when the log was cut at the
agent's cap. Shell completion: `kubectl sandbox completion bash`,
and `kubectl_complete-sandbox` for kubectl's own plugin completion.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandbox_sdk import _wire
from sandbox_sdk.errors import CommandLost, CommandTimeout, NotReady, SandboxError
from sandbox_sdk.types import OutputEvent

# Start-up time is the price of every `kubectl sandbox` call (a trivial exec
# took 450 ms against kubectl exec's 115 ms, 340 of them importing): this
# module imports only the standard library's light modules and the SDK's
# dependency-free ones. The client (httpx, pydantic, the models), yaml,
# http.server and tarfile are imported where a command needs them;
# tests/integration/test_sdk.py checks that importing this module pulls none.
if TYPE_CHECKING:
    import http.server

    from sandbox_sdk import _oneshot
    from sandbox_sdk._sync.client import SandboxClient
    from sandbox_sdk._sync.sandbox import Sandbox
    from sandbox_sdk.config import ConnectionOptions
    from sandbox_sdk.models import resources

JSON = dict[str, Any]
COMMANDS = [
    *("create", "get", "list", "delete", "exec", "run", "shell", "terminals", "cp", "ls"),
    *("cat", "grep", "logs"),
    *("snapshot", "snapshots", "restore", "fork", "pause", "resume", "port", "completion"),
    "e2b-key",
]
PROGRESS_FROM = 1 << 20  # bytes: smaller transfers show no progress bar
WAIT_SLICE = 3.0  # seconds between looks at why a created sandbox is not ready yet
# Waiting reasons worth a line: someone has to act, or something slow is under way.
SAY_WHY = {
    *("QuotaExceeded", "TemplateNotFound", "TemplateNotReady", "PoolNotFound", "PoolEmpty"),
    "Unschedulable",  # the scheduler's message says what is short (Insufficient cpu)
}
LOST_EXIT = 125  # the command never reached an exit code (as timeout(1) says of itself)
PIPE_EXIT = 128 + 13  # stdout's reader went away: what a shell reports of SIGPIPE
TRUNCATED_EXIT = 3  # `logs`: the output log was cut at the agent's cap
USAGE = {
    "exec": "kubectl sandbox exec NAME [flags] -- COMMAND [ARGS...]",
    "run": "kubectl sandbox run [flags] -- COMMAND [ARGS...]",
    "shell": "kubectl sandbox shell NAME [--attach TERMINAL_ID] [-- COMMAND [ARGS...]]",
}


class CliError(Exception):
    """A mistake in the command line: one line, exit 2."""


def _age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    then = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = int((datetime.now(UTC) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _ready(sandbox: resources.Sandbox) -> str:
    for cond in (sandbox.status.conditions if sandbox.status else None) or []:
        if cond.type == "Ready":
            return cond.status
    return "Unknown"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _emit(objects: list[JSON], output: str | None, kind: str, many: bool) -> None:
    if output == "name":
        for obj in objects:
            print(f"{kind.lower()}/{obj['metadata']['name']}")
        return
    document: JSON = {"apiVersion": "v1", "kind": "List", "items": objects} if many else objects[0]
    if output == "json":
        print(json.dumps(document, indent=2))
    else:
        import yaml

        print(yaml.safe_dump(document, sort_keys=False), end="")


def _print_sandboxes(
    items: list[resources.Sandbox], output: str | None, many: bool, namespaces: bool = False
) -> None:
    if output in ("json", "yaml", "name"):
        _emit(
            [s.model_dump(by_alias=True, exclude_none=True) for s in items], output, "Sandbox", many
        )
        return
    if not items:
        print("No sandboxes found.", file=sys.stderr)
        return
    # Across namespaces the name alone is ambiguous: NAMESPACE first, as kubectl's -A.
    header = [*(["NAMESPACE"] if namespaces else []), "NAME", "PHASE", "READY", "RUNTIME", "AGE"]
    if output == "wide":
        header += ["POD IP", "LAST ACTIVITY", "SNAPSHOT"]
    rows = [header]
    for s in items:
        status = s.status
        row = [
            *([s.metadata.namespace or ""] if namespaces else []),
            s.metadata.name or "",
            (status.phase if status else None) or "",
            _ready(s),
            s.spec.runtime or s.spec.image or "",
            _age(s.metadata.creation_timestamp),
        ]
        if output == "wide":
            row += [
                (status.pod_ip if status else None) or "",
                (status.last_activity if status else None) or "",
                (status.workspace_snapshot if status else None) or "",
            ]
        rows.append(row)
    print(_table(rows))


class ProgressBar:
    """`12.0 MiB / 40.0 MiB  30%` on stderr, rewritten in place."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled, self.shown = label, enabled, False

    def __call__(self, done: int, total: int | None) -> None:
        if not self.enabled or (done < PROGRESS_FROM and not self.shown):
            return
        self.shown = True
        text = f"{done / 1048576:7.1f} MiB"
        if total:
            text += f" / {total / 1048576:.1f} MiB {100 * done // total:3d}%"
        sys.stderr.write(f"\r{self.label} {text}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")


def _split_remote(spec: str) -> tuple[str | None, str]:
    """`name:path` -> (name, path); a local path -> (None, path)."""
    if ":" in spec and not spec.startswith(("/", ".", "~")):
        name, _, path = spec.partition(":")
        return name, path or "."
    return None, spec


def _env_pairs(values: Sequence[str]) -> dict[str, str]:
    env = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep:
            raise CliError(f"--env {item!r}: expected NAME=VALUE")
        env[key] = value
    return env


def _stream_to_terminal(events: Any) -> int:
    code = 0
    for event in events:
        if not isinstance(event, OutputEvent):
            continue
        if event.kind == "stdout":
            sys.stdout.write(event.data)
            sys.stdout.flush()
        elif event.kind == "stderr":
            sys.stderr.write(event.data)
            sys.stderr.flush()
        elif event.result is not None:
            result = event.result
            if result.timed_out:
                return 124
            if result.lost:
                print(f"error: {CommandLost.of(result)}", file=sys.stderr)
                return LOST_EXIT
            code = result.exit_code if result.exit_code is not None else 128
    return code


# -- commands -------------------------------------------------------------------------


def _wait_ready_saying_why(sandbox: Sandbox, timeout: float) -> None:
    """Wait for Ready as the SDK does, and say on stderr (once per reason) why a
    sandbox waits on something a person must change: a quota with no room.
    The ordinary steps of a start pass in silence."""
    deadline = time.monotonic() + timeout
    told = ""
    while True:
        left = deadline - time.monotonic()
        try:
            sandbox.wait_ready(max(0.1, min(WAIT_SLICE, left)))
            return
        except NotReady as exc:
            if exc.code != "timeout":
                raise
            if time.monotonic() >= deadline:
                raise NotReady(
                    f"sandbox {sandbox.name} not ready in {timeout:g}s ({exc.reason}): {exc.why}",
                    reason=exc.reason,
                    why=exc.why,
                ) from None
            if exc.reason in SAY_WHY and exc.reason != told:
                told = exc.reason
                print(f"waiting: {exc.reason}: {exc.why}", file=sys.stderr)


def cmd_create(client: SandboxClient, args: argparse.Namespace) -> int:
    sandbox = client.create(
        args.runtime,
        template=args.template,
        cluster_template=args.cluster_template,
        pool=args.pool,
        name=args.name,
        image=args.image,
        env=_env_pairs(args.env),
        cpu=args.cpu,
        memory=args.memory,
        profile=args.profile,
        workspace_size=args.workspace_size,
        ephemeral=args.ephemeral,
        from_snapshot=args.from_snapshot,
        ports=args.port,
        idle_timeout=args.idle_timeout,
        on_idle=args.on_idle,
        wait=False,
        timeout=args.timeout,
    )
    if not args.no_wait:
        _wait_ready_saying_why(sandbox, args.timeout)
    if args.output:
        _print_sandboxes([sandbox.refresh()], args.output, False)
    else:
        print(f"sandbox/{sandbox.name} created" + ("" if args.no_wait else " and ready"))
    return 0


def cmd_get(client: SandboxClient, args: argparse.Namespace) -> int:
    if args.names:
        _print_sandboxes([client.get(n) for n in args.names], args.output, len(args.names) > 1)
    else:
        ns = "*" if args.all_namespaces else None
        items = sorted(
            client.list(namespace=ns),
            key=lambda s: (s.metadata.namespace or "", s.metadata.name or ""),
        )
        _print_sandboxes(items, args.output, True, namespaces=args.all_namespaces)
    return 0


def cmd_delete(client: SandboxClient, args: argparse.Namespace) -> int:
    for name in args.names:
        client.connect(name).destroy(wait=not args.no_wait)
        print(f"sandbox/{name} deleted")
    return 0


def _exec_body(args: argparse.Namespace) -> JSON:
    if not args.command:
        raise CliError(f"exec: no command; usage: {USAGE['exec']}")
    stdin = sys.stdin.buffer.read() if args.stdin else None
    command: str | list[str] = args.command[0] if len(args.command) == 1 else args.command
    return _wire.exec_body(
        command,
        env=_env_pairs(args.env),
        cwd=args.cwd,
        stdin=stdin,
        timeout=_wire.timeout_seconds(args.timeout, _wire.MAX_TIMEOUT),
        combined_output=False,
    )


def exec_first(args: argparse.Namespace) -> int | None:
    """`exec` in one request without the client (`sandbox_sdk._oneshot`): the
    exit code, or None when the client is to take over (`args.handoff` says
    where things stood)."""
    from sandbox_sdk import _oneshot  # ssl, sockets and yaml: for exec alone

    args.body = _exec_body(args)
    try:
        way = _oneshot.route(_options(args))
        return _stream_to_terminal(_oneshot.events(way, args.name, args.body, args.timeout + 60))
    except _oneshot.Handoff as handoff:
        args.handoff = handoff
        return None


def cmd_exec(client: SandboxClient, args: argparse.Namespace) -> int:
    body = getattr(args, "body", None) or _exec_body(args)
    handoff: _oneshot.Handoff | None = getattr(args, "handoff", None)
    sandbox = client.connect(args.name)
    if handoff is not None and handoff.execution_id is not None:
        events = sandbox.job(handoff.execution_id).stream(handoff.cursor)
    else:
        # The same body, so the same idempotency key: a command that a first try
        # did start is not started again.
        events = sandbox._events("POST", "executions/stream", body, args.timeout + 60)
    return _stream_to_terminal(events)


def cmd_shell(client: SandboxClient, args: argparse.Namespace) -> int:
    from sandbox_sdk._shell import Stopped, shell  # termios and threads: for this verb alone

    sandbox = client.connect(args.name)
    try:
        return shell(sandbox, args.command, attach=args.attach)
    except Stopped as stopped:
        return 128 + stopped.signum


def cmd_terminals(client: SandboxClient, args: argparse.Namespace) -> int:
    rows = [["ID", "STATUS", "COMMAND", "ATTACHED", "AGE"]]
    for term in client.connect(args.name).terminals.list():
        command = term.command or " ".join(term.argv or []) or "(login shell)"
        status = term.status if term.exit_code is None else f"{term.status} ({term.exit_code})"
        rows.append([term.id, status, command[:40], str(term.attached), _age(term.created_at)])
    print(_table(rows))
    return 0


def _say_waiting(reason: str, message: str) -> None:
    print(f"waiting: {reason}: {message}" if message else f"waiting: {reason}", file=sys.stderr)
    sys.stderr.flush()


def cmd_run(client: SandboxClient, args: argparse.Namespace) -> int:
    if not args.command:
        raise CliError(f"run: no command; usage: {USAGE['run']}")
    files = {}
    for item in args.file:
        local, _, remote = item.partition(":")
        files[remote or Path(local).name] = Path(local).read_bytes()
    command: str | list[str] = args.command[0] if len(args.command) == 1 else args.command
    try:
        result = client.run(
            command,
            runtime=args.runtime,
            image=args.image,
            files=files,
            env=_env_pairs(args.env),
            timeout=args.timeout,
            stdout=sys.stdout,
            stderr=sys.stderr,
            # A pod the scheduler cannot place waits for minutes: say why, each
            # time it changes, rather than sit silent.
            on_waiting=_say_waiting,
        )
    except CommandTimeout:
        return 124
    except CommandLost as exc:
        print(f"error: {exc}", file=sys.stderr)
        return LOST_EXIT
    return result.exit_code if result.exit_code is not None else 128


def cmd_cp(client: SandboxClient, args: argparse.Namespace) -> int:
    src_name, src = _split_remote(args.source)
    dst_name, dst = _split_remote(args.destination)
    if (src_name is None) == (dst_name is None):
        raise CliError("cp: exactly one side must be NAME:PATH")
    bar = ProgressBar("cp", args.progress or sys.stderr.isatty())
    try:
        if dst_name is not None:
            files = client.connect(dst_name).files
            local = Path(src)
            if local.is_dir():
                files.upload_dir(local, dst, progress=bar)
            elif local.is_file():
                target = f"{dst.rstrip('/')}/{local.name}" if dst.endswith("/") else dst
                size = local.stat().st_size
                if size < PROGRESS_FROM:
                    files.write(target, local.read_bytes())
                else:  # a tar of one member streams, with progress
                    parent, _, base = target.rpartition("/")
                    import tarfile

                    spool = io.BytesIO()
                    with tarfile.open(fileobj=spool, mode="w") as tar:
                        tar.add(local, arcname=base)
                    spool.seek(0)
                    files.upload_tar(
                        spool, parent or ".", size=spool.getbuffer().nbytes, progress=bar
                    )
            else:
                raise CliError(f"cp: {local}: no such file or directory")
        else:
            assert src_name is not None
            files = client.connect(src_name).files
            info = files.stat(src)
            local = Path(dst)
            if info.type == "directory":
                files.download_dir(src, local, progress=bar)
            else:
                if local.is_dir():
                    local = local / info.name
                local.write_bytes(files.read_bytes(src))
    finally:
        bar.close()
    return 0


def cmd_ls(client: SandboxClient, args: argparse.Namespace) -> int:
    entries = client.connect(args.name).files.list(args.path, depth=args.depth)
    if args.output in ("json", "yaml"):
        import yaml

        data = [e.model_dump(by_alias=True) for e in entries]
        print(json.dumps(data, indent=2) if args.output == "json" else yaml.safe_dump(data), end="")
        return 0
    for entry in entries:
        suffix = "/" if entry.type == "directory" else ""
        if args.long:
            print(f"{entry.mode}  {entry.size:>10}  {entry.modified_at}  {entry.path}{suffix}")
        else:
            print(f"{entry.path}{suffix}")
    return 0


def cmd_cat(client: SandboxClient, args: argparse.Namespace) -> int:
    files = client.connect(args.name).files
    if args.lines:
        start, count = _line_range(args.lines)
        sys.stdout.write(files.read(args.path, start_line=start, line_count=count))
    else:
        sys.stdout.buffer.write(files.read_bytes(args.path))
    sys.stdout.flush()
    return 0


def _line_range(text: str) -> tuple[int, int | None]:
    """`FIRST:LAST`, `FIRST:` or `:LAST` (1-based, inclusive) or `FIRST`: the
    first line and how many (None: to the end)."""
    first, colon, last = text.partition(":")
    try:
        start = int(first) if first else 1
        end = int(last) if last else None
    except ValueError:
        start, end = 0, None
    if start < 1 or (end is not None and end < start) or (not colon and not first):
        raise CliError(f"--lines {text!r}: expected FIRST:LAST, FIRST: or :LAST (1-based lines)")
    return start, None if end is None else end - start + 1


def cmd_grep(client: SandboxClient, args: argparse.Namespace) -> int:
    found = client.connect(args.name).files.grep(
        args.pattern, args.path, glob=args.glob, ignore_case=args.ignore_case, fixed=args.fixed
    )
    for match in found.matches:
        print(f"{match.path}:{match.line}:{match.text}")
    return 0 if found.matches else 1


def cmd_logs(client: SandboxClient, args: argparse.Namespace) -> int:
    for event in client.execution_output(args.execution, follow=args.follow):
        (sys.stderr if event.kind == "stderr" else sys.stdout).write(event.data)
    sys.stdout.flush()
    # The agent keeps a command's output up to its log cap; past it the log
    # ends early, and printing what there is as if it were all would mislead.
    status = client.get_execution(args.execution).status
    if status is None or not status.sandbox or not status.agent_execution_id:
        return 0
    try:
        record = client.connect(status.sandbox).job(status.agent_execution_id).info()
    except SandboxError:
        return 0  # the sandbox is gone: what was printed are the status's tails
    if record.log_truncated:
        print(
            f"warning: the output log of execution {args.execution} was cut at the agent's"
            " cap (SANDBOX_AGENT_MAX_LOG_BYTES, 64 MiB by default); the rest was not kept",
            file=sys.stderr,
        )
        return TRUNCATED_EXIT
    return 0


def cmd_snapshot(client: SandboxClient, args: argparse.Namespace) -> int:
    snap = client.connect(args.name).snapshot(
        args.tag, name=args.snapshot_name, quiesce=args.quiesce, wait=not args.no_wait
    )
    print(f"snapshot/{snap.metadata.name} created" + ("" if args.no_wait else " and ready"))
    return 0


def cmd_snapshots(client: SandboxClient, args: argparse.Namespace) -> int:
    snaps = client.list_snapshots(sandbox=args.name)
    if args.output in ("json", "yaml", "name"):
        _emit(
            [s.model_dump(by_alias=True, exclude_none=True) for s in snaps],
            args.output,
            "Snapshot",
            True,
        )
        return 0
    rows = [["NAME", "SANDBOX", "TAG", "PHASE", "LINEAGE", "AGE"]]
    for s in snaps:
        rows.append(
            [
                s.metadata.name or "",
                s.spec.sandbox_ref.name,
                s.spec.tag or "",
                (s.status.phase if s.status else None) or "",
                ",".join((s.status.lineage if s.status else None) or []),
                _age(s.metadata.creation_timestamp),
            ]
        )
    print(_table(rows))
    return 0


def cmd_restore(client: SandboxClient, args: argparse.Namespace) -> int:
    client.connect(args.name).restore(args.snapshot, wait=not args.no_wait)
    print(f"sandbox/{args.name} restored from snapshot/{args.snapshot}")
    return 0


def cmd_fork(client: SandboxClient, args: argparse.Namespace) -> int:
    fork = client.connect(args.name).fork(
        args.new_name, snapshot=args.snapshot, wait=not args.no_wait
    )
    print(f"sandbox/{fork.name} forked from sandbox/{args.name}")
    return 0


def cmd_pause(client: SandboxClient, args: argparse.Namespace) -> int:
    client.connect(args.name).pause(wait=not args.no_wait)
    print(f"sandbox/{args.name} paused")
    return 0


def cmd_resume(client: SandboxClient, args: argparse.Namespace) -> int:
    client.connect(args.name).resume(wait=not args.no_wait)
    print(f"sandbox/{args.name} resumed")
    return 0


def cmd_port(client: SandboxClient, args: argparse.Namespace) -> int:
    sandbox = client.connect(args.name)
    if args.forward is None:
        print(sandbox.url(args.port))
        return 0
    server = _forwarder(sandbox, args.port, args.forward)
    host, port = server.server_address[:2]
    print(f"Forwarding from http://{host!s}:{port} -> sandbox/{args.name} port {args.port}")
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _forwarder(sandbox: Sandbox, port: int, local: int) -> http.server.ThreadingHTTPServer:
    """A local HTTP server relaying each request to the sandbox's port through
    the gateway, with this client's credentials (HTTP only, no WebSocket)."""
    import http.server
    import threading

    lock = threading.Lock()  # one httpx client under the handle: calls one at a time

    class Relay(http.server.BaseHTTPRequestHandler):
        def _relay(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            with lock:
                answer = sandbox.port_request(port, self.path, method=self.command, content=body)
            self.send_response(answer.status_code)
            for key, value in answer.headers.items():
                if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(answer.content)))
            self.end_headers()
            self.wfile.write(answer.content)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _relay

        def log_message(self, format: str, *args: Any) -> None:
            sys.stderr.write(f"{self.command} {self.path}\n")

    return http.server.ThreadingHTTPServer(("127.0.0.1", local), Relay)


def cmd_e2b_key(client: SandboxClient, args: argparse.Namespace) -> int:
    """E2B API keys: create (printed once), list, revoke."""
    if args.action == "create":
        if not args.service_account:
            raise CliError("e2b-key create: --service-account SA (the identity the key acts as)")
        if args.key_id:
            raise CliError("e2b-key create takes no id")
        minted = client.create_e2b_key(
            args.service_account, expiration_seconds=args.expiration_seconds
        )
        if args.output in ("json", "yaml"):
            _emit([minted], args.output, "E2BKey", False)
        else:
            print(minted["key"])
        return 0
    if args.action == "revoke":
        if not args.key_id:
            raise CliError("e2b-key revoke ID (the id `e2b-key list` shows)")
        client.revoke_e2b_key(args.key_id)
        print(f"e2b-key/{args.key_id[:12]} revoked")
        return 0
    keys = client.list_e2b_keys()
    if args.output in ("json", "yaml"):
        _emit(keys, args.output, "E2BKey", True)
        return 0
    rows = [["ID", "SERVICE ACCOUNT", "STATE", "CREATED BY", "EXPIRES", "AGE"]]
    for key in keys:
        rows.append(
            [
                key["id"],
                key["serviceAccount"],
                key.get("state", ""),
                key.get("createdBy", ""),
                key.get("expiresAt", "never"),
                _age(key.get("createdAt")),
            ]
        )
    print(_table(rows))
    return 0


def cmd_completion(client: SandboxClient | None, args: argparse.Namespace) -> int:
    print(BASH_COMPLETION if args.shell == "bash" else ZSH_COMPLETION)
    return 0


BASH_COMPLETION = """# bash: source <(kubectl sandbox completion bash)
_kubectl_sandbox() {
    local cur=${COMP_WORDS[COMP_CWORD]}
    local words
    words=$(kubectl-sandbox __complete "${COMP_WORDS[@]:1:COMP_CWORD-1}" 2>/dev/null)
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
}
complete -F _kubectl_sandbox kubectl-sandbox"""
ZSH_COMPLETION = (
    """# kubectl sandbox completion for zsh: source <(kubectl sandbox completion zsh)
autoload -U +X bashcompinit && bashcompinit
"""
    + BASH_COMPLETION
)


def complete(words: list[str]) -> list[str]:
    """Candidates for the next word after `words` (subcommands, then sandbox names)."""
    positional = [w for w in words if not w.startswith("-")]
    if not positional:
        return list(COMMANDS)
    if positional[0] in ("completion",):
        return ["bash", "zsh"]
    if positional[0] == "e2b-key":
        return ["create", "list", "revoke"] if len(positional) == 1 else []
    if len(positional) == 1 and positional[0] not in ("list", "run", "snapshots", "logs"):
        try:
            with _client_class()() as client:
                return sorted(s.metadata.name or "" for s in client.list())
        except SandboxError:
            return []
    return []


# -- the parser -------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="kubectl sandbox",
        description="Sandboxes of the sandbox operator: create, exec, cp, snapshot, ...",
    )
    top.add_argument("-n", "--namespace", help="namespace (default: the context's)")
    top.add_argument("--context", help="kubeconfig context")
    top.add_argument("--kubeconfig", help="kubeconfig file")
    top.add_argument("-o", "--output", choices=["json", "yaml", "wide", "name"])
    top.add_argument("--gateway", choices=["auto", "dns", "proxy", "port-forward"])
    top.add_argument("--gateway-url", help="the gateway's URL (else found through its Service)")
    sub = top.add_subparsers(dest="verb", metavar="COMMAND", required=True)
    # kubectl users write `get -o wide -n ns` as often as `-n ns get`: the global
    # flags are taken after the command too (without defaults there, so that a
    # flag given before the command is not overwritten).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-n", "--namespace", default=argparse.SUPPRESS)
    common.add_argument("--context", default=argparse.SUPPRESS)
    common.add_argument("--kubeconfig", default=argparse.SUPPRESS)
    common.add_argument(
        "-o", "--output", choices=["json", "yaml", "wide", "name"], default=argparse.SUPPRESS
    )

    def add(name: str, help_text: str, *aliases: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, aliases=list(aliases), parents=[common])

    def waits(p: argparse.ArgumentParser) -> None:
        p.add_argument("--no-wait", action="store_true", help="return without waiting")

    p = add("create", "create a sandbox (and wait until it is ready)")
    p.add_argument("name", nargs="?")
    p.add_argument("--runtime")
    p.add_argument("--template", help="a SandboxTemplate of the namespace to start from")
    p.add_argument("--cluster-template", help="a ClusterSandboxTemplate to start from")
    p.add_argument("--pool", help="a SandboxPool of the namespace to take a warm sandbox from")
    p.add_argument("--image")
    p.add_argument("--env", "-e", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--cpu")
    p.add_argument("--memory")
    p.add_argument("--profile", help="a resource profile: what it requests of its node (dense)")
    p.add_argument("--workspace-size")
    p.add_argument("--ephemeral", action="store_true")
    p.add_argument("--from-snapshot")
    p.add_argument("--port", type=int, action="append", default=[])
    p.add_argument("--idle-timeout")
    p.add_argument("--on-idle", choices=["Delete", "Pause"])
    p.add_argument("--timeout", type=float, default=180.0)
    waits(p)
    p.set_defaults(run=cmd_create)

    p = add("get", "list sandboxes, or show some", "list")
    p.add_argument("names", nargs="*")
    p.add_argument("-A", "--all-namespaces", action="store_true")
    p.set_defaults(run=cmd_get)

    p = add("delete", "delete sandboxes (waits until they are gone)")
    p.add_argument("names", nargs="+")
    waits(p)
    p.set_defaults(run=cmd_delete)

    for verb, helptext in (("exec", "run a command in a sandbox"), ("run", "one-shot")):
        p = add(verb, helptext + "; output streams, the exit code is the command's")
        if verb == "exec":
            p.add_argument("name")
            p.add_argument(
                "--cwd", help="directory relative to the workspace (its root: .), no '..'"
            )
            p.add_argument("-i", "--stdin", action="store_true", help="pass this stdin on")
        else:
            p.add_argument("--runtime")
            p.add_argument("--image")
            p.add_argument("--file", action="append", default=[], metavar="LOCAL[:REMOTE]")
        p.add_argument("--env", "-e", action="append", default=[], metavar="NAME=VALUE")
        p.add_argument("--timeout", type=float, default=180.0, help="seconds (at most 1800)")
        p.add_argument("command", nargs="*", help="after --, as with kubectl exec")
        p.set_defaults(run=cmd_exec if verb == "exec" else cmd_run)

    p = add("shell", "a terminal in a sandbox: its login shell, or a command, joined to this one")
    p.add_argument("name")
    p.add_argument("--attach", metavar="TERMINAL_ID", help="join a terminal that runs already")
    p.add_argument("command", nargs="*", help="after --: a command line, or a program and args")
    p.set_defaults(run=cmd_shell)

    p = add("terminals", "the terminals of a sandbox (running and lately ended)")
    p.add_argument("name")
    p.set_defaults(run=cmd_terminals)

    p = add("cp", "copy files or directories to or from a sandbox (NAME:PATH)")
    p.add_argument("source")
    p.add_argument("destination")
    p.add_argument("--progress", action="store_true", help="progress bar even when not a tty")
    p.set_defaults(run=cmd_cp)

    p = add("ls", "list a directory of a sandbox")
    p.add_argument("name")
    p.add_argument("path", nargs="?", default=".")
    p.add_argument("-l", "--long", action="store_true")
    p.add_argument("--depth", type=int, default=1)
    p.set_defaults(run=cmd_ls)

    p = add("cat", "print a file of a sandbox")
    p.add_argument("name")
    p.add_argument("path")
    p.add_argument("--lines", help="FIRST:LAST (1-based, inclusive)")
    p.set_defaults(run=cmd_cat)

    p = add("grep", "search the files of a sandbox (exit 1: no match)")
    p.add_argument("name")
    p.add_argument("pattern")
    p.add_argument("path", nargs="?", default=".")
    p.add_argument("-i", "--ignore-case", action="store_true")
    p.add_argument("-F", "--fixed", action="store_true")
    p.add_argument("--glob")
    p.set_defaults(run=cmd_grep)

    p = add("logs", "the full output of an Execution")
    p.add_argument("execution")
    p.add_argument("-f", "--follow", action="store_true")
    p.set_defaults(run=cmd_logs)

    p = add("snapshot", "snapshot a sandbox's workspace")
    p.add_argument("name")
    p.add_argument("--tag")
    p.add_argument("--name", dest="snapshot_name")
    p.add_argument("--quiesce", action="store_true")
    waits(p)
    p.set_defaults(run=cmd_snapshot)

    p = add("snapshots", "list snapshots (of one sandbox)")
    p.add_argument("name", nargs="?")
    p.set_defaults(run=cmd_snapshots)

    p = add("restore", "roll a sandbox's workspace back to a snapshot")
    p.add_argument("name")
    p.add_argument("snapshot")
    waits(p)
    p.set_defaults(run=cmd_restore)

    p = add("fork", "a new sandbox from a snapshot of this one")
    p.add_argument("name")
    p.add_argument("new_name", nargs="?")
    p.add_argument("--snapshot", help="start from this snapshot (default: take one now)")
    waits(p)
    p.set_defaults(run=cmd_fork)

    for verb in ("pause", "resume"):
        p = add(verb, f"{verb} a sandbox (the workspace stays)")
        p.add_argument("name")
        waits(p)
        p.set_defaults(run=cmd_pause if verb == "pause" else cmd_resume)

    p = add("port", "the URL of an exposed port, or a local forward to it")
    p.add_argument("name")
    p.add_argument("port", type=int)
    p.add_argument("--forward", type=int, metavar="LOCAL_PORT", help="serve it on localhost")
    p.set_defaults(run=cmd_port)

    p = add("e2b-key", "API keys for E2B's SDKs (E2B_API_KEY) that act as a ServiceAccount")
    p.add_argument("action", choices=["create", "list", "revoke"])
    p.add_argument("key_id", nargs="?", metavar="ID", help="revoke: the key's id (from list)")
    p.add_argument("--service-account", help="create: the ServiceAccount the key acts as")
    p.add_argument(
        "--expiration-seconds", type=int, help="create: the key ends by itself after this long"
    )
    p.set_defaults(run=cmd_e2b_key)

    p = add("completion", "shell completion script")
    p.add_argument("shell", choices=["bash", "zsh"])
    p.set_defaults(run=cmd_completion)
    return top


def _options(args: argparse.Namespace) -> ConnectionOptions:
    """The connection the global flags ask for (what they leave out is found
    as kubectl finds it)."""
    from sandbox_sdk.config import ConnectionOptions  # yaml: when a command connects

    return ConnectionOptions(
        namespace=args.namespace,
        kubeconfig=args.kubeconfig,
        context=args.context,
        gateway=args.gateway,
        gateway_url=args.gateway_url,
    )


def _client_class() -> type[SandboxClient]:
    """The sync client, imported now that a command needs it. httpx imports its
    own command line (`httpx._main`: rich, click, pygments, a third of httpx's
    import time) whenever those happen to be installed, as the `mcp` extra
    installs them; this process never runs httpx's command line, so its import
    is refused (a None entry in sys.modules), which httpx answers with the stub
    it keeps for installs without them."""
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
    client: type[SandboxClient] = importlib.import_module("sandbox_sdk._sync.client").SandboxClient
    return client


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["__complete"]:
        print("\n".join(complete(words[1:])))
        return 0
    # `exec NAME [flags] -- CMD...`: what follows `--` is the command, untouched
    # (its own flags are not ours), wherever our flags stood before it.
    command: list[str] | None = None
    if "--" in words:
        cut = words.index("--")
        words, command = words[:cut], words[cut + 1 :]
    top = parser()
    args, unknown = top.parse_known_args(words)
    if unknown:
        # A flag of the command given without `--` lands here (`exec box ls -l`):
        # say where the command goes rather than print the top-level usage.
        if args.verb in USAGE:
            top.exit(2, f"error: unknown flag {unknown[0]!r}; usage: {USAGE[args.verb]}\n")
        top.parse_args(words)  # argparse's own message and exit
    if command is not None and hasattr(args, "command"):
        args.command = [*args.command, *command]
    try:
        return _run(args)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as a command killed by
        # SIGPIPE does (a shell reports 141), and point stdout at /dev/null so
        # that the interpreter's last flush does not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return PIPE_EXIT


def _run(args: argparse.Namespace) -> int:
    try:
        if args.verb == "completion":
            return cmd_completion(None, args)
        if args.verb == "exec" and (quick := exec_first(args)) is not None:
            return quick
        with _client_class().from_options(_options(args)) as client:
            code: int = args.run(client, args)
            return code
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SandboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        raise
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def complete_main() -> int:
    """`kubectl_complete-sandbox`: kubectl's plugin completion (kubectl >= 1.26)
    runs it with the words so far; candidates one per line, then Cobra's
    directive `:4` (no file completion)."""
    words = sys.argv[1:]
    print("\n".join([*complete(words[:-1]), ":4"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
