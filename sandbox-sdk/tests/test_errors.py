"""The typed error for each failed response (errors.from_response): pure."""

from __future__ import annotations

import pytest

from sandbox_sdk import errors


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [
        (507, "no_space", errors.WorkspaceFull),
        (507, "quota_exceeded", errors.WorkspaceFull),
        (404, "not_found", errors.NotFound),
        (409, "sandbox_paused", errors.Paused),
        (409, "already_exists", errors.Conflict),
        (413, "too_large", errors.Invalid),
        (503, "sandbox_not_ready", errors.NotReady),
        (500, "internal", errors.ServerError),
    ],
)
def test_each_status_and_code_gets_its_error(
    status: int, code: str, kind: type[errors.SandboxError]
) -> None:
    body = {"error": {"code": code, "message": "what the server said", "details": {"path": "a"}}}
    error = errors.from_response(status, body, "fallback")
    assert type(error) is kind
    assert (error.status, error.code, error.message) == (status, code, "what the server said")
    assert error.details == {"path": "a"}
