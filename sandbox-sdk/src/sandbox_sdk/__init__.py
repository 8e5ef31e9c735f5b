"""Python SDK for the sandbox operator: sandboxes as objects.

    from sandbox_sdk import SandboxClient

    client = SandboxClient()                      # kubeconfig, or the pod's ServiceAccount
    with client.create("python") as sandbox:      # destroyed at the end, also on error
        sandbox.files.write("main.py", "print(6 * 7)")
        print(sandbox.execute("python3 main.py").stdout)

`SandboxClient` (sync) and `AsyncSandboxClient` (asyncio) have the same surface.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The errors module is light (no third-party imports): imported as usual.
from sandbox_sdk.errors import (
    CommandFailed,
    CommandLost,
    CommandTimeout,
    ConfigError,
    Conflict,
    Forbidden,
    Gone,
    Invalid,
    NotFound,
    NotReady,
    Paused,
    SandboxError,
    ServerError,
    Timeout,
    Unauthorized,
    WorkspaceFull,
)

if TYPE_CHECKING:
    from sandbox_sdk._async.client import AsyncSandboxClient
    from sandbox_sdk._async.code import AsyncContexts
    from sandbox_sdk._async.executions import AsyncJob
    from sandbox_sdk._async.files import AsyncFiles, AsyncWatch
    from sandbox_sdk._async.sandbox import AsyncSandbox
    from sandbox_sdk._async.terminals import AsyncTerminal, AsyncTerminals, AsyncTerminalSession
    from sandbox_sdk._sync.client import SandboxClient
    from sandbox_sdk._sync.code import Contexts
    from sandbox_sdk._sync.executions import Job
    from sandbox_sdk._sync.files import Files, Watch
    from sandbox_sdk._sync.sandbox import Sandbox
    from sandbox_sdk._sync.terminals import Terminal, Terminals, TerminalSession
    from sandbox_sdk.models.agent_codes import AgentErrorCode
    from sandbox_sdk.types import (
        CodeError,
        CommandResult,
        Event,
        Execution,
        Logs,
        OutputEvent,
        Result,
        Runtime,
        Template,
    )

# Where each public name lives. They are imported on first use (PEP 562), not
# here: `kubectl sandbox` imports this package for its CLI module, and the
# clients pull httpx, pydantic and every generated model (a third of a second
# of start-up that `kubectl sandbox completion` or a usage error never needs).
_HOMES = {
    name: home
    for home, names in {
        "_async.client": ("AsyncSandboxClient",),
        "_async.sandbox": ("AsyncSandbox",),
        "_async.executions": ("AsyncJob",),
        "_async.files": ("AsyncFiles", "AsyncWatch"),
        "_async.terminals": ("AsyncTerminal", "AsyncTerminals", "AsyncTerminalSession"),
        "_async.code": ("AsyncContexts",),
        "_sync.client": ("SandboxClient",),
        "_sync.sandbox": ("Sandbox",),
        "_sync.executions": ("Job",),
        "_sync.files": ("Files", "Watch"),
        "_sync.terminals": ("Terminal", "Terminals", "TerminalSession"),
        "_sync.code": ("Contexts",),
        "types": (
            "CodeError",
            "CommandResult",
            "Event",
            "Execution",
            "Logs",
            "OutputEvent",
            "Result",
            "Runtime",
            "Template",
        ),
        "models.agent_codes": ("AgentErrorCode",),
    }.items()
    for name in names
}

__version__ = "0.1.0.dev0"

__all__ = [
    "AgentErrorCode",
    "AsyncContexts",
    "AsyncFiles",
    "AsyncJob",
    "AsyncSandbox",
    "AsyncSandboxClient",
    "AsyncTerminal",
    "AsyncTerminalSession",
    "AsyncTerminals",
    "AsyncWatch",
    "CodeError",
    "CommandFailed",
    "CommandLost",
    "CommandResult",
    "CommandTimeout",
    "ConfigError",
    "Conflict",
    "Contexts",
    "Event",
    "Execution",
    "Files",
    "Forbidden",
    "Gone",
    "Invalid",
    "Job",
    "Logs",
    "NotFound",
    "NotReady",
    "OutputEvent",
    "Paused",
    "Result",
    "Runtime",
    "Sandbox",
    "SandboxClient",
    "SandboxError",
    "ServerError",
    "Template",
    "Terminal",
    "TerminalSession",
    "Terminals",
    "Timeout",
    "Unauthorized",
    "Watch",
    "WorkspaceFull",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # once found, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
