"""The one error type handlers raise; it becomes ``{"error": {...}}`` with a status."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    def __init__(
        self, status: int, code: str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details is not None:
            err["details"] = self.details
        return {"error": err}


def bad_request(code: str, message: str, **details: Any) -> ApiError:
    return ApiError(400, code, message, details or None)


def not_found(what: str) -> ApiError:
    return ApiError(404, "not_found", f"{what} not found")


def conflict(code: str, message: str, **details: Any) -> ApiError:
    return ApiError(409, code, message, details or None)
