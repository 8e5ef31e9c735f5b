"""What the server does, from flags and their environment variables."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from sandbox_sdk.config import ConnectionOptions

EndAction = Literal["pause", "destroy"]


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name) or default


@dataclass(frozen=True)
class Settings:
    """One server's settings (`sandbox-mcp --help` documents each)."""

    transport: Literal["stdio", "http"] = "stdio"
    namespace: str | None = None
    runtime: str | None = None
    image: str | None = None
    template: str | None = None
    pool: str | None = None
    from_snapshot: str | None = None
    on_end: EndAction = "pause"
    idle_timeout: str | None = None
    session: str | None = None
    kubeconfig: str | None = None
    context: str | None = None
    gateway_url: str | None = None
    api_server: str | None = None
    ca_file: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    session_idle_seconds: float = 1800.0
    # How long one tool call waits for the session's sandbox to become Ready
    # (then not_ready with the Sandbox's reason; the sandbox goes on starting).
    ready_timeout: float = 60.0
    uploads: tuple[str, ...] = field(default_factory=tuple)

    def connection(self) -> ConnectionOptions:
        """The stdio server's connection: the kubeconfig's user. (`api_server` and
        `ca_file` are the http server's, whose callers bring their own tokens.)"""
        return ConnectionOptions(
            namespace=self.namespace,
            kubeconfig=self.kubeconfig,
            context=self.context,
            gateway_url=self.gateway_url,
        )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sandbox-mcp",
        description="The sandbox tool set (files, commands, snapshots) as an MCP server:"
        " one sandbox per MCP session, created on first use.",
    )
    p.add_argument(
        "--transport",
        choices=["stdio", "http"],
        default=_env("SANDBOX_MCP_TRANSPORT", "stdio"),
        help="stdio (local, the kubeconfig's credentials) or http (streamable HTTP; each"
        " caller's own bearer token is used for every call) [$SANDBOX_MCP_TRANSPORT]",
    )
    p.add_argument(
        "-n", "--namespace", default=_env("SANDBOX_NAMESPACE"), help="[$SANDBOX_NAMESPACE]"
    )
    p.add_argument(
        "--runtime",
        default=_env("SANDBOX_MCP_RUNTIME"),
        help="runtime of the catalog a session's sandbox starts from [$SANDBOX_MCP_RUNTIME]",
    )
    p.add_argument("--image", default=_env("SANDBOX_MCP_IMAGE"), help="[$SANDBOX_MCP_IMAGE]")
    p.add_argument(
        "--template",
        default=_env("SANDBOX_MCP_TEMPLATE"),
        help="a SandboxTemplate of the namespace every session's sandbox starts from"
        " (its packages and files included) [$SANDBOX_MCP_TEMPLATE]",
    )
    p.add_argument(
        "--pool",
        default=_env("SANDBOX_MCP_POOL"),
        help="a SandboxPool of the namespace: every session's sandbox is a warm member of it,"
        " ready in milliseconds (instead of --template) [$SANDBOX_MCP_POOL]",
    )
    p.add_argument(
        "--from-snapshot",
        default=_env("SANDBOX_MCP_FROM_SNAPSHOT"),
        help="a Snapshot whose workspace every new session starts with (a template)"
        " [$SANDBOX_MCP_FROM_SNAPSHOT]",
    )
    p.add_argument(
        "--on-end",
        choices=["pause", "destroy"],
        default=_env("SANDBOX_MCP_ON_END", "pause"),
        help="what happens to a session's sandbox when the session ends: pause (the"
        " same session key resumes it) or destroy [$SANDBOX_MCP_ON_END]",
    )
    p.add_argument(
        "--idle-timeout",
        default=_env("SANDBOX_MCP_IDLE_TIMEOUT"),
        help="spec.lifecycle.idleTimeout of new sandboxes (e.g. 30m); unset: the operator's"
        " default [$SANDBOX_MCP_IDLE_TIMEOUT]",
    )
    p.add_argument(
        "--session",
        default=_env("SANDBOX_MCP_SESSION"),
        help="stdio: the session key; a server restarted with the same key gets the same"
        " sandbox back (default: a new key per process) [$SANDBOX_MCP_SESSION]",
    )
    p.add_argument("--kubeconfig", default=_env("KUBECONFIG"))
    p.add_argument("--context", default=None)
    p.add_argument(
        "--gateway-url", default=_env("SANDBOX_GATEWAY_URL"), help="[$SANDBOX_GATEWAY_URL]"
    )
    p.add_argument(
        "--api-server",
        default=_env("SANDBOX_MCP_API_SERVER"),
        help="http: the API server callers' tokens are used with (default: the pod's)"
        " [$SANDBOX_MCP_API_SERVER]",
    )
    p.add_argument(
        "--ca-file", default=_env("SANDBOX_MCP_CA_FILE"), help="http: its CA [$SANDBOX_MCP_CA_FILE]"
    )
    p.add_argument(
        "--host", default=_env("SANDBOX_MCP_HOST", "127.0.0.1"), help="http: [$SANDBOX_MCP_HOST]"
    )
    p.add_argument(
        "--port",
        type=int,
        default=int(_env("SANDBOX_MCP_PORT", "8000") or 8000),
        help="http: [$SANDBOX_MCP_PORT]",
    )
    p.add_argument(
        "--session-idle-seconds",
        type=float,
        default=float(_env("SANDBOX_MCP_SESSION_IDLE_SECONDS", "1800") or 1800),
        help="http: an MCP session without requests for this long ends"
        " [$SANDBOX_MCP_SESSION_IDLE_SECONDS]",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=float(_env("SANDBOX_MCP_READY_TIMEOUT", "60") or 60),
        help="seconds a tool call waits for the session's sandbox to become ready, with"
        " progress notifications of why it is not yet; then a not_ready result (the"
        " sandbox goes on starting) [$SANDBOX_MCP_READY_TIMEOUT]",
    )
    p.add_argument(
        "--upload",
        action="append",
        default=[],
        metavar="FILE",
        help="stdio: a local file copied to ./user-uploads/ of the session's sandbox when"
        " the session first uses it (repeatable)",
    )
    return p


def parse(argv: Sequence[str] | None = None) -> Settings:
    args = parser().parse_args(argv)
    return Settings(
        transport=args.transport,
        namespace=args.namespace,
        runtime=args.runtime,
        image=args.image,
        template=args.template,
        pool=args.pool,
        from_snapshot=args.from_snapshot,
        on_end=args.on_end,
        idle_timeout=args.idle_timeout,
        session=args.session,
        kubeconfig=args.kubeconfig,
        context=args.context,
        gateway_url=args.gateway_url,
        api_server=args.api_server,
        ca_file=args.ca_file,
        host=args.host,
        port=args.port,
        session_idle_seconds=args.session_idle_seconds,
        ready_timeout=args.ready_timeout,
        uploads=tuple(args.upload),
    )
