"""Typed errors, each carrying the server's own reason.

Every failure the SDK reports is a `SandboxError` with the HTTP status, the
server's machine-readable code (`sandbox_not_ready`, `path_traversal`, a
Kubernetes `Status.reason` such as `AlreadyExists`...) and its message. The
subclasses are what callers branch on. The sandbox agent's codes, each with
its status and meaning, are `AgentErrorCode` (generated from the agent's
OpenAPI document); they compare equal to the plain strings in `code`.
"""

from __future__ import annotations

from typing import Any


class SandboxError(Exception):
    """Base of every SDK error: `status` (HTTP, 0 when no response), `code`
    (the server's machine-readable reason) and `message` (the server's words)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 0,
        code: str = "",
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.details = details or {}

    def __str__(self) -> str:
        return f"{self.message} ({self.code})" if self.code else self.message


class NotFound(SandboxError):
    """No such sandbox, snapshot, execution, or file (404)."""


class NotReady(SandboxError):
    """The sandbox cannot serve yet (503 `sandbox_not_ready`, or a wait that ran out):
    `reason` is the Sandbox's own Ready reason (PodPending, ImagePullFailed, ...),
    `why` its Ready condition's message when the SDK read it."""

    def __init__(self, message: str, *, reason: str = "", why: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.reason = reason
        self.why = why


class Paused(SandboxError):
    """The sandbox is paused by its spec (409 `sandbox_paused`): `resume()` it first."""


class Unauthorized(SandboxError):
    """No credentials, or credentials the API server does not accept (401)."""


class Forbidden(SandboxError):
    """Authenticated, but RBAC (or a scoped token) does not allow it (403)."""


class Conflict(SandboxError):
    """The object exists already, changed meanwhile, or the agent refused the
    request in the current state (409: `idempotency_key_reused`, `patch_conflict`,
    `no_match`, `stdin_closed`, AlreadyExists...)."""


class Invalid(SandboxError):
    """The server refused the request as malformed (400, 422)."""


class WorkspaceFull(SandboxError):
    """The sandbox's workspace has no room for the write (507 `no_space` or
    `quota_exceeded`): remove files, or use a Sandbox with a larger
    `spec.workspace.size`. The sandbox itself keeps working."""


class Timeout(SandboxError):
    """Something did not happen in time: a wait of the SDK, or a request."""


class CommandTimeout(Timeout):
    """A command ran past its timeout and was stopped (the sandbox stays usable).
    `result` is the agent's record of it, with the output it produced."""

    def __init__(self, message: str, *, result: Any = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.result = result


class CommandLost(SandboxError):
    """The command never reached an exit code: the agent or the runner restarted
    under it, or it could not be started (`code` is the agent's reason:
    `agent_restarted`, `runner_lost`, `spawn_failed`...). It may have partly
    run; `result` holds the agent's record and what output there was."""

    def __init__(self, message: str, *, result: Any = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.result = result

    @classmethod
    def of(cls, result: Any) -> CommandLost:
        """The error for a `CommandResult` whose `lost` is true."""
        error = result.execution.error
        return cls(
            f"the command did not run to its end: {error.message if error else result.status}",
            result=result,
            code=error.code if error else result.status,
        )


class Gone(SandboxError):
    """What was asked for existed but is no longer kept (410): `log_pruned`, a
    command's output log removed to keep the agent's log directory under its
    cap, or output that lived only in the memory of an agent that restarted
    since. The command's record (exit code, output tails) is still there."""


class ServerError(SandboxError):
    """The server failed (5xx other than not-ready), or could not be reached."""


class ConfigError(SandboxError):
    """No way to reach the cluster or the gateway was found, or it is inconsistent."""


def from_response(status: int, body: Any, fallback: str) -> SandboxError:
    """The typed error for a failed response: the gateway/agent shape
    `{"error": {"code", "message", "details"}}` or a Kubernetes `Status`."""
    code, message = "", fallback
    details: dict[str, Any] = {}
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict):
            err = body["error"]
            code = str(err.get("code") or "")
            message = str(err.get("message") or fallback)
            details = err["details"] if isinstance(err.get("details"), dict) else {}
        elif body.get("kind") == "Status":
            code = str(body.get("reason") or "")
            message = str(body.get("message") or fallback)
            details = body["details"] if isinstance(body.get("details"), dict) else {}
    kwargs: dict[str, Any] = {"status": status, "code": code, "details": details}
    if status == 404:
        return NotFound(message, **kwargs)
    if status == 401:
        return Unauthorized(message, **kwargs)
    if status == 403:
        return Forbidden(message, **kwargs)
    if status == 409 and code == "sandbox_paused":
        return Paused(message, **kwargs)
    if status == 409:
        return Conflict(message, **kwargs)
    if status in (400, 413, 422):
        return Invalid(message, **kwargs)
    if status == 503 and code == "sandbox_not_ready":
        # The gateway's message carries the reason in parentheses: "is not ready (PodPending): ..."
        reason = message.split("(", 1)[1].split(")", 1)[0] if "(" in message else ""
        return NotReady(message, reason=reason, **kwargs)
    if status == 507:
        return WorkspaceFull(message, **kwargs)
    if status == 410:
        return Gone(message, **kwargs)
    if status in (408, 504):
        return Timeout(message, **kwargs)
    return ServerError(message, **kwargs)


class CommandFailed(SandboxError):
    """`check=True` and the command did not exit 0. `result` holds its output."""

    def __init__(self, message: str, *, result: Any = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.result = result
