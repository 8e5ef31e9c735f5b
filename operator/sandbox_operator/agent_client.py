"""httpx client for the sandbox agent (the sidecar in every sandbox pod).

The agent's OpenAPI document (sandbox-agent/openapi.json) is the contract;
this client uses the few calls the operator needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx


class AgentError(Exception):
    """The agent could not be reached or answered with an error."""


@dataclass(frozen=True)
class AgentInfo:
    last_activity: datetime
    active_executions: int
    version: str | None
    runner_connected: bool


def parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


class AgentClient:
    """One pooled HTTP client for all agents; the endpoint and token vary per call."""

    def __init__(self, timeout: float) -> None:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(timeout=timeout, limits=limits)

    async def _get(self, endpoint: str, token: str, path: str) -> Any:
        try:
            response = await self._http.get(
                endpoint + path, headers={"Authorization": f"Bearer {token}"}
            )
        except httpx.HTTPError as exc:
            raise AgentError(f"agent at {endpoint} unreachable: {exc!r}") from exc
        if response.status_code != 200:
            raise AgentError(
                f"agent at {endpoint} answered {response.status_code}: {response.text[:200]}"
            )
        return response.json()

    async def _post(self, endpoint: str, token: str, path: str, body: Any = None) -> Any:
        try:
            response = await self._http.post(
                endpoint + path, headers={"Authorization": f"Bearer {token}"}, json=body
            )
        except httpx.HTTPError as exc:
            raise AgentError(f"agent at {endpoint} unreachable: {exc!r}") from exc
        if response.status_code != 200:
            raise AgentError(
                f"agent at {endpoint} answered {response.status_code}: {response.text[:200]}"
            )
        return response.json()

    async def sync(self, endpoint: str, token: str) -> None:
        """Flush the workspace to disk."""
        await self._post(endpoint, token, "/v1/workspace/sync")

    async def quiesce(self, endpoint: str, token: str, seconds: float) -> int:
        """Stop running executions (the agent resumes them after `seconds` by itself)
        and flush the workspace; the number of executions stopped."""
        data = await self._post(endpoint, token, "/v1/workspace/quiesce", {"seconds": seconds})
        try:
            return len(data["quiesced"])
        except (KeyError, TypeError) as exc:
            raise AgentError(f"agent at {endpoint} sent a malformed answer: {exc!r}") from exc

    async def resume(self, endpoint: str, token: str) -> None:
        await self._post(endpoint, token, "/v1/workspace/resume")

    async def info(self, endpoint: str, token: str) -> AgentInfo:
        data = await self._get(endpoint, token, "/v1/info")
        try:
            return AgentInfo(
                last_activity=parse_time(data["lastActivity"]),
                active_executions=int(data.get("activeExecutions", 0)),
                version=data.get("version"),
                runner_connected=bool(data.get("runnerConnected", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AgentError(f"agent at {endpoint} sent malformed info: {exc!r}") from exc

    async def close(self) -> None:
        await self._http.aclose()
