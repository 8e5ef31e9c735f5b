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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio

from sandbox_mcp.settings import Settings
from sandbox_mcp.tools import ToolFailure
from sandbox_sdk import AsyncSandbox, AsyncSandboxClient
from sandbox_sdk.errors import NotFound, SandboxError

SESSION_LABEL = "sandbox.dev/mcp-session"
UPLOADS = "user-uploads"
REVIEW_PATH = "/apis/authentication.k8s.io/v1/selfsubjectreviews"

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

    async def sandbox(self) -> AsyncSandbox:
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
            self.current = sandbox
        try:
            await sandbox.wait_ready()
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
        self, runtime: str | None, image: str | None, from_snapshot: str | None
    ) -> AsyncSandbox:
        async with self.lock:
            existing = self.current or await self._find()
            if existing is not None:
                raise ToolFailure(
                    "conflict",
                    f"this session has a sandbox already ({existing.name});"
                    " call sandbox_destroy first to replace it",
                )
            self.current = await self._create(runtime, image, from_snapshot)
            self.ready = False
        await self.current.wait_ready()
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
