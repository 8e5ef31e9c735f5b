"""Domain errors: what went wrong, as a stable code and a sentence, never an HTTP status.

Modules below the HTTP edge (files, executions, paths, ...) raise these. The
edge (app.py, ``STATUS``) maps each kind to a status in one table, so a
domain module never decides how the web answers, and every error reaches the
caller as ``{"error": {"code", "message", "details"?}}``.
"""

from __future__ import annotations

from typing import Any


class AgentError(Exception):
    """Base of every error a caller is meant to see; ``code`` is machine-readable."""

    def __init__(self, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details or None

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details is not None:
            err["details"] = self.details
        return {"error": err}


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
