"""httpx client for the sandbox agent (the sidecar in every sandbox pod).

The agent's OpenAPI document (sandbox-agent/openapi.json) is the contract;
this client uses the few calls the operator needs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx

from sandbox_operator.clock import parse_time
from sandbox_operator.kube import ShuttingDown


class AgentError(Exception):
    """The agent could not be reached or answered with an error.

    `status` is the HTTP status of an answer (None: no answer at all) and
    `code` the agent's machine-readable error code, when it sent one."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    @property
    def refused(self) -> bool:
        """The agent answered and will give the same answer again (a 4xx other than 429)."""
        return self.status is not None and 400 <= self.status < 500 and self.status != 429


@dataclass(frozen=True)
class AgentInfo:
    last_activity: datetime
    active_executions: int
    version: str | None
    runner_connected: bool
    # Digest of the environment the agent gives new commands (see environment_hash).
    environment_hash: str | None = None
    # The workspace's filesystem, when the agent could read it.
    workspace: WorkspaceUsage | None = None
    # The sandbox container's cgroup counters, when the runner reported them.
    limits: LimitCounters | None = None
    # When the agent process started: one restored from a memory image keeps
    # the time it first started, before its pod was made.
    started_at: datetime | None = None


@dataclass(frozen=True)
class WorkspaceUsage:
    total_bytes: int
    available_bytes: int


@dataclass(frozen=True)
class LimitCounters:
    """Cumulative since the sandbox container started; None where not shown."""

    pids_refused: int | None = None
    pids_current: int | None = None
    cpu_periods: int | None = None
    cpu_throttled_periods: int | None = None


def _limit_counters(data: Any) -> LimitCounters | None:
    """The agent's `limits` (None when it sent none: an older agent, no runner)."""
    if not data:
        return None

    def whole(key: str) -> int | None:
        value = data.get(key)
        return None if value is None else int(value)

    return LimitCounters(
        pids_refused=whole("pidsRefused"),
        pids_current=whole("pidsCurrent"),
        cpu_periods=whole("cpuPeriods"),
        cpu_throttled_periods=whole("cpuThrottledPeriods"),
    )


def environment_hash(env: dict[str, str], unset: list[str]) -> str:
    """The agent's digest of an environment overlay (its /v1/environment contract)."""
    canonical = json.dumps(
        {"env": env, "unset": sorted(unset)}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def _workspace_usage(data: Any) -> WorkspaceUsage | None:
    """The agent's workspaceUsage (None when it sent none: an older agent, an unreadable mount)."""
    if not data:
        return None
    return WorkspaceUsage(int(data["totalBytes"]), int(data["availableBytes"]))


class AgentClient:
    """One pooled HTTP client for all agents; the endpoint and token vary per call."""

    def __init__(self, timeout: float) -> None:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(timeout=timeout, limits=limits)

    async def _call(
        self,
        method: str,
        endpoint: str,
        token: str,
        path: str,
        *,
        body: Any = None,
        content: bytes | None = None,
        params: dict[str, str] | None = None,
        read_timeout: float | None = None,
    ) -> Any:
        if self._http.is_closed:
            raise ShuttingDown("agent")
        try:
            response = await self._http.request(
                method,
                endpoint + path,
                headers={"Authorization": f"Bearer {token}"},
                json=body,
                content=content,
                params=params,
                timeout=read_timeout if read_timeout is not None else self._http.timeout,
            )
        except httpx.HTTPError as exc:
            raise AgentError(f"agent at {endpoint} unreachable: {exc!r}") from exc
        if response.status_code >= 300:
            code = message = None
            try:
                error = response.json()["error"]
                code, message = str(error["code"]), str(error["message"])
            except (ValueError, KeyError, TypeError):
                message = response.text[:200]
            raise AgentError(
                f"agent at {endpoint} answered {response.status_code}: {message}",
                status=response.status_code,
                code=code,
            )
        return response.json() if response.content else None

    async def _get(self, endpoint: str, token: str, path: str) -> Any:
        return await self._call("GET", endpoint, token, path)

    async def _post(self, endpoint: str, token: str, path: str, body: Any = None) -> Any:
        return await self._call("POST", endpoint, token, path, body=body)

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
                environment_hash=data.get("environmentHash"),
                workspace=_workspace_usage(data.get("workspaceUsage")),
                limits=_limit_counters(data.get("limits")),
                started_at=parse_time(data["startedAt"]) if data.get("startedAt") else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AgentError(f"agent at {endpoint} sent malformed info: {exc!r}") from exc

    async def set_environment(
        self, endpoint: str, token: str, env: dict[str, str], unset: list[str]
    ) -> str:
        """Replace the environment overlay new commands get; returns its digest."""
        data = await self._call(
            "PUT", endpoint, token, "/v1/environment", body={"env": env, "unset": sorted(unset)}
        )
        return str((data or {}).get("hash", ""))

    # Executions. Records are the agent's JSON (sandbox-agent/openapi.json, Execution).

    async def start(self, endpoint: str, token: str, request: dict[str, Any]) -> dict[str, Any]:
        """Start a command in the background; with an idempotency key, a repeat of the
        same request returns the first execution instead of running it again."""
        record: dict[str, Any] = await self._call(
            "POST", endpoint, token, "/v1/executions", body={**request, "background": True}
        )
        return record

    async def execution(
        self, endpoint: str, token: str, execution_id: str, wait_seconds: float = 0
    ) -> dict[str, Any]:
        """One execution with its output tails, waiting up to `wait_seconds` for its exit."""
        params = {"waitSeconds": f"{wait_seconds:g}"} if wait_seconds else None
        record: dict[str, Any] = await self._call(
            "GET",
            endpoint,
            token,
            f"/v1/executions/{execution_id}",
            params=params,
            read_timeout=wait_seconds + (self._http.timeout.read or 5) if wait_seconds else None,
        )
        return record

    async def find(self, endpoint: str, token: str, idempotency_key: str) -> dict[str, Any] | None:
        """The execution started with this idempotency key, if the agent knows it."""
        listing = await self._call("GET", endpoint, token, "/v1/executions")
        for record in listing.get("executions", []):
            if record.get("idempotencyKey") == idempotency_key:
                return await self.execution(endpoint, token, str(record["id"]))
        return None

    async def cancel(
        self, endpoint: str, token: str, execution_id: str, grace_seconds: float
    ) -> dict[str, Any]:
        """SIGTERM the process group, SIGKILL after the grace; returns the ended execution."""
        record: dict[str, Any] = await self._call(
            "POST",
            endpoint,
            token,
            f"/v1/executions/{execution_id}/cancel",
            body={"graceSeconds": grace_seconds},
            read_timeout=grace_seconds + (self._http.timeout.read or 5) + 5,
        )
        return record

    async def write_file(
        self, endpoint: str, token: str, path: str, content: bytes, mode: int | None
    ) -> None:
        params = {"path": path}
        if mode is not None:
            params["mode"] = f"{mode:04o}"
        await self._call(
            "PUT", endpoint, token, "/v1/files/content", content=content, params=params
        )

    async def close(self) -> None:
        await self._http.aclose()
