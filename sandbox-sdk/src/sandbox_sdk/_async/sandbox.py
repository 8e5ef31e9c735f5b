"""AsyncSandbox: a handle on one sandbox. Its lifecycle through the Sandbox
resource (wait, pause, resume, env, events, destroy), and the gateway calls its
commands, files and terminals go through, which wait while it starts."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from sandbox_sdk import _lazy
from sandbox_sdk._async import executions, snapshots
from sandbox_sdk._async.code import AsyncContexts, run_code
from sandbox_sdk._async.files import AsyncFiles
from sandbox_sdk._async.kube import core_path, resource_path
from sandbox_sdk._async.terminals import AsyncTerminals
from sandbox_sdk._async_io import sleep
from sandbox_sdk._objects import condition, is_ready, observed, utc_now
from sandbox_sdk.errors import Conflict, NotFound, NotReady, SandboxError, ServerError, Timeout
from sandbox_sdk.types import Event

if TYPE_CHECKING:
    from sandbox_sdk._async.client import AsyncSandboxClient
    from sandbox_sdk._async.websocket import AsyncWebSocket
    from sandbox_sdk.models import agent, resources
else:  # the generated models are built on first use: see sandbox_sdk._lazy
    agent = _lazy.module("sandbox_sdk.models.agent")
    resources = _lazy.module("sandbox_sdk.models.resources")

JSON = dict[str, Any]
READY_TIMEOUT = 180.0
RESUME_ANNOTATION = "sandbox.dev/resume-requested-at"
# Ready=False reasons that no amount of waiting fixes (PodFailed is not one: the
# operator replaces a failed pod on the same workspace).
FATAL_REASONS = {"InvalidSpec", "RuntimeMissingPython", "ImagePullFailed"}


def _timestamp(text: Any) -> datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def _event_order(event: JSON) -> tuple[datetime, int, datetime, str]:
    """When an Event last happened, for sorting oldest first. lastTimestamp has
    whole seconds (and the list comes in name order, random suffixes), so
    within one second the order of the writes decides: resourceVersion (the
    API server's write counter; opaque by contract, a number in every
    implementation), then the finest time the Event carries (eventTime and
    series.lastObservedTime have microseconds)."""
    meta = event.get("metadata") or {}
    stamps = [
        _timestamp(text)
        for text in (
            (event.get("series") or {}).get("lastObservedTime"),
            event.get("lastTimestamp"),
            event.get("eventTime"),
            meta.get("creationTimestamp"),
        )
    ]
    when = max((t for t in stamps if t is not None), default=datetime.min.replace(tzinfo=UTC))
    version = str(meta.get("resourceVersion") or "")
    return (
        when.replace(microsecond=0),
        int(version) if version.isdigit() else 0,
        when,
        str(meta.get("name") or ""),
    )


class AsyncSandbox:
    """A handle on one sandbox. `async with` destroys it at the end, also on error.

    Commands and files go through the gateway; `pause`, `resume`, `set_env`,
    `snapshot`, `fork`, `restore` and `destroy` change the Sandbox resource.
    Calls made while the sandbox is not ready yet wait for it (bounded by
    `ready_timeout`), so a handle from `create(wait=False)` is usable at once.
    """

    def __init__(
        self,
        client: AsyncSandboxClient,
        name: str,
        namespace: str,
        body: JSON | None = None,
        ready_timeout: float = READY_TIMEOUT,
    ) -> None:
        self.client = client
        self.name = name
        self.namespace = namespace
        self.ready_timeout = ready_timeout
        self._body = body
        self.files = AsyncFiles(self)
        self.terminals = AsyncTerminals(self)
        self.contexts = AsyncContexts(self)

    def __repr__(self) -> str:
        return f"<Sandbox {self.namespace}/{self.name}>"

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.destroy()
        except SandboxError:
            if exc is None:
                raise  # otherwise the original error is the one worth seeing

    # Commands and jobs (executions.py), snapshots (snapshots.py) and stateful
    # code (code.py) are defined with their concern, the sandbox their first
    # argument: methods of this class all the same.
    execute = executions.execute
    stream = executions.stream
    start = executions.start
    jobs = executions.jobs
    job = executions.job
    _events = executions._events
    snapshot = snapshots.snapshot
    fork = snapshots.fork
    restore = snapshots.restore
    lineage = snapshots.lineage
    run_code = run_code

    # -- the resource ----------------------------------------------------------------

    @property
    def _path(self) -> str:
        return resource_path("sandboxes", self.namespace, self.name)

    async def _get(self) -> JSON | None:
        try:
            body = await self.client._kube().get(self._path)
        except NotFound:
            return None
        self._body = body
        return body

    async def refresh(self) -> resources.Sandbox:
        """The Sandbox as it is now (spec and status)."""
        body = await self._get()
        if body is None:
            raise NotFound(f"sandbox {self.namespace}/{self.name} does not exist", status=404)
        return resources.Sandbox.model_validate(body)

    @property
    def uid(self) -> str | None:
        return None if self._body is None else self._body["metadata"].get("uid")

    async def _patch(self, body: JSON) -> JSON:
        patched = await self.client._kube().patch(self._path, body)
        self._body = patched
        return patched

    async def _wait(
        self, test: Callable[[JSON | None], bool], timeout: float, what: str
    ) -> JSON | None:
        """Until `test(object or None)` holds: a watch, so no poll interval adds up."""
        kube = self.client._kube()
        deadline = time.monotonic() + timeout
        body = await self._get()
        collection = resource_path("sandboxes", self.namespace)
        while True:
            if test(body):
                return body
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Timeout(f"sandbox {self.namespace}/{self.name}: {what} not in {timeout:.0f}s")
            params = {"fieldSelector": f"metadata.name={self.name}"}
            if body is not None:
                params["resourceVersion"] = body["metadata"]["resourceVersion"]
            try:
                async for event in kube.watch(collection, params, min(remaining, 30.0)):
                    kind = event.get("type")
                    if kind == "ERROR":
                        break
                    body = None if kind == "DELETED" else event.get("object")
                    self._body = body
                    if test(body):
                        return body
                    if time.monotonic() > deadline:
                        break
            except (ServerError, Conflict):
                await sleep(0.2)
            body = await self._get()

    async def wait_ready(
        self,
        timeout: float | None = None,
        *,
        on_waiting: Callable[[str, str], object] | None = None,
    ) -> resources.Sandbox:
        """Until the sandbox is Ready. NotReady (with the Sandbox's reason) when it
        cannot become ready (InvalidSpec, ImagePullFailed, ...) or does not in
        `timeout` seconds; NotFound when it is deleted meanwhile.

        `on_waiting(reason, message)` is called each time the Ready condition's
        reason or message changes while it is not ready: what it waits on, such
        as `Unschedulable` with the scheduler's `Insufficient cpu`."""
        fatal: list[JSON] = []
        told: list[tuple[str, str]] = []

        def done(body: JSON | None) -> bool:
            if body is None:
                return True
            cond = condition(body, "Ready")
            if on_waiting is not None and cond and cond.get("status") != "True":
                now = (str(cond.get("reason") or ""), str(cond.get("message") or ""))
                if not told or told[-1] != now:
                    told.append(now)
                    on_waiting(*now)
            if cond and observed(body) and cond.get("reason") in FATAL_REASONS:
                fatal.append(cond)
                return True
            return is_ready(body)

        try:
            body = await self._wait(done, timeout or self.ready_timeout, "Ready")
        except Timeout as exc:
            cond = condition(self._body, "Ready") or {}
            raise NotReady(
                f"{exc}; Ready={cond.get('status')} ({cond.get('reason')}): {cond.get('message')}",
                reason=str(cond.get("reason") or ""),
                why=str(cond.get("message") or ""),
                code="timeout",
            ) from exc
        if body is None:
            raise NotFound(f"sandbox {self.namespace}/{self.name} was deleted", status=404)
        if fatal:
            cond = fatal[0]
            raise NotReady(
                f"sandbox {self.name} cannot become ready ({cond.get('reason')}):"
                f" {cond.get('message')}",
                reason=str(cond.get("reason")),
                code="not_ready",
            )
        return resources.Sandbox.model_validate(body)

    async def pause(self, *, wait: bool = True, timeout: float = 120.0) -> None:
        """Stop the pod, keep the workspace (`spec.paused: true`). With `wait`,
        return once the pod is gone (its processes ended, the workspace
        released), not when it starts terminating."""
        await self._patch({"spec": {"paused": True}})
        if wait:
            # The phase reads Paused from the moment the pod is asked to stop
            # (reason Pausing); the Paused condition turns True only once the
            # pod has gone, seconds later.
            def stopped(b: JSON | None) -> bool:
                cond = condition(b, "Paused")
                return bool(cond and cond.get("status") == "True" and observed(b))

            await self._wait(stopped, timeout, "Paused")

    async def resume(self, *, wait: bool = True, timeout: float | None = None) -> None:
        """Start the pod again on the same workspace: `spec.paused: false`, and
        the resume annotation for a sandbox its idle policy paused."""
        patch: JSON = {"spec": {"paused": False}}
        body = self._body or await self._get()
        if body is not None and (body.get("status") or {}).get("idlePausedAt"):
            patch["metadata"] = {"annotations": {RESUME_ANNOTATION: utc_now()}}
        await self._patch(patch)
        if wait:
            await self.wait_ready(timeout)

    async def set_env(self, env: Mapping[str, str | None], *, wait: bool = True) -> dict[str, str]:
        """Set (or, with None, delete) variables of `spec.env`; commands started
        afterwards see them (the pod stays). Waits until the agent applied them.
        Returns the literal variables now set."""
        for _ in range(5):
            body = await self._get()
            if body is None:
                raise NotFound(f"sandbox {self.name} does not exist", status=404)
            current: list[JSON] = list((body.get("spec") or {}).get("env") or [])
            wanted = [v for v in current if v["name"] not in env]
            wanted += [{"name": k, "value": v} for k, v in env.items() if v is not None]
            if wanted == current:
                break
            before = await self._environment_hash() if wait else None
            try:
                # resourceVersion: a concurrent writer makes this 409, not a lost update.
                await self._patch(
                    {
                        "metadata": {"resourceVersion": body["metadata"]["resourceVersion"]},
                        "spec": {"env": wanted},
                    }
                )
            except Conflict:
                continue
            if wait:
                deadline = time.monotonic() + 60
                while await self._environment_hash() == before:
                    if time.monotonic() > deadline:
                        raise Timeout(f"sandbox {self.name}: the new env was not applied in 60s")
                    await sleep(0.1)
            break
        else:
            raise Conflict(f"sandbox {self.name}: env changed concurrently, 5 tries", status=409)
        return {v["name"]: v["value"] for v in wanted if "value" in v}

    async def _environment_hash(self) -> str | None:
        try:
            return (await self.info()).environment_hash
        except (NotReady, SandboxError):
            return None

    async def info(self) -> agent.Info:
        """The agent's view: activity, running commands, runner state."""
        return agent.Info.model_validate((await self._request("GET", "info")).json())

    async def url(self, port: int, *, token: bool = True, ttl: int = 3600) -> str:
        """The preview URL of an exposed port (`status.ports[].url`). A private
        port's URL carries a scoped token (operation `ports`, `ttl` seconds) that
        the gateway turns into a cookie, so it opens in a browser."""
        sandbox = await self.refresh()
        for entry in (sandbox.status.ports if sandbox.status else None) or []:
            if entry.port == port:
                if not entry.url:
                    raise NotReady(f"port {port} has no URL yet", code="no_url")
                if entry.public or not token:
                    return entry.url
                scoped = await self.token(["ports"], ttl=ttl)
                return f"{entry.url}{'&' if '?' in entry.url else '?'}token={scoped}"
        raise NotFound(f"port {port} is not in spec.network.exposedPorts of {self.name}")

    async def port_request(
        self, port: int, path: str = "/", *, method: str = "GET", content: bytes | None = None
    ) -> httpx.Response:
        """An HTTP request to an exposed port, through the gateway as this client."""
        return await self._request(
            method, f"ports/{port}/{path.lstrip('/')}", content=content, idempotent=False
        )

    async def token(self, operations: Sequence[str], *, ttl: int = 600) -> str:
        """A scoped token for this sandbox only: operations of exec, files:read,
        files:write, view, ports (each of which this client must hold)."""
        answer = await self._request(
            "POST", "tokens", json_body={"operations": list(operations), "ttlSeconds": ttl}
        )
        return str(answer.json()["token"])

    async def events(self) -> list[Event]:
        """Kubernetes Events about this sandbox, oldest first."""
        selector = f"involvedObject.kind=Sandbox,involvedObject.name={self.name}"
        items = await self.client._kube().list(
            core_path("events", self.namespace), {"fieldSelector": selector}
        )
        events = [
            Event(
                type=str(e.get("type", "")),
                reason=str(e.get("reason", "")),
                message=str(e.get("message", "")),
                time=str(
                    e.get("lastTimestamp")
                    or e.get("eventTime")
                    or e["metadata"].get("creationTimestamp")
                    or ""
                ),
                count=int(e.get("count") or 1),
                source=str(
                    (e.get("source") or {}).get("component") or e.get("reportingComponent") or ""
                ),
                raw=e,
            )
            for e in items
        ]
        return sorted(events, key=lambda e: _event_order(e.raw))

    async def destroy(self, *, wait: bool = True, timeout: float = 120.0) -> None:
        """Delete the sandbox; with `wait`, return once it is gone."""
        try:
            await self.client._kube().delete(self._path)
        except NotFound:
            return
        if wait:
            await self._wait(lambda b: b is None, timeout, "deleted")

    # -- the gateway -----------------------------------------------------------------

    async def _request(
        self,
        method: str,
        tail: str,
        *,
        json_body: Any = None,
        params: dict[str, str] | None = None,
        content: bytes | None = None,
        timeout: float | None = None,
        idempotent: bool = True,
    ) -> httpx.Response:
        for attempt in range(3):
            try:
                return await self.client.gateway.request(
                    self.namespace,
                    self.name,
                    method,
                    tail,
                    json_body=json_body,
                    params=params,
                    content=content,
                    timeout=timeout,
                    retry=idempotent,
                )
            except (NotReady, NotFound) as exc:
                if attempt == 2 or not await self._worth_waiting(exc):
                    raise
        raise AssertionError("unreachable")

    async def _websocket(self, tail: str, params: dict[str, str]) -> AsyncWebSocket:
        """A WebSocket to the agent's `tail`, waiting (as `_request` does) for a
        sandbox that is starting."""
        for attempt in range(3):
            try:
                return await self.client.gateway.websocket(
                    self.namespace, self.name, tail, params=params
                )
            except (NotReady, NotFound) as exc:
                if attempt == 2 or not await self._worth_waiting(exc):
                    raise
        raise AssertionError("unreachable")

    async def _worth_waiting(self, exc: SandboxError) -> bool:
        """Whether a refusal means "not yet" (the sandbox is starting, or the
        gateway has not seen it yet): then wait for Ready and try again."""
        if self.client.kube is None:
            return False
        if isinstance(exc, NotFound) and exc.code != "sandbox_not_found":
            return False
        ready = await self.wait_ready()
        if isinstance(exc, NotFound):
            await sleep(0.2)  # the gateway's route table follows a watch
        return ready is not None
