"""Python SDK for the sandbox operator: sandboxes as objects.

    from sandbox_sdk import SandboxClient

    client = SandboxClient()                      # kubeconfig, or the pod's ServiceAccount
    with client.create("python") as sandbox:      # destroyed at the end, also on error
        sandbox.files.write("main.py", "print(6 * 7)")
        print(sandbox.execute("python3 main.py").stdout)

`SandboxClient` (sync) and `AsyncSandboxClient` (asyncio) have the same surface.
"""

from sandbox_sdk._async.client import (
    AsyncFiles,
    AsyncJob,
    AsyncSandbox,
    AsyncSandboxClient,
)
from sandbox_sdk._sync.client import Files, Job, Sandbox, SandboxClient
from sandbox_sdk.errors import (
    CommandFailed,
    CommandLost,
    CommandTimeout,
    ConfigError,
    Conflict,
    Forbidden,
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
from sandbox_sdk.types import CommandResult, Event, OutputEvent, Runtime, Template

__version__ = "0.1.0.dev0"

__all__ = [
    "AsyncFiles",
    "AsyncJob",
    "AsyncSandbox",
    "AsyncSandboxClient",
    "CommandFailed",
    "CommandLost",
    "CommandResult",
    "CommandTimeout",
    "ConfigError",
    "Conflict",
    "Event",
    "Files",
    "Forbidden",
    "Invalid",
    "Job",
    "NotFound",
    "NotReady",
    "OutputEvent",
    "Paused",
    "Runtime",
    "Sandbox",
    "SandboxClient",
    "SandboxError",
    "ServerError",
    "Template",
    "Timeout",
    "Unauthorized",
    "WorkspaceFull",
]
