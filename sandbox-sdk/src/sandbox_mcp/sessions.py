"""Sessions and their sandboxes.

A session's sandbox carries the label `sandbox.dev/mcp-session`, a hash of the
caller's Kubernetes identity and the session key: the same caller with the same
key finds it again (files and installed packages intact, resumed if paused),
while another caller who learns the key hashes to another label. Beyond that,
every call is made with the caller's own credentials, so RBAC decides what they
reach; the server holds no rights of its own.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio

from sandbox_mcp.settings import Settings
from sandbox_mcp.tools import Progress, ToolFailure
from sandbox_sdk import AsyncSandbox, AsyncSandboxClient
from sandbox_sdk.errors import NotFound, SandboxError

SESSION_LABEL = "sandbox.dev/mcp-session"
UPLOADS = "user-uploads"
REVIEW_PATH = "/apis/authentication.k8s.io/v1/selfsubjectreviews"
# While a call waits for the sandbox: its Ready condition is looked at this
# often, and reported when it changes or after REPEAT seconds without news.
LOOK_SECONDS = 1.0
REPEAT_SECONDS = 10.0
END_LOOK_SECONDS = 5.0  # at a session's end, for whether commands still run

log = logging.getLogger("sandbox_mcp")


def session_label(identity: str, key: str) -> str:
    return hashlib.sha256(f"{identity}\0{key}".encode()).hexdigest()[:40]


async def identity_of(client: AsyncSandboxClient) -> str:
    """Who the client's credentials are (SelfSubjectReview, allowed to everyone
    authenticated). Unauthorized when the API server does not accept them."""
    review = await client._kube().create(
        REVIEW_PATH,
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
    )
    return str(((review.get("status") or {}).get("userInfo") or {}).get("username") or "")


@dataclass
class Caller:
    """Whose credentials a session's calls use."""

    client: AsyncSandboxClient
    identity: str


class Session:
    """One session's sandbox: found by label or created on first use."""

    def __init__(
        self, key: str, caller: Caller, settings: Settings, uploads: Sequence[str] = ()
    ) -> None:
        self.key = key
        self.caller = caller
        self.settings = settings
        self.label = session_label(caller.identity, key)
        self.uploads = list(uploads)
        self.current: AsyncSandbox | None = None
        # `current` was seen Ready, so calls go straight to it; a refusal that
        # says otherwise (paused, not ready, gone) clears it: `stale()`.
        self.ready = False
        self.lock = anyio.Lock()

    @property
    def client(self) -> AsyncSandboxClient:
        return self.caller.client

    async def _find(self) -> AsyncSandbox | None:
        found = [
            s
            for s in await self.client.list(labels={SESSION_LABEL: self.label})
            if not s.metadata.deletion_timestamp
        ]
        if not found:
            return None
        sandbox = found[0]
        name = sandbox.metadata.name
        assert name is not None
        return AsyncSandbox(self.client, name, self.client.namespace, sandbox.to_wire())

    def stale(self) -> None:
        """The sandbox refused a call as paused, not ready or missing: look again."""
        self.ready = False

    def _bounded(self, sandbox: AsyncSandbox) -> AsyncSandbox:
        # Every wait for Ready, the SDK's own retries of a call included, is
        # bounded by the server's setting rather than the SDK's default.
        sandbox.ready_timeout = self.settings.ready_timeout
        return sandbox

    async def _wait_ready(self, sandbox: AsyncSandbox, progress: Progress | None) -> None:
        """Until Ready (NotReady after `ready_timeout`, with the Sandbox's reason);
        with `progress`, the Ready condition's reason and message are reported
        while it is not, so a client sees an unschedulable pod at once."""
        if progress is None:
            await sandbox.wait_ready()
            return

        async def report() -> None:
            began = last = time.monotonic()
            said = ""
            while True:
                await anyio.sleep(LOOK_SECONDS)  # a sandbox ready by then: nothing to say
                try:
                    body = await sandbox.client.get(sandbox.name, namespace=sandbox.namespace)
                except SandboxError:
                    continue  # the wait itself says what is wrong, if anything
                conditions = (body.status.conditions if body.status else None) or []
                ready = next((c for c in conditions if c.type == "Ready"), None)
                why = f"{ready.reason}: {ready.message}" if ready else "no status yet"
                now = time.monotonic()
                if why != said or now - last >= REPEAT_SECONDS:
                    await progress(
                        now - last,
                        f"waiting for sandbox {sandbox.name} to become ready"
                        f" ({now - began:.0f}s of {self.settings.ready_timeout:.0f}s): {why}",
                    )
                    said, last = why, now

        failed: SandboxError | None = None
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(report)
            try:
                await sandbox.wait_ready()
            except SandboxError as exc:
                failed = exc  # raised below, as itself rather than in a group
            finally:
                tasks.cancel_scope.cancel()
        if failed is not None:
            raise failed

    async def sandbox(self, progress: Progress | None = None) -> AsyncSandbox:
        """The session's sandbox, Ready: found (and resumed when paused) or created."""
        current = self.current
        if self.ready and current is not None and current.client is self.client:
            return current
        async with self.lock:
            sandbox = self.current or await self._find()
            if sandbox is not None and sandbox.client is not self.client:
                sandbox = AsyncSandbox(self.client, sandbox.name, sandbox.namespace)
            if sandbox is None:
                sandbox = await self._create()
            else:
                body = await sandbox.refresh()
                if body.metadata.deletion_timestamp:
                    sandbox = await self._create()
                elif body.spec.paused or (body.status and body.status.phase == "Paused"):
                    log.info("session %s: resuming %s", self.label[:12], sandbox.name)
                    await sandbox.resume(wait=False)
            self.current = self._bounded(sandbox)
        try:
            await self._wait_ready(sandbox, progress)
        except NotFound:
            self.current = None  # deleted meanwhile: the next call makes a new one
            raise
        self.ready = True
        if self.uploads:
            await self._upload()
        return sandbox

    async def _create(
        self, runtime: str | None = None, image: str | None = None, from_snapshot: str | None = None
    ) -> AsyncSandbox:
        s = self.settings
        # A pool's members are of its template: runtime and image only when asked for.
        pooled = s.pool is not None and not (runtime or image)
        sandbox = await self.client.create(
            runtime or (None if image or pooled else s.runtime),
            image=image or (None if runtime or pooled else s.image),
            template=None if pooled else s.template,
            pool=s.pool if pooled else None,
            from_snapshot=from_snapshot or s.from_snapshot,
            idle_timeout=s.idle_timeout,
            labels={SESSION_LABEL: self.label, "sandbox.dev/created-by": "sandbox-mcp"},
            wait=False,
        )
        log.info("session %s: created %s", self.label[:12], sandbox.name)
        return sandbox

    async def _upload(self) -> None:
        assert self.current is not None
        files = {
            f"{UPLOADS}/{Path(p).name}": await anyio.Path(p).read_bytes() for p in self.uploads
        }
        await self.current.files.write_many(files)
        self.uploads = []

    async def upload(self, name: str, content: bytes) -> str:
        """A file from the host, into ./user-uploads/ of the workspace."""
        sandbox = await self.sandbox()
        path = f"{UPLOADS}/{Path(name).name}"
        await sandbox.files.write(path, content)
        return path

    async def create(
        self,
        runtime: str | None,
        image: str | None,
        from_snapshot: str | None,
        progress: Progress | None = None,
    ) -> AsyncSandbox:
        async with self.lock:
            existing = self.current or await self._find()
            if existing is not None:
                raise ToolFailure(
                    "conflict",
                    f"this session has a sandbox already ({existing.name});"
                    " call sandbox_destroy first to replace it",
                )
            self.current = self._bounded(await self._create(runtime, image, from_snapshot))
            self.ready = False
        await self._wait_ready(self.current, progress)
        self.ready = True
        return self.current

    async def destroy(self) -> str | None:
        async with self.lock:
            sandbox = self.current or await self._find()
            self.current, self.ready = None, False
            if sandbox is None:
                return None
            await sandbox.destroy(wait=True)
            return sandbox.name

    async def _running(self, sandbox: AsyncSandbox) -> int:
        """How many commands run in the sandbox (0 when that cannot be told soon)."""
        with anyio.move_on_after(END_LOOK_SECONDS):
            try:
                return len(await sandbox.jobs(status="running"))
            except SandboxError:
                pass
        return 0

    async def end(self) -> None:
        """The session is over: pause or destroy its sandbox, as configured.
        Idle sandboxes of sessions that never end fall to their idle policy."""
        sandbox = self.current
        if sandbox is None:
            return
        self.ready = False
        try:
            if self.settings.on_end == "destroy":
                await sandbox.destroy(wait=False)
            elif running := await self._running(sandbox):
                # A pause would kill them. The end of a session is also a
                # restart of its server, after which the same key re-attaches
                # to them (sandbox_list_commands); the sandbox's idle policy
                # pauses it once they are done (a running command is activity).
                log.info(
                    "session %s: %s left running for its %d command(s)",
                    self.label[:12],
                    sandbox.name,
                    running,
                )
                return
            else:
                await sandbox.pause(wait=False)
            log.info("session %s: %s %s", self.label[:12], self.settings.on_end, sandbox.name)
        except SandboxError as exc:
            log.warning(
                "session %s: %s of %s failed: %s",
                self.label[:12],
                self.settings.on_end,
                sandbox.name,
                exc,
            )
