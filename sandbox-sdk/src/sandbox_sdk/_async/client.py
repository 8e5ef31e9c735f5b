"""AsyncSandboxClient and its handles: lifecycle through the custom resources,
commands and files through the gateway."""

from __future__ import annotations

import base64
import builtins
import collections
import contextlib
import io
import json
import math
import os
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

import httpx
import yaml

from sandbox_sdk import _lazy
from sandbox_sdk import config as cluster_config
from sandbox_sdk._async.code import AsyncContexts, run_code
from sandbox_sdk._async.gateway import AsyncGateway
from sandbox_sdk._async.kube import API_VERSION, AsyncKube, core_path, resource_path
from sandbox_sdk._async_io import sleep
from sandbox_sdk._wire import MAX_TIMEOUT, FileContent, event_of, exec_body, timeout_seconds
from sandbox_sdk.errors import (
    CommandFailed,
    CommandLost,
    CommandTimeout,
    ConfigError,
    Conflict,
    Gone,
    Invalid,
    NotFound,
    NotReady,
    SandboxError,
    ServerError,
    Timeout,
    from_response,
)
from sandbox_sdk.types import (
    CommandResult,
    Event,
    OutputEvent,
    Progress,
    Runtime,
    Sink,
    Template,
    write_sink,
)

if TYPE_CHECKING:
    from sandbox_sdk._async.websocket import AsyncWebSocket
    from sandbox_sdk.models import agent, resources
else:  # the generated models are built on first use: see sandbox_sdk._lazy
    agent = _lazy.module("sandbox_sdk.models.agent")
    resources = _lazy.module("sandbox_sdk.models.resources")

JSON = dict[str, Any]
DEFAULT_TIMEOUT = 180.0  # a command's, unless it says otherwise
MAX_JOB_TIMEOUT = 3600.0
READY_TIMEOUT = 180.0
RESUME_ANNOTATION = "sandbox.dev/resume-requested-at"
RESTORE_ANNOTATION = "sandbox.dev/restore-requested-at"
SDK_LABEL = "sandbox.dev/created-by"
# Ready=False reasons that no amount of waiting fixes (PodFailed is not one: the
# operator replaces a failed pod on the same workspace).
FATAL_REASONS = {"InvalidSpec", "RuntimeMissingPython", "ImagePullFailed"}
CHUNK = 1 << 16
# A watch's stream carries a keepalive line every 15 s while nothing changes:
# this long without a line, the connection is taken for dead.
WATCH_READ_TIMEOUT = 120.0


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _condition(body: JSON | None, kind: str) -> JSON | None:
    for cond in ((body or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            found: JSON = cond
            return found
    return None


def _observed(body: JSON | None) -> bool:
    """The status was computed from the current spec."""
    if body is None:
        return False
    status = body.get("status") or {}
    return int(status.get("observedGeneration") or 0) >= int(body["metadata"].get("generation", 0))


def _is_ready(body: JSON | None) -> bool:
    cond = _condition(body, "Ready")
    return bool(cond and cond.get("status") == "True" and _observed(body))


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


def _duration(seconds: float) -> str:
    return f"{max(1, math.ceil(seconds))}s"


def _env_list(env: Mapping[str, str]) -> list[JSON]:
    return [{"name": k, "value": v} for k, v in env.items()]


class AsyncSandboxClient:
    """Creates, finds and runs sandboxes.

    Connection (see `sandbox_sdk.config` and `sandbox_sdk._async.gateway`):
    with no arguments, the kubeconfig kubectl would use, or inside a pod its
    ServiceAccount; the gateway is found by its Service. `gateway_url` plus
    `token` (a scoped token) suffices for commands and files of one sandbox.

    Args:
        namespace: default namespace (else the kubeconfig context's, or the pod's).
        kubeconfig, context: a kubeconfig file and context instead of kubectl's defaults.
        api_server, token, ca_file: an explicit API server and bearer token.
        gateway_url: the gateway's URL (else found through its Service).
        gateway_token: the token for the gateway (else the API server's token, or a
            ServiceAccount's for certificate-only kubeconfigs).
        gateway: "auto" (DNS in a pod, API server proxy outside), "dns", "proxy" or
            "port-forward".
        service_account: the ServiceAccount whose token the gateway gets when the
            kubeconfig has only a client certificate.
        timeout: per-request timeout of calls that are not commands.
    """

    def __init__(
        self,
        namespace: str | None = None,
        *,
        kubeconfig: str | os.PathLike[str] | None = None,
        context: str | None = None,
        api_server: str | None = None,
        token: str | None = None,
        ca_file: str | None = None,
        gateway_url: str | None = None,
        gateway_token: str | None = None,
        gateway: str | None = None,
        service_account: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.config = cluster_config.discover(
            namespace=namespace,
            kubeconfig=kubeconfig,
            context=context,
            api_server=api_server,
            token=token,
            ca_file=ca_file,
        )
        self.namespace = (
            namespace
            or (self.config.namespace if self.config else None)
            or os.environ.get("SANDBOX_NAMESPACE")
            or "default"
        )
        self.kube = AsyncKube(self.config, timeout) if self.config is not None else None
        kubectl_args = [f"--kubeconfig={kubeconfig}"] if kubeconfig else []
        if context:
            kubectl_args.append(f"--context={context}")
        self.gateway = AsyncGateway(
            self.kube,
            url=gateway_url,
            token=gateway_token or (token if self.kube is None else None),
            mode=gateway,
            service_account=service_account,
            timeout=timeout,
            kubeconfig_args=kubectl_args,
        )

    async def __aenter__(self) -> AsyncSandboxClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close connections (and a port-forward, if one was started)."""
        await self.gateway.aclose()
        if self.kube is not None:
            await self.kube.aclose()

    def _kube(self) -> AsyncKube:
        if self.kube is None:
            raise ConfigError(
                "no Kubernetes API access (no kubeconfig, not in a pod): lifecycle operations"
                " need one; a gateway URL and token serve commands and files only"
            )
        return self.kube

    async def describe(self) -> str:
        """Where this client talks to: the API server and the gateway route."""
        location = await self.gateway.locate()
        cluster = self.config.describe() if self.config else "no API server"
        return f"API server: {cluster}\ngateway: {location.describe}"

    # -- sandboxes ------------------------------------------------------------------

    async def create(
        self,
        runtime: str | None = None,
        *,
        template: str | None = None,
        cluster_template: str | None = None,
        pool: str | None = None,
        name: str | None = None,
        namespace: str | None = None,
        image: str | None = None,
        env: Mapping[str, str] | None = None,
        files: Mapping[str, str] | None = None,
        cpu: str | None = None,
        memory: str | None = None,
        profile: str | None = None,
        workspace_size: str | None = None,
        ephemeral: bool = False,
        from_snapshot: str | None = None,
        ports: Sequence[int | resources.ExposedPort] = (),
        egress: str | None = None,
        idle_timeout: str | None = None,
        on_idle: str | None = None,
        max_lifetime: str | None = None,
        labels: Mapping[str, str] | None = None,
        spec: resources.SandboxSpec | None = None,
        wait: bool = True,
        timeout: float = READY_TIMEOUT,
    ) -> AsyncSandbox:
        """Create a Sandbox and return its handle (a context manager that destroys it).

        `runtime` is a catalog name (`list_runtimes()`), or pass `image`; or start
        from a template (`list_templates()`): `template` names a SandboxTemplate of
        the namespace, `cluster_template` a ClusterSandboxTemplate; the other
        arguments override the template's values. `pool` names a SandboxPool of
        the namespace: the sandbox takes one of its warm members and is Ready in
        milliseconds (`status.pool` says whether it was served by the pool or
        started cold); `env` and `files` are applied to the member before Ready.
        `files` maps paths in the workspace to text written there before the
        sandbox is Ready (`spec.files`). `profile` names the operator's resource
        profile (`standard`, `dense`): what the sandbox requests of its node. `name`
        defaults to a generated one. With `wait=False` it returns as soon as the
        API server accepted the object: the pod starts meanwhile, and the first
        command waits for it (warm a sandbox without blocking). `spec` gives any
        other field of the Sandbox spec; the keyword arguments win over it.
        """
        kube = self._kube()
        ns = namespace or self.namespace
        body_spec: JSON = spec.to_wire() if spec is not None else {}
        if sum(1 for ref in (template, cluster_template, pool) if ref) > 1:
            raise ValueError("give one of template, cluster_template or pool")
        if pool:
            body_spec["poolRef"] = {"name": pool}
        if template:
            body_spec["templateRef"] = {"name": template}
        if cluster_template:
            body_spec["templateRef"] = {"kind": "ClusterSandboxTemplate", "name": cluster_template}
        if runtime:
            body_spec["runtime"] = runtime
        if image:
            body_spec["image"] = image
        if env:
            body_spec["env"] = _env_list(env)
        if files:
            body_spec["files"] = [{"path": path, "content": text} for path, text in files.items()]
        sizing = {k: v for k, v in (("cpu", cpu), ("memory", memory), ("profile", profile)) if v}
        if sizing:
            body_spec["resources"] = {**body_spec.get("resources", {}), **sizing}
        workspace = dict(body_spec.get("workspace") or {})
        if workspace_size:
            workspace["size"] = workspace_size
        if ephemeral:
            workspace["ephemeral"] = True
        if from_snapshot:
            workspace["fromSnapshot"] = from_snapshot
        if workspace:
            body_spec["workspace"] = workspace
        network = dict(body_spec.get("network") or {})
        if ports:
            network["exposedPorts"] = [
                p.to_wire()
                if isinstance(p, resources.ExposedPort)
                else {"name": f"p{p}", "port": p}
                for p in ports
            ]
        if egress:
            network["egress"] = egress
        if network:
            body_spec["network"] = network
        lifecycle = dict(body_spec.get("lifecycle") or {})
        for key, value in (
            ("idleTimeout", idle_timeout),
            ("onIdle", on_idle),
            ("maxLifetime", max_lifetime),
        ):
            if value:
                lifecycle[key] = value
        if lifecycle:
            body_spec["lifecycle"] = lifecycle
        metadata: JSON = {"labels": {SDK_LABEL: "sandbox-sdk", **(labels or {})}}
        if name:
            metadata["name"] = name
        else:
            metadata["generateName"] = "sandbox-"
        created = await kube.create(
            resource_path("sandboxes", ns),
            {"apiVersion": API_VERSION, "kind": "Sandbox", "metadata": metadata, "spec": body_spec},
        )
        sandbox = AsyncSandbox(self, created["metadata"]["name"], ns, created)
        if wait:
            try:
                await sandbox.wait_ready(timeout)
            except BaseException:
                await sandbox.destroy(wait=False)
                raise
        return sandbox

    async def connect(
        self, name: str, *, namespace: str | None = None, wait: bool = False
    ) -> AsyncSandbox:
        """A handle on an existing sandbox (another process's, an earlier turn's).

        Reads the Sandbox first (NotFound if there is none) when the client can
        reach the API server; with only a gateway URL and token, it cannot check."""
        ns = namespace or self.namespace
        body = None
        if self.kube is not None:
            body = await self.kube.get(resource_path("sandboxes", ns, name))
        sandbox = AsyncSandbox(self, name, ns, body)
        if wait:
            await sandbox.wait_ready()
        return sandbox

    async def get(self, name: str, *, namespace: str | None = None) -> resources.Sandbox:
        """The Sandbox object (spec and status)."""
        body = await self._kube().get(resource_path("sandboxes", namespace or self.namespace, name))
        return resources.Sandbox.model_validate(body)

    async def list(
        self, *, namespace: str | None = None, labels: Mapping[str, str] | None = None
    ) -> builtins.list[resources.Sandbox]:
        """Sandboxes of a namespace (`namespace="*"`: all namespaces), by label."""
        ns = namespace or self.namespace
        path = f"/apis/{API_VERSION}/sandboxes" if ns == "*" else resource_path("sandboxes", ns)
        params = (
            {"labelSelector": ",".join(f"{k}={v}" for k, v in labels.items())} if labels else {}
        )
        items = await self._kube().list(path, params)
        return [resources.Sandbox.model_validate(item) for item in items]

    async def list_runtimes(self) -> builtins.list[Runtime]:
        """The operator's runtime catalog (its settings ConfigMap, which the
        reader must be allowed to get in the operator's namespace)."""
        kube = self._kube()
        ns, _, _ = await self.gateway._service()
        release = self.gateway.release or "sandbox-operator"
        cm = await kube.get(core_path("configmaps", ns, f"{release}-settings"))
        settings = yaml.safe_load((cm.get("data") or {}).get("settings.yaml") or "{}") or {}
        default = settings.get("default_runtime")
        return [
            Runtime(
                name=name,
                image=str(entry.get("image", "")),
                description=str(entry.get("description", "")),
                default=name == default,
            )
            for name, entry in sorted((settings.get("runtimes") or {}).items())
        ]

    async def list_templates(self, *, namespace: str | None = None) -> builtins.list[Template]:
        """The templates a sandbox can start from: the namespace's SandboxTemplates,
        then the ClusterSandboxTemplates (the runtime catalog among them)."""
        kube = self._kube()
        ns = namespace or self.namespace
        found: builtins.list[Template] = []
        for kind, path in (
            ("SandboxTemplate", resource_path("sandboxtemplates", ns)),
            ("ClusterSandboxTemplate", f"/apis/{API_VERSION}/clustersandboxtemplates"),
        ):
            for item in sorted(await kube.list(path, {}), key=lambda i: i["metadata"]["name"]):
                spec, status = item.get("spec") or {}, item.get("status") or {}
                sandbox = spec.get("sandbox") or {}
                ready = _condition(item, "Ready")
                found.append(
                    Template(
                        name=item["metadata"]["name"],
                        kind=kind,
                        description=str(spec.get("description") or ""),
                        runtime=sandbox.get("runtime"),
                        image=sandbox.get("image"),
                        # Without setup steps nothing is built: ready as soon as it exists.
                        ready=ready is None or ready.get("status") == "True",
                        base_snapshot=status.get("baseSnapshot"),
                    )
                )
        return found

    async def run(
        self,
        command: str | Sequence[str],
        *,
        runtime: str | None = None,
        image: str | None = None,
        files: Mapping[str, FileContent] | None = None,
        env: Mapping[str, str] | None = None,
        cpu: str | None = None,
        memory: str | None = None,
        cwd: str | None = None,
        stdin: FileContent | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        stdout: Sink | None = None,
        stderr: Sink | None = None,
        namespace: str | None = None,
        ready_timeout: float = READY_TIMEOUT,
        on_waiting: Callable[[str, str], object] | None = None,
    ) -> CommandResult:
        """One-shot: a disposable sandbox (ephemeral workspace) runs `command` and
        is deleted, whatever happens. Output streams to `stdout`/`stderr`
        (callbacks or text files) while it runs. The sandbox also carries a
        `maxLifetime`, so the operator removes it even if this process dies.
        `on_waiting(reason, message)`: told what the start waits on, each time it
        changes (see `Sandbox.wait_ready`)."""
        timeout_seconds(timeout, MAX_TIMEOUT)
        sandbox = await self.create(
            runtime,
            image=image,
            env=env,
            cpu=cpu,
            memory=memory,
            ephemeral=True,
            max_lifetime=_duration(ready_timeout + timeout + 120),
            labels={"sandbox.dev/one-shot": "true"},
            namespace=namespace,
            wait=False,
        )
        try:
            await sandbox.wait_ready(ready_timeout, on_waiting=on_waiting)
            if files:
                await sandbox.files.write_many(files)
            return await sandbox.execute(
                command, cwd=cwd, stdin=stdin, timeout=timeout, stdout=stdout, stderr=stderr
            )
        finally:
            await sandbox.destroy(wait=False)

    # -- E2B API keys ----------------------------------------------------------------

    async def create_e2b_key(
        self,
        service_account: str,
        *,
        namespace: str | None = None,
        expiration_seconds: int | None = None,
    ) -> dict[str, Any]:
        """An API key in E2B's shape (`e2b_...`, for E2B's SDKs as `E2B_API_KEY`)
        that acts as ServiceAccount `service_account` of the namespace. Needs RBAC's
        `create serviceaccounts/token` on it (the `edit` role has it). The answer
        holds the key, shown this once (`key`), and its `id` for revoking it."""
        body: dict[str, Any] = {"serviceAccount": service_account}
        if expiration_seconds is not None:
            body["expirationSeconds"] = expiration_seconds
        ns = namespace or self.namespace
        answer = await self.gateway.call(ns, "POST", f"/v1/namespaces/{ns}/e2bkeys", json_body=body)
        found: dict[str, Any] = answer.json()
        return found

    async def list_e2b_keys(self, *, namespace: str | None = None) -> builtins.list[dict[str, Any]]:
        """The E2B API keys of the namespace's ServiceAccounts this client may mint
        for (id, serviceAccount, createdAt, createdBy, expiresAt; never the key)."""
        ns = namespace or self.namespace
        answer = await self.gateway.call(ns, "GET", f"/v1/namespaces/{ns}/e2bkeys")
        items: builtins.list[dict[str, Any]] = answer.json()["items"]
        return items

    async def revoke_e2b_key(self, key_id: str, *, namespace: str | None = None) -> None:
        """Revoke an E2B API key by its id (NotFound when there is none this client
        may revoke)."""
        ns = namespace or self.namespace
        await self.gateway.call(ns, "DELETE", f"/v1/namespaces/{ns}/e2bkeys/{key_id}")

    # -- snapshots and executions ----------------------------------------------------

    async def list_snapshots(
        self, *, sandbox: str | None = None, namespace: str | None = None
    ) -> builtins.list[resources.Snapshot]:
        """Snapshots of a namespace, optionally of one sandbox, oldest first."""
        items = await self._kube().list(resource_path("snapshots", namespace or self.namespace))
        snaps = [resources.Snapshot.model_validate(i) for i in items]
        if sandbox:
            snaps = [s for s in snaps if s.spec.sandbox_ref.name == sandbox]
        return sorted(snaps, key=lambda s: s.metadata.creation_timestamp or "")

    async def get_snapshot(self, name: str, *, namespace: str | None = None) -> resources.Snapshot:
        body = await self._kube().get(resource_path("snapshots", namespace or self.namespace, name))
        return resources.Snapshot.model_validate(body)

    async def delete_snapshot(self, name: str, *, namespace: str | None = None) -> None:
        """Delete a Snapshot (and its stored copy). NotFound when there is none,
        as the other deletions of a named object raise it."""
        await self._kube().delete(resource_path("snapshots", namespace or self.namespace, name))

    async def snapshot_lineage(
        self, name: str, *, namespace: str | None = None
    ) -> builtins.list[str]:
        """The Snapshot's own name, then the snapshots its source came from (nearest first)."""
        snap = await self.get_snapshot(name, namespace=namespace)
        return [name, *((snap.status.lineage if snap.status else None) or [])]

    async def get_execution(
        self, name: str, *, namespace: str | None = None
    ) -> resources.Execution:
        """An Execution resource (a command run as an object)."""
        body = await self._kube().get(
            resource_path("executions", namespace or self.namespace, name)
        )
        return resources.Execution.model_validate(body)

    async def execution_output(
        self, name: str, *, namespace: str | None = None, follow: bool = False
    ) -> AsyncIterator[OutputEvent]:
        """An Execution's full output, read from its sandbox's agent by cursor
        (`follow`: until it ends). Falls back to the tails in its status when
        the sandbox is gone (a finished one-shot)."""
        ns = namespace or self.namespace
        while True:
            execution = await self.get_execution(name, namespace=ns)
            status = execution.status
            if status is not None and status.agent_execution_id and status.sandbox:
                break
            if not follow:
                return
            await sleep(0.5)
        assert status is not None
        assert status.sandbox
        assert status.agent_execution_id
        job = AsyncJob(AsyncSandbox(self, status.sandbox, ns), status.agent_execution_id)
        try:
            cursor = 0
            while True:
                page = await job.output(cursor, wait=5.0 if follow else 0.0)
                for chunk in page.chunks:
                    yield OutputEvent(
                        "stderr" if chunk.stream == "stderr" else "stdout",
                        chunk.data or "",
                        chunk.cursor,
                    )
                cursor = page.cursor
                if page.finished or (not follow and not page.chunks):
                    return
        except (NotFound, NotReady, Gone, ServerError):
            if cursor:
                raise
            if status.stdout:
                yield OutputEvent("stdout", status.stdout)
            if status.stderr:
                yield OutputEvent("stderr", status.stderr)


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
            cond = _condition(body, "Ready")
            if on_waiting is not None and cond and cond.get("status") != "True":
                now = (str(cond.get("reason") or ""), str(cond.get("message") or ""))
                if not told or told[-1] != now:
                    told.append(now)
                    on_waiting(*now)
            if cond and _observed(body) and cond.get("reason") in FATAL_REASONS:
                fatal.append(cond)
                return True
            return _is_ready(body)

        try:
            body = await self._wait(done, timeout or self.ready_timeout, "Ready")
        except Timeout as exc:
            cond = _condition(self._body, "Ready") or {}
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
                cond = _condition(b, "Paused")
                return bool(cond and cond.get("status") == "True" and _observed(b))

            await self._wait(stopped, timeout, "Paused")

    async def resume(self, *, wait: bool = True, timeout: float | None = None) -> None:
        """Start the pod again on the same workspace: `spec.paused: false`, and
        the resume annotation for a sandbox its idle policy paused."""
        patch: JSON = {"spec": {"paused": False}}
        body = self._body or await self._get()
        if body is not None and (body.get("status") or {}).get("idlePausedAt"):
            patch["metadata"] = {"annotations": {RESUME_ANNOTATION: _now()}}
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

    async def snapshot(
        self,
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
                cond = _condition(body, "Ready") or {}
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
        self,
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

    async def restore(self, snapshot: str, *, wait: bool = True, timeout: float = 300.0) -> None:
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
            snap = await self.client._kube().get(
                resource_path("snapshots", self.namespace, snapshot)
            )
        except NotFound:
            raise NotFound(
                f"snapshot {snapshot} does not exist in namespace {self.namespace};"
                f" sandbox {self.name} was not changed",
                status=404,
                code="NotFound",
            ) from None
        if ((snap.get("status") or {}).get("phase")) == "Failed":
            why = (_condition(snap, "Ready") or {}).get("message", "")
            raise Conflict(
                f"snapshot {snapshot} failed ({why}); sandbox {self.name} was not changed",
                status=409,
                code="SnapshotFailed",
            )
        # A request of its own, every time: the status then says which request an
        # answer (restored or refused) belongs to.
        request = _now()
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
            cond = _condition(b, "WorkspaceRestored") or {}
            return (
                _is_ready(b)
                and cond.get("reason") == "Restored"
                and status.get("workspaceSnapshot") == snapshot
                and status.get("workspaceRestoreRequest") == request
            )

        if await self._wait(answered, timeout, f"restored from {snapshot}") is None:
            raise NotFound(f"sandbox {self.name} was deleted", status=404)
        if refusal:
            message = refusal.get("message") or f"the restore to {snapshot} was dropped"
            raise Conflict(message, status=409, code="RestoreRefused")

    async def lineage(self) -> list[str]:
        """The snapshots this workspace came from: the one it was restored from,
        then the one that one's source came from, and so on (nearest first)."""
        sandbox = await self.refresh()
        return list((sandbox.status.workspace_lineage if sandbox.status else None) or [])

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

    async def execute(
        self,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: FileContent | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        stdout: Sink | None = None,
        stderr: Sink | None = None,
        combined_output: bool = False,
        check: bool = False,
    ) -> CommandResult:
        """Run a command and return its result.

        `command`: a shell script (str) or an argv list. `timeout` in seconds (3
        minutes by default, at most 30): past it the command is stopped and
        CommandTimeout (with the output so far in `.result`) is raised; the
        sandbox stays usable. With `stdout`/`stderr` (callbacks or text files)
        the output is streamed to them while it runs. `check`: CommandFailed
        unless it exits 0. Retries never run the command twice (idempotency key).
        """
        seconds = timeout_seconds(timeout, MAX_TIMEOUT)
        body = exec_body(
            command,
            env=env,
            cwd=cwd,
            stdin=stdin,
            timeout=seconds,
            combined_output=combined_output,
        )
        if stdout is None and stderr is None:
            response = await self._request(
                "POST", "executions", json_body=body, timeout=seconds + 60
            )
            result = CommandResult.of(agent.Execution.model_validate(response.json()))
        else:
            result = await self._streamed(body, seconds, stdout, stderr)
        return _checked(result, check)

    async def _streamed(
        self, body: JSON, seconds: int, stdout: Sink | None, stderr: Sink | None
    ) -> CommandResult:
        result: CommandResult | None = None
        async for event in self._events("POST", "executions/stream", body, seconds + 60):
            if event.kind == "stdout":
                write_sink(stdout, event.data)
            elif event.kind == "stderr":
                write_sink(stderr, event.data)
            else:
                result = event.result
        if result is None:
            raise ServerError("the output stream ended before the command did")
        return result

    # The sandbox is its first argument: defined with the contexts (code.py).
    run_code = run_code

    async def stream(
        self,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: FileContent | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        combined_output: bool = False,
    ) -> AsyncIterator[OutputEvent]:
        """Run a command and iterate over its output as it comes: `stdout` and
        `stderr` events, then one `exit` event whose `result` is the outcome."""
        seconds = timeout_seconds(timeout, MAX_TIMEOUT)
        body = exec_body(
            command,
            env=env,
            cwd=cwd,
            stdin=stdin,
            timeout=seconds,
            combined_output=combined_output,
        )
        async for event in self._events("POST", "executions/stream", body, seconds + 60):
            yield event

    async def _events(
        self, method: str, tail: str, body: JSON | None, read_timeout: float | None
    ) -> AsyncIterator[OutputEvent]:
        """The agent's event stream; after a broken connection it reattaches to the
        same execution from the last cursor (the command does not run again)."""
        execution_id: str | None = None
        cursor = 0
        # The finished event's record carries no output (it was streamed): the
        # result gets the streamed text back, its tail like the captured form.
        seen = {"stdout": _Tail(), "stderr": _Tail()}
        for attempt in range(4):
            if execution_id is None:
                call_method, call_tail, params = method, tail, None
            else:
                call_method, call_tail = "GET", f"executions/{execution_id}/stream"
                params = {"cursor": str(cursor)}
            try:
                async with self.client.gateway.stream(
                    self.namespace,
                    self.name,
                    call_method,
                    call_tail,
                    json_body=body if execution_id is None else None,
                    params=params,
                    read_timeout=read_timeout,
                ) as response:
                    execution_id = response.headers.get("X-Execution-Id") or execution_id
                    async for line in response.aiter_lines():
                        if not line:
                            continue
                        kind, event, named = event_of(json.loads(line))
                        if named is not None:
                            execution_id = named
                        if event is not None:
                            if event.cursor is not None:
                                cursor = event.cursor
                            if event.kind in seen:
                                seen[event.kind].add(event.data)
                            elif event.result is not None:
                                event = _with_output(event, seen)
                            yield event
                        if kind == "finished":
                            return
            except (NotReady, NotFound) as exc:
                if execution_id is not None or attempt == 3 or not await self._worth_waiting(exc):
                    raise
            except Gone:
                if execution_id is None:
                    raise
                # The output from the cursor on is gone (pruned under the log
                # cap, or held in memory by an agent that restarted since); the
                # record still tells how the command ended.
                result = await AsyncJob(self, execution_id).wait()
                yield _with_output(OutputEvent("exit", result=result), seen)
                return
            except ServerError:
                if attempt == 3 or (execution_id is None and not _idempotent(body)):
                    raise
                # Before the first header the execution's id is unknown, but the
                # request's idempotency key names it: the same POST again finds
                # the command (a restarted agent answers with its record) and
                # never starts it twice.
                await sleep(0.5 * 2**attempt)
        raise ServerError("the output stream broke off repeatedly")

    async def start(
        self,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: FileContent | None = None,
        stdin_open: bool = False,
        timeout: float = 1800.0,
        combined_output: bool = False,
    ) -> AsyncJob:
        """Start a background job (a server, a long build); returns at once.
        `stdin_open`: keep its stdin open for `job.write()`."""
        seconds = timeout_seconds(timeout, MAX_JOB_TIMEOUT)
        body = exec_body(
            command,
            env=env,
            cwd=cwd,
            stdin=stdin,
            timeout=seconds,
            combined_output=combined_output,
            background=True,
            stdin_open=stdin_open,
        )
        response = await self._request("POST", "executions", json_body=body)
        return AsyncJob(self, str(response.json()["id"]))

    async def jobs(self, *, status: str | None = None) -> list[agent.Execution]:
        """The commands the agent remembers (running and finished), without output."""
        params = {"status": status} if status else None
        answer = await self._request("GET", "executions", params=params)
        return agent.ExecutionList.model_validate(answer.json()).executions

    def job(self, job_id: str) -> AsyncJob:
        """A handle on a job by id (from `start()` or `jobs()`)."""
        return AsyncJob(self, job_id)


def _idempotent(body: JSON | None) -> bool:
    return body is not None and "idempotencyKey" in body


TAIL_CHARACTERS = 4 << 20  # the agent's own capture bound, per stream


class _Tail:
    """The last TAIL_CHARACTERS of a streamed output, without rejoining it per chunk."""

    def __init__(self) -> None:
        self.parts: collections.deque[str] = collections.deque()
        self.size = 0
        self.total = 0

    def add(self, data: str) -> None:
        self.parts.append(data)
        self.size += len(data)
        self.total += len(data)
        while len(self.parts) > 1 and self.size - len(self.parts[0]) >= TAIL_CHARACTERS:
            self.size -= len(self.parts.popleft())

    def text(self) -> str:
        return "".join(self.parts)[-TAIL_CHARACTERS:]


def _with_output(event: OutputEvent, seen: dict[str, _Tail]) -> OutputEvent:
    result = event.result
    assert result is not None
    if result.stdout or result.stderr:
        return event
    out, err = seen["stdout"], seen["stderr"]
    full = replace(
        result,
        stdout=out.text(),
        stderr=err.text(),
        stdout_truncated=result.stdout_truncated or out.total > TAIL_CHARACTERS,
        stderr_truncated=result.stderr_truncated or err.total > TAIL_CHARACTERS,
    )
    return replace(event, result=full)


def _checked(result: CommandResult, check: bool) -> CommandResult:
    if result.timed_out or result.status == "timed_out":
        raise CommandTimeout(
            f"the command ran past its timeout ({result.execution.timeout_seconds}s) and was"
            " stopped",
            result=result,
            code="timed_out",
        )
    if result.lost:
        raise CommandLost.of(result)
    if check and not result.ok:
        raise CommandFailed(
            f"the command failed: status {result.status}, exit code {result.exit_code}:"
            f" {result.stderr[-500:]}",
            result=result,
            code="command_failed",
        )
    return result


class AsyncJob:
    """A background command: its output by cursor, stdin, wait, kill."""

    def __init__(self, sandbox: AsyncSandbox, job_id: str) -> None:
        self.sandbox = sandbox
        self.id = job_id

    def __repr__(self) -> str:
        return f"<Job {self.id} in {self.sandbox.name}>"

    async def info(self) -> agent.Execution:
        """The agent's record (status, exit code, output tails)."""
        answer = await self.sandbox._request("GET", f"executions/{self.id}")
        return agent.Execution.model_validate(answer.json())

    async def output(
        self, cursor: int = 0, *, wait: float = 0.0, max_bytes: int | None = None
    ) -> agent.OutputPage:
        """Output after `cursor` (pass `page.cursor` back for the next page);
        `wait` seconds (at most 60) long-polls for new output."""
        params = {"cursor": str(cursor), "waitSeconds": str(min(wait, 60.0))}
        if max_bytes:
            params["maxBytes"] = str(max_bytes)
        answer = await self.sandbox._request(
            "GET", f"executions/{self.id}/output", params=params, timeout=wait + 60
        )
        return agent.OutputPage.model_validate(answer.json())

    async def logs(self, cursor: int = 0) -> str:
        """All output so far from `cursor`, both streams in arrival order."""
        parts: list[str] = []
        while True:
            page = await self.output(cursor)
            parts.extend(c.data or "" for c in page.chunks)
            if not page.chunks or page.cursor == cursor:
                return "".join(parts)
            cursor = page.cursor

    async def stream(self, cursor: int = 0) -> AsyncIterator[OutputEvent]:
        """Reattach: output events from `cursor` until the job ends."""
        async for event in self.sandbox._events(
            "GET", f"executions/{self.id}/stream?cursor={cursor}", None, None
        ):
            yield event

    async def wait(self, timeout: float | None = None) -> CommandResult:
        """Until the job ends; its result. Timeout if it runs on past `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 30.0 if deadline is None else max(0.0, min(30.0, deadline - time.monotonic()))
            answer = await self.sandbox._request(
                "GET",
                f"executions/{self.id}",
                params={"output": "true", "waitSeconds": f"{left:.3f}"},
                timeout=left + 60,
            )
            execution = agent.Execution.model_validate(answer.json())
            if execution.status != "running":
                return CommandResult.of(execution)
            if deadline is not None and time.monotonic() >= deadline:
                raise Timeout(f"job {self.id} still running after {timeout}s")

    async def write(self, data: FileContent, *, close: bool = False) -> None:
        """Write to the job's stdin (started with `stdin_open=True`); `close` ends it."""
        body: JSON = {"close": close}
        if isinstance(data, bytes):
            body["dataBase64"] = base64.b64encode(data).decode()
        else:
            body["data"] = data
        await self.sandbox._request(
            "POST", f"executions/{self.id}/stdin", json_body=body, idempotent=False
        )

    async def kill(self, signal: str = "KILL", *, grace: float = 0.0) -> CommandResult:
        """Stop the job: KILL (after `grace` seconds of TERM when given) to its
        process group and whatever it started; another signal name is just sent."""
        if signal.upper().removeprefix("SIG") == "KILL":
            answer = await self.sandbox._request(
                "POST", f"executions/{self.id}/cancel", json_body={"graceSeconds": grace}
            )
        else:
            answer = await self.sandbox._request(
                "POST", f"executions/{self.id}/signal", json_body={"signal": signal}
            )
        return CommandResult.of(agent.Execution.model_validate(answer.json()))


class AsyncTerminals:
    """Programs on a pseudo-terminal in the sandbox (a shell by default): they
    outlive the connection that made them, and their output is kept (1 MiB
    each) for whoever reads it next."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self.sandbox = sandbox

    async def create(
        self,
        command: str | None = None,
        *,
        argv: Sequence[str] | None = None,
        cwd: str = ".",
        env: Mapping[str, str] | None = None,
        cols: int = 80,
        rows: int = 24,
        idle_timeout: float | None = None,
    ) -> AsyncTerminal:
        """Start `command` (a shell command line), or `argv`, or else the sandbox
        user's login shell, on a `cols` x `rows` terminal. It ends when it exits,
        on `kill()`, or after `idle_timeout` seconds with nobody attached."""
        body: JSON = {"cwd": cwd, "cols": cols, "rows": rows, "env": dict(env or {})}
        if command is not None:
            body["command"] = command
        if argv is not None:
            body["argv"] = list(argv)
        if idle_timeout is not None:
            body["idleTimeoutSeconds"] = idle_timeout
        answer = await self.sandbox._request("POST", "terminals", json_body=body, idempotent=False)
        made = agent.Terminal.model_validate(answer.json())
        return AsyncTerminal(self.sandbox, made.id)

    async def list(self) -> builtins.list[agent.Terminal]:
        """Terminals running now and those that ended lately."""
        answer = await self.sandbox._request("GET", "terminals")
        return agent.TerminalList.model_validate(answer.json()).terminals

    def get(self, terminal_id: str) -> AsyncTerminal:
        """A handle on an existing terminal (reading from the oldest output kept)."""
        return AsyncTerminal(self.sandbox, terminal_id)


class AsyncTerminal:
    """One terminal: type into it, read what it shows, resize, signal, kill.

    `read()` returns output from `cursor` on and moves `cursor` past it, so a
    handle reads each byte once; `cursor = 0` reads again from the oldest kept.
    """

    def __init__(self, sandbox: AsyncSandbox, terminal_id: str) -> None:
        self.sandbox = sandbox
        self.id = terminal_id
        self.cursor = 0
        self.status = "running"
        self.exit_code: int | None = None

    def __repr__(self) -> str:
        return f"<Terminal {self.id} in {self.sandbox.name}>"

    @property
    def _tail(self) -> str:
        return f"terminals/{self.id}"

    async def info(self) -> agent.Terminal:
        answer = await self.sandbox._request("GET", self._tail)
        return agent.Terminal.model_validate(answer.json())

    async def send(self, data: str | bytes) -> None:
        """Keys as typed: "ls\\r" runs ls in a shell, "\\x03" is Ctrl-C."""
        raw = data.encode() if isinstance(data, str) else data
        body = {"dataBase64": base64.b64encode(raw).decode()}
        await self.sandbox._request("POST", f"{self._tail}/input", json_body=body, idempotent=False)

    async def resize(self, cols: int, rows: int) -> None:
        await self.sandbox._request(
            "POST", f"{self._tail}/resize", json_body={"cols": cols, "rows": rows}
        )

    async def signal(self, signal: str = "INT") -> None:
        """To the terminal's foreground job, as a key would (INT: Ctrl-C)."""
        await self.sandbox._request(
            "POST", f"{self._tail}/signal", json_body={"signal": signal}, idempotent=False
        )

    async def read(self, *, wait: float = 10.0, max_bytes: int | None = None) -> bytes:
        """Output after `cursor`, waiting up to `wait` seconds (at most 60) for
        some; b"" when there is none yet, or none any more (see `status`)."""
        params = {"cursor": str(self.cursor), "waitSeconds": str(min(wait, 60.0))}
        if max_bytes:
            params["maxBytes"] = str(max_bytes)
        answer = await self.sandbox._request(
            "GET", f"{self._tail}/output", params=params, timeout=wait + 60
        )
        page = agent.TerminalOutput.model_validate(answer.json())
        self.cursor = page.next_cursor
        self.status, self.exit_code = page.status, page.exit_code
        return base64.b64decode(page.data_base64)

    async def read_until(self, pattern: str | bytes, *, timeout: float = 30.0) -> bytes:
        """Read until the output read so far (by this call) contains `pattern`;
        Timeout when it has not after `timeout` seconds or the terminal ended."""
        want = pattern.encode() if isinstance(pattern, str) else pattern
        seen = b""
        deadline = time.monotonic() + timeout
        while want not in seen:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            chunk = await self.read(wait=min(left, 10.0))
            seen += chunk
            if not chunk and self.status != "running":
                break
        if want not in seen:
            raise Timeout(f"terminal {self.id}: {want!r} not seen; last output {seen[-200:]!r}")
        return seen

    async def __aiter__(self) -> AsyncIterator[bytes]:
        """Output as it comes, until the terminal ends."""
        while True:
            chunk = await self.read(wait=30.0)
            if chunk:
                yield chunk
            elif self.status != "running":
                return

    async def wait(self, timeout: float | None = None) -> agent.Terminal:
        """Until the terminal's program ends (its output is read meanwhile)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.status == "running":
            left = 30.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"terminal {self.id} still running after {timeout}s")
            await self.read(wait=min(left, 30.0))
        return await self.info()

    async def attach(self, cursor: int | None = None) -> AsyncTerminalSession:
        """Join the terminal over a WebSocket: keys go out as they are sent and
        output comes as the program writes it, with no request per key and no
        polling (what `kubectl sandbox shell` uses). Its output is replayed
        from `cursor` (by default this handle's `cursor`, which the session
        moves on as it reads: after a dropped connection, `attach()` again
        shows what was missed, as far as the 1 MiB kept reaches back).

        Every way the SDK reaches the gateway carries the WebSocket, the API
        server's service proxy included. Where something in between does not
        (a proxy or Ingress in front of `gateway_url` that drops the upgrade),
        the session falls back to the plain HTTP operations (`transport` is
        then "http": a request per send, output by long poll). NotFound for a
        terminal that does not exist; Forbidden without `create sandboxes/exec`.
        """
        if cursor is not None:
            self.cursor = cursor
        try:
            ws = await self.sandbox._websocket(f"{self._tail}/attach", {"cursor": str(self.cursor)})
        except SandboxError as exc:
            if exc.code != "websocket_required":
                raise
            session = AsyncTerminalSession(self, None)
            session.info = await self.info()  # NotFound here, as over the WebSocket
            self.status, self.exit_code = session.info.status, session.info.exit_code
            return session
        session = AsyncTerminalSession(self, ws)
        try:
            await session._attached()
        except BaseException:
            await session.aclose()
            raise
        return session

    async def kill(self) -> None:
        """End its program (and what that started) and forget the terminal."""
        with contextlib.suppress(NotFound):  # gone already
            await self.sandbox._request("DELETE", self._tail)
        self.status = "exited"


# The status the agent's HTTP operations answer with for a refusal that an
# attachment reports as an event (which carries the code only); 400 otherwise.
_ATTACH_REFUSALS = {"terminal_ended": 409, "terminal_backlogged": 429, "runner_unavailable": 503}


class AsyncTerminalSession:
    """A terminal attached over a WebSocket (`terminal.attach()`), a context
    manager: `send` keys, `read` output, `resize`, `signal` the foreground
    job; `close()` detaches (the program goes on).

    `read()` returns output in order and moves the terminal handle's `cursor`
    past it; `dropped` counts bytes that were lost (output that outran the
    1 MiB the agent keeps while this session did not read). When the program
    ends, `read()` returns b"" and `ended` is true; `wait()` gives its exit
    code. A lost connection raises ServerError (code `attachment_lost`) from
    `read()` once the output received before it is read, and from `send()`:
    `terminal.attach()` again goes on from where reading stopped. The agent's
    refusal of a key or a control message (the terminal cannot take input
    that fast, an unknown signal) is raised by the next `read()`. One task
    (or thread, with the sync client) may read while others send.
    """

    def __init__(self, terminal: AsyncTerminal, ws: AsyncWebSocket | None) -> None:
        self.terminal = terminal
        self.transport = "websocket" if ws is not None else "http"
        self.dropped = 0
        # The terminal as the agent last described it (at attaching, at its end).
        self.info: agent.Terminal | None = None
        self._ws = ws
        self._chunks: collections.deque[tuple[int, bytes]] = collections.deque()
        self._next = terminal.cursor  # where the next output message starts
        self._ended = False
        self._lost: SandboxError | None = None

    def __repr__(self) -> str:
        return f"<TerminalSession {self.terminal.id} over {self.transport}>"

    async def __aenter__(self) -> AsyncTerminalSession:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @property
    def ended(self) -> bool:
        """The program ended and all of its output was read."""
        if self._ws is None:
            return self.terminal.status != "running"
        return self._ended and not self._chunks

    def _gone(self, why: str) -> SandboxError:
        return ServerError(
            f"the attachment to terminal {self.terminal.id} was lost ({why}); the terminal goes"
            f" on: attach() again to read on from cursor {self.terminal.cursor}",
            code="attachment_lost",
            details={"reason": why},
        )

    async def _attached(self) -> None:
        """The agent's first message: where the replay starts."""
        assert self._ws is not None
        try:
            first = await self._ws.receive(timeout=self.terminal.sandbox.client.gateway.timeout)
        except TimeoutError:
            raise self._gone("no answer after the handshake") from None
        event = json.loads(first) if isinstance(first, str) else None
        if not isinstance(event, dict) or event.get("type") != "attached":
            raise self._gone(f"the agent's first message was {str(first)[:100]!r}")
        self.dropped = int(event.get("dropped") or 0)
        self.terminal.cursor = self._next = int(event["cursor"])
        self._describe(event.get("terminal"))

    def _describe(self, view: Any) -> None:
        if isinstance(view, dict):
            self.info = agent.Terminal.model_validate(view)
            self.terminal.status, self.terminal.exit_code = self.info.status, self.info.exit_code

    async def _receive(self, wait: float) -> None:
        """Messages until some output came (and what came with it), the terminal
        ended, the connection closed, or `wait` seconds passed."""
        assert self._ws is not None
        deadline = time.monotonic() + wait
        while not self._ended and self._lost is None:
            if self._chunks and not self._ws.buffered:
                return
            try:
                message = await self._ws.receive(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return
            if message is None:
                self._lost = self._gone(f"the connection closed, {self._ws.close_code}")
                return
            if isinstance(message, bytes):
                self._chunks.append((self._next, message))
                self._next += len(message)
                continue
            event = json.loads(message)
            kind = event.get("type") if isinstance(event, dict) else None
            if kind == "dropped":
                self.dropped += int(event.get("bytes") or 0)
                self._next = int(event.get("cursor") or self._next)
            elif kind == "exit":
                self._describe(event.get("terminal"))
                self._ended = True
            elif kind == "error":
                code = str(event.get("code") or "")
                body = {"error": {"code": code, "message": event.get("message")}}
                raise from_response(_ATTACH_REFUSALS.get(code, 400), body, str(event))

    async def read(self, *, wait: float = 10.0, max_bytes: int | None = None) -> bytes:
        """Output not read yet, waiting up to `wait` seconds for some; b"" when
        there is none yet, or none any more (`ended`)."""
        if self._ws is None:
            return await self.terminal.read(wait=min(wait, 60.0), max_bytes=max_bytes)
        if not self._chunks:
            await self._receive(wait)
        if not self._chunks and self._lost is not None:
            raise self._lost
        out = bytearray()
        while self._chunks and (max_bytes is None or len(out) < max_bytes):
            start, data = self._chunks.popleft()
            if max_bytes is not None and len(out) + len(data) > max_bytes:
                taken = max_bytes - len(out)
                self._chunks.appendleft((start + taken, data[taken:]))
                data = data[:taken]
            out += data
            self.terminal.cursor = start + len(data)
        return bytes(out)

    async def read_until(self, pattern: str | bytes, *, timeout: float = 30.0) -> bytes:
        """Read until the output read so far (by this call) contains `pattern`;
        Timeout when it has not after `timeout` seconds or the terminal ended."""
        want = pattern.encode() if isinstance(pattern, str) else pattern
        seen = b""
        deadline = time.monotonic() + timeout
        while want not in seen:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            chunk = await self.read(wait=min(left, 10.0))
            seen += chunk
            if not chunk and self.ended:
                break
        if want not in seen:
            raise Timeout(
                f"terminal {self.terminal.id}: {want!r} not seen; last output {seen[-200:]!r}"
            )
        return seen

    async def __aiter__(self) -> AsyncIterator[bytes]:
        """Output as it comes, until the terminal ends."""
        while True:
            chunk = await self.read(wait=30.0)
            if chunk:
                yield chunk
            elif self.ended:
                return

    async def _control(self, message: bytes | str) -> None:
        assert self._ws is not None
        try:
            await self._ws.send(message)
        except ConnectionError as exc:
            raise self._gone(str(exc)) from exc

    async def send(self, data: str | bytes) -> None:
        """Keys as typed: "ls\\r" runs ls in a shell, "\\x03" is Ctrl-C."""
        if self._ws is None:
            await self.terminal.send(data)
        else:
            await self._control(data.encode() if isinstance(data, str) else data)

    async def resize(self, cols: int, rows: int) -> None:
        """The terminal's window size (its foreground job gets SIGWINCH)."""
        if self._ws is None:
            await self.terminal.resize(cols, rows)
        else:
            await self._control(json.dumps({"type": "resize", "cols": cols, "rows": rows}))

    async def signal(self, signal: str = "INT") -> None:
        """To the terminal's foreground job, as a key would (INT: Ctrl-C)."""
        if self._ws is None:
            await self.terminal.signal(signal)
        else:
            await self._control(json.dumps({"type": "signal", "signal": signal}))

    async def wait(self, timeout: float | None = None) -> agent.Terminal:
        """Until the program ends (output not read yet is skipped); the terminal
        as it ended (`exit_code`, `signal`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ended:
            left = 30.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"terminal {self.terminal.id} still running after {timeout}s")
            await self.read(wait=min(left, 30.0))
        if self.info is None or self.info.status == "running":
            self.info = await self.terminal.info()
        return self.info

    async def aclose(self) -> None:
        """Detach (the program goes on; `terminal.attach()` joins it again)."""
        if self._ws is not None:
            await self._ws.aclose()


def _extract(tar: tarfile.TarFile, target: Path) -> None:
    """Extract what stays inside `target`: tarfile's "data" filter where this
    Python has it (3.11.4 and later), else the same refusals by hand."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(target, filter="data")
        return
    root = target.resolve()
    for member in tar.getmembers():
        where = (root / member.name).resolve()
        link = (where.parent / member.linkname).resolve() if member.issym() else root
        if member.islnk():
            link = (root / member.linkname).resolve()
        inside = all(p == root or root in p.parents for p in (where, link))
        if not inside or not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
            raise Invalid(f"the archive's entry {member.name!r} would leave {target}")
        member.mode &= 0o777
    tar.extractall(target)


class AsyncFiles:
    """The sandbox's workspace (paths relative to it; escapes are refused)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self.sandbox = sandbox

    async def read(
        self, path: str, *, start_line: int | None = None, line_count: int | None = None
    ) -> str:
        """A text file, whole or the lines from `start_line` (1-based), `line_count` of them."""
        params = {"path": path}
        if start_line is not None:
            params["startLine"] = str(start_line)
            if line_count is None:
                line_count = 1 << 30
        if line_count is not None:
            params["lineCount"] = str(line_count)
            params.setdefault("startLine", "1")
        answer = await self.sandbox._request("GET", "files/content", params=params)
        return answer.content.decode(errors="replace")

    async def read_bytes(
        self, path: str, *, offset: int | None = None, length: int | None = None
    ) -> bytes:
        """A file's bytes, whole or `length` bytes from `offset`."""
        params = {"path": path}
        if offset is not None:
            params["offset"] = str(offset)
        if length is not None:
            params["length"] = str(length)
        return (await self.sandbox._request("GET", "files/content", params=params)).content

    async def write(
        self, path: str, content: FileContent, *, mode: str | None = None
    ) -> agent.FileInfo:
        """Write a file atomically (parent directories are made)."""
        params = {"path": path, "parents": "true"}
        if mode:
            params["mode"] = mode
        data = content.encode() if isinstance(content, str) else content
        answer = await self.sandbox._request("PUT", "files/content", params=params, content=data)
        return agent.FileInfo.model_validate(answer.json())

    async def write_many(self, files: Mapping[str, FileContent], *, path: str = ".") -> int:
        """Write several files in one request (a tar extracted under `path`);
        returns how many were written."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for name, content in files.items():
                data = content.encode() if isinstance(content, str) else content
                info = tarfile.TarInfo(name.lstrip("/"))
                info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
                tar.addfile(info, io.BytesIO(data))
        await self.sandbox._request(
            "PUT", "files/archive", params={"path": path}, content=buffer.getvalue()
        )
        return len(files)

    async def list(
        self, path: str = ".", *, depth: int = 1, hidden: bool = True
    ) -> builtins.list[agent.FileInfo]:
        """Entries of a directory (`depth` levels down)."""
        answer = await self.sandbox._request(
            "GET",
            "files/list",
            params={"path": path, "depth": str(depth), "hidden": str(hidden).lower()},
        )
        return agent.FileList.model_validate(answer.json()).entries

    async def stat(self, path: str) -> agent.FileInfo:
        answer = await self.sandbox._request("GET", "files/stat", params={"path": path})
        return agent.FileInfo.model_validate(answer.json())

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except NotFound:
            return False
        return True

    async def mkdir(self, path: str, *, parents: bool = True, exist_ok: bool = True) -> None:
        await self.sandbox._request(
            "POST",
            "files/mkdir",
            json_body={"path": path, "parents": parents, "existOk": exist_ok},
        )

    async def remove(self, path: str, *, recursive: bool = False, missing_ok: bool = False) -> bool:
        """Remove a file or (with `recursive`) a directory; whether it existed."""
        answer = await self.sandbox._request(
            "POST",
            "files/remove",
            json_body={"path": path, "recursive": recursive, "missingOk": missing_ok},
        )
        return bool(answer.json().get("removed"))

    async def move(self, source: str, destination: str, *, overwrite: bool = False) -> None:
        await self.sandbox._request(
            "POST",
            "files/move",
            json_body={
                "source": source,
                "destination": destination,
                "overwrite": overwrite,
                "parents": True,
            },
        )

    async def grep(
        self,
        pattern: str,
        path: str = ".",
        *,
        glob: str | None = None,
        ignore_case: bool = False,
        fixed: bool = False,
        max_results: int | None = None,
    ) -> agent.SearchResult:
        """Search file contents by regular expression (or `fixed` string)."""
        body: JSON = {
            "pattern": pattern,
            "path": path,
            "ignoreCase": ignore_case,
            "fixedString": fixed,
        }
        if glob:
            body["glob"] = glob
        if max_results:
            body["maxResults"] = max_results
        answer = await self.sandbox._request("POST", "files/search", json_body=body)
        return agent.SearchResult.model_validate(answer.json())

    async def find(
        self,
        pattern: str,
        path: str = ".",
        *,
        kind: str | None = None,
        max_depth: int | None = None,
    ) -> builtins.list[str]:
        """Paths matching a glob (`kind`: file or directory)."""
        body: JSON = {"pattern": pattern, "path": path}
        if kind:
            body["type"] = kind
        if max_depth is not None:
            body["maxDepth"] = max_depth
        answer = await self.sandbox._request("POST", "files/find", json_body=body)
        return agent.FindResult.model_validate(answer.json()).paths

    async def apply_patch(
        self, patch: str, *, strip: int = 1, dry_run: bool = False
    ) -> agent.PatchResult:
        """Apply a unified diff over any number of files: all hunks or none
        (Conflict naming the hunk that does not apply)."""
        answer = await self.sandbox._request(
            "POST", "files/patch", json_body={"patch": patch, "strip": strip, "dryRun": dry_run}
        )
        return agent.PatchResult.model_validate(answer.json())

    async def replace(
        self,
        path: str,
        find: str,
        replace: str,
        *,
        all: bool = False,
        regex: bool = False,
        expected_count: int | None = None,
    ) -> int:
        """Find and replace in one file; how many replacements. Conflict when
        nothing matches, or several do and `all` is not set."""
        body: JSON = {"path": path, "find": find, "replace": replace, "all": all, "regex": regex}
        if expected_count is not None:
            body["expectedCount"] = expected_count
        answer = await self.sandbox._request("POST", "files/replace", json_body=body)
        return int(answer.json()["replacements"])

    def watch(
        self, path: str = ".", *, recursive: bool = False, timeout: float | None = None
    ) -> AsyncWatch:
        """Watch a directory's changes, as they happen:

            with sandbox.files.watch("src", recursive=True) as changes:
                for event in changes:
                    print(event.type, event.path)  # create, write, remove, rename, chmod

        Inside the `with` the watch is in place: every later change is seen.
        `recursive`: subdirectories too, and those made later. `timeout`:
        seconds after which the stream ends (None: when closed). An `overflow`
        event says changes were dropped (more came than the agent holds for a
        slow reader): rescan what you track. Watching is not activity: it does
        not keep the sandbox from its idle timeout."""
        return AsyncWatch(self.sandbox, path, recursive, timeout)

    async def download_url(self, path: str, *, ttl: int = 600) -> str:
        """A URL that downloads `path` (a directory: as tar) without credentials
        until it expires (a signed URL of the gateway): on the gateway's external
        URL when the chart sets one (`gateway.externalURL`), else at the address
        this client reaches the gateway by. ConfigError when that is the API
        server's proxy, which no request without Kubernetes credentials passes."""
        location = await self.sandbox.client.gateway.locate()
        body = {"path": path, "ttlSeconds": ttl}
        answer = (await self.sandbox._request("POST", "urls", json_body=body)).json()
        if answer.get("external"):
            return str(answer["url"])
        if location.via_api_server:
            raise ConfigError(
                "the gateway is reached through the API server's proxy, which needs"
                " Kubernetes credentials: a link that works without them needs the"
                " gateway's own address (the chart's gateway.externalURL, or"
                " gateway_url= or $SANDBOX_GATEWAY_URL here; e.g. an Ingress to the gateway)"
            )
        return location.base + str(answer["path"])

    async def download_tar(
        self,
        path: str,
        destination: str | os.PathLike[str] | IO[bytes],
        *,
        gzip: bool = False,
        progress: Progress | None = None,
    ) -> int:
        """Stream `path` (a directory) as a tar into a file; the bytes written."""
        own = isinstance(destination, str | os.PathLike)
        out: IO[bytes] = (
            open(destination, "wb")  # noqa: SIM115 -- closed in the finally below
            if isinstance(destination, str | os.PathLike)
            else destination
        )
        done = 0
        try:
            async with self.sandbox.client.gateway.stream(
                self.sandbox.namespace,
                self.sandbox.name,
                "GET",
                "files/archive",
                params={"path": path, "gzip": str(gzip).lower()},
            ) as response:
                async for chunk in response.aiter_bytes(CHUNK):
                    out.write(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, None)
        finally:
            if own:
                out.close()
        return done

    async def download_dir(
        self, path: str, local: str | os.PathLike[str], *, progress: Progress | None = None
    ) -> Path:
        """Download a directory of the sandbox into `local` (made if missing)."""
        target = Path(local)
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile() as spool:
            await self.download_tar(path, spool, progress=progress)
            spool.seek(0)
            with tarfile.open(fileobj=spool, mode="r:") as tar:
                _extract(tar, target)
        return target

    async def upload_dir(
        self,
        local: str | os.PathLike[str],
        path: str = ".",
        *,
        progress: Progress | None = None,
    ) -> agent.ArchiveResult:
        """Upload a local directory's contents into `path`, as a streamed tar."""
        source = Path(local)
        if not source.is_dir():
            raise Invalid(f"{source} is not a directory")
        with tempfile.TemporaryFile() as spool:
            with tarfile.open(fileobj=spool, mode="w") as tar:
                for entry in sorted(source.iterdir()):
                    tar.add(entry, arcname=entry.name)
            total = spool.tell()
            spool.seek(0)
            answer = await self._upload(path, spool, total, progress)
        return agent.ArchiveResult.model_validate(answer)

    async def upload_tar(
        self,
        archive: IO[bytes],
        path: str = ".",
        *,
        size: int | None = None,
        progress: Progress | None = None,
    ) -> agent.ArchiveResult:
        """Extract a tar (optionally compressed) read from `archive` into `path`."""
        return agent.ArchiveResult.model_validate(await self._upload(path, archive, size, progress))

    async def _upload(
        self, path: str, source: IO[bytes], total: int | None, progress: Progress | None
    ) -> JSON:
        async def chunks() -> AsyncIterator[bytes]:
            done = 0
            while True:
                chunk = source.read(CHUNK)
                if not chunk:
                    return
                done += len(chunk)
                if progress is not None:
                    progress(done, total)
                yield chunk

        headers = {"Content-Length": str(total)} if total is not None else None
        async with self.sandbox.client.gateway.stream(
            self.sandbox.namespace,
            self.sandbox.name,
            "PUT",
            "files/archive",
            params={"path": path},
            content=chunks(),
            headers=headers,
        ) as response:
            await response.aread()
            answer: JSON = response.json()
            return answer


class AsyncWatch:
    """A directory watch (`files.watch()`): a context manager, and an iterator
    of `WatchEvent`s (`type` create, write, remove, rename, chmod or overflow;
    `path` relative to the workspace; `file_type` file or directory; `time`;
    `old_path` and `move` for a rename). The iteration ends when the watched
    directory is removed or moved, when the timeout passes (`end_reason` says
    which), or at `close()`. A stream cut off (the sandbox paused, an agent or
    gateway restart) raises ServerError: changes since may be missed."""

    def __init__(
        self, sandbox: AsyncSandbox, path: str, recursive: bool, timeout: float | None
    ) -> None:
        self.sandbox = sandbox
        self.path = path
        self.recursive = recursive
        self.timeout = timeout
        self.started: agent.WatchEvent | None = None
        self.end_reason: str | None = None
        self.closed = False
        self._stream: AbstractAsyncContextManager[httpx.Response] | None = None
        self._lines: AsyncIterator[str] | None = None

    def __repr__(self) -> str:
        return f"<AsyncWatch {self.sandbox.name}:{self.path} recursive={self.recursive}>"

    async def __aenter__(self) -> AsyncWatch:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncWatch:
        return self

    async def open(self) -> None:
        """Start watching (done by `with` and by the first iteration); returns
        once the watch is in place."""
        if self._lines is not None or self.closed:
            return
        params = {"path": self.path, "recursive": str(self.recursive).lower()}
        if self.timeout is not None:
            params["timeoutSeconds"] = str(self.timeout)
        for attempt in range(3):
            stream = self.sandbox.client.gateway.stream(
                self.sandbox.namespace,
                self.sandbox.name,
                "GET",
                "files/watch",
                params=params,
                read_timeout=WATCH_READ_TIMEOUT,
            )
            try:
                response = await stream.__aenter__()
            except (NotReady, NotFound) as exc:
                if attempt == 2 or not await self.sandbox._worth_waiting(exc):
                    raise
                continue
            self._stream, self._lines = stream, response.aiter_lines()
            break
        first = await self._event()
        if first is None or first.type != "started":
            await self.aclose()
            raise ServerError(f"the watch did not start: {first}")
        self.started = first

    async def _event(self) -> agent.WatchEvent | None:
        """The next event of the stream, keepalives skipped; None at its end."""
        while self._lines is not None:
            try:
                line = await self._lines.__anext__()
            except StopAsyncIteration:
                return None
            except httpx.TransportError as exc:
                await self.aclose()
                raise ServerError(f"the watch of {self.path} broke off: {exc}") from exc
            if line:
                event = agent.WatchEvent.model_validate_json(line)
                if event.type != "keepalive":
                    return event
        return None

    async def __anext__(self) -> agent.WatchEvent:
        await self.open()
        event = await self._event()
        if event is None or event.type == "finished":
            self.end_reason = event.reason if event is not None else self.end_reason
            await self.aclose()
            raise StopAsyncIteration
        if event.type == "interrupted":
            await self.aclose()
            why = event.error.message if event.error is not None else "no reason given"
            raise ServerError(f"the watch of {self.path} was interrupted: {why}")
        return event

    async def aclose(self) -> None:
        """Stop watching (the agent removes its watches at once)."""
        self.closed = True
        stream, self._stream, self._lines = self._stream, None, None
        if stream is not None:
            with contextlib.suppress(httpx.HTTPError, OSError):
                await stream.__aexit__(None, None, None)
