"""Snapshots: a sandbox's `snapshot`, `fork`, `restore` and `lineage`, and the
client's `list_snapshots`, `get_snapshot`, `delete_snapshot` and
`snapshot_lineage` (methods of AsyncSandbox and AsyncSandboxClient, which
assign them; the handle is their first argument)."""

from __future__ import annotations

import builtins
import time
from typing import TYPE_CHECKING, Any

from sandbox_sdk import _lazy
from sandbox_sdk._async.kube import API_VERSION, resource_path
from sandbox_sdk._async_io import sleep
from sandbox_sdk._objects import condition, is_ready, utc_now
from sandbox_sdk.errors import Conflict, NotFound, SandboxError, Timeout

if TYPE_CHECKING:
    from sandbox_sdk._async.client import AsyncSandboxClient
    from sandbox_sdk._async.sandbox import AsyncSandbox
    from sandbox_sdk.models import resources
else:  # the generated models are built on first use: see sandbox_sdk._lazy
    resources = _lazy.module("sandbox_sdk.models.resources")

JSON = dict[str, Any]
RESTORE_ANNOTATION = "sandbox.dev/restore-requested-at"

# -- a sandbox's ----------------------------------------------------------------------


async def snapshot(
    self: AsyncSandbox,
    tag: str | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    quiesce: bool = False,
    wait: bool = True,
    timeout: float = 300.0,
) -> resources.Snapshot:
    """Capture the workspace as a Snapshot (CSI VolumeSnapshot); waits until
    it is Ready (SandboxError with the reason if it failed)."""
    kube = self.client._kube()
    spec: JSON = {"sandboxRef": {"name": self.name}, "quiesce": quiesce}
    if tag:
        spec["tag"] = tag
    if description:
        spec["description"] = description
    metadata: JSON = {"labels": {"sandbox.dev/sandbox": self.name}}
    if name:
        metadata["name"] = name
    else:
        metadata["generateName"] = f"{self.name}-"
    body = await kube.create(
        resource_path("snapshots", self.namespace),
        {"apiVersion": API_VERSION, "kind": "Snapshot", "metadata": metadata, "spec": spec},
    )
    snap_name = body["metadata"]["name"]
    deadline = time.monotonic() + timeout
    while wait:
        status = body.get("status") or {}
        if status.get("phase") == "Ready" and status.get("readyToUse"):
            break
        if status.get("phase") == "Failed":
            cond = condition(body, "Ready") or {}
            raise SandboxError(
                f"snapshot {snap_name} failed ({cond.get('reason')}): {cond.get('message')}",
                code=str(cond.get("reason") or "SnapshotFailed"),
            )
        if time.monotonic() > deadline:
            raise Timeout(f"snapshot {snap_name} not Ready in {timeout:.0f}s")
        await sleep(0.25)
        body = await kube.get(resource_path("snapshots", self.namespace, snap_name))
    return resources.Snapshot.model_validate(body)


async def fork(
    self: AsyncSandbox,
    name: str | None = None,
    *,
    snapshot: str | None = None,
    wait: bool = True,
    timeout: float = 300.0,
) -> AsyncSandbox:
    """A new sandbox like this one whose workspace starts from `snapshot`
    (default: a snapshot taken now)."""
    source = await self.refresh()
    snap = snapshot or (await self.snapshot(timeout=timeout)).metadata.name
    spec = source.spec.to_wire()
    spec.pop("paused", None)
    spec.setdefault("workspace", {})["fromSnapshot"] = snap
    return await self.client.create(
        name=name,
        namespace=self.namespace,
        spec=resources.SandboxSpec.model_validate(spec),
        wait=wait,
        timeout=timeout,
    )


async def restore(
    self: AsyncSandbox, snapshot: str, *, wait: bool = True, timeout: float = 300.0
) -> None:
    """Roll this sandbox's workspace back to `snapshot` (one of its own or any
    in the namespace): the pod stops, the workspace is replaced, it starts.

    A snapshot that does not exist, or failed, raises at once and changes
    nothing. Should it vanish before the operator acts, the operator drops the
    request (`Conflict`, code `RestoreRefused`): a snapshot made later under
    the same name never rolls the workspace back by surprise."""
    body = await self._get()
    if body is None:
        raise NotFound(f"sandbox {self.name} does not exist", status=404)
    try:
        snap = await self.client._kube().get(resource_path("snapshots", self.namespace, snapshot))
    except NotFound:
        raise NotFound(
            f"snapshot {snapshot} does not exist in namespace {self.namespace};"
            f" sandbox {self.name} was not changed",
            status=404,
            code="NotFound",
        ) from None
    if ((snap.get("status") or {}).get("phase")) == "Failed":
        why = (condition(snap, "Ready") or {}).get("message", "")
        raise Conflict(
            f"snapshot {snapshot} failed ({why}); sandbox {self.name} was not changed",
            status=409,
            code="SnapshotFailed",
        )
    # A request of its own, every time: the status then says which request an
    # answer (restored or refused) belongs to.
    request = utc_now()
    await self._patch(
        {
            "metadata": {"annotations": {RESTORE_ANNOTATION: request}},
            "spec": {"workspace": {"fromSnapshot": snapshot}},
        }
    )
    if not wait:
        return
    refusal: JSON = {}

    def answered(b: JSON | None) -> bool:
        nonlocal refusal
        if b is None:
            return True
        status = b.get("status") or {}
        refused = status.get("workspaceRestoreRefused") or {}
        if (refused.get("snapshot"), refused.get("request")) == (snapshot, request):
            refusal = refused
            return True
        cond = condition(b, "WorkspaceRestored") or {}
        return (
            is_ready(b)
            and cond.get("reason") == "Restored"
            and status.get("workspaceSnapshot") == snapshot
            and status.get("workspaceRestoreRequest") == request
        )

    if await self._wait(answered, timeout, f"restored from {snapshot}") is None:
        raise NotFound(f"sandbox {self.name} was deleted", status=404)
    if refusal:
        message = refusal.get("message") or f"the restore to {snapshot} was dropped"
        raise Conflict(message, status=409, code="RestoreRefused")


async def lineage(self: AsyncSandbox) -> list[str]:
    """The snapshots this workspace came from: the one it was restored from,
    then the one that one's source came from, and so on (nearest first)."""
    sandbox = await self.refresh()
    return list((sandbox.status.workspace_lineage if sandbox.status else None) or [])


# -- the client's: Snapshots of a namespace -------------------------------------------


async def list_snapshots(
    self: AsyncSandboxClient, *, sandbox: str | None = None, namespace: str | None = None
) -> builtins.list[resources.Snapshot]:
    """Snapshots of a namespace, optionally of one sandbox, oldest first."""
    items = await self._kube().list(resource_path("snapshots", namespace or self.namespace))
    snaps = [resources.Snapshot.model_validate(i) for i in items]
    if sandbox:
        snaps = [s for s in snaps if s.spec.sandbox_ref.name == sandbox]
    return sorted(snaps, key=lambda s: s.metadata.creation_timestamp or "")


async def get_snapshot(
    self: AsyncSandboxClient, name: str, *, namespace: str | None = None
) -> resources.Snapshot:
    body = await self._kube().get(resource_path("snapshots", namespace or self.namespace, name))
    return resources.Snapshot.model_validate(body)


async def delete_snapshot(
    self: AsyncSandboxClient, name: str, *, namespace: str | None = None
) -> None:
    """Delete a Snapshot (and its stored copy). NotFound when there is none,
    as the other deletions of a named object raise it."""
    await self._kube().delete(resource_path("snapshots", namespace or self.namespace, name))


async def snapshot_lineage(
    self: AsyncSandboxClient, name: str, *, namespace: str | None = None
) -> builtins.list[str]:
    """The Snapshot's own name, then the snapshots its source came from (nearest first)."""
    snap = await self.get_snapshot(name, namespace=namespace)
    return [name, *((snap.status.lineage if snap.status else None) or [])]
