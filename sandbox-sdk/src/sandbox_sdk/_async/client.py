"""AsyncSandboxClient: creates, finds and runs sandboxes (lifecycle through the
custom resources), on its connection (connection.py). A sandbox's handle is in
sandbox.py, its commands in executions.py, snapshots in snapshots.py, files in
files.py, terminals in terminals.py."""

from __future__ import annotations

import builtins
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import yaml

from sandbox_sdk import _lazy
from sandbox_sdk._async import snapshots
from sandbox_sdk._async.connection import AsyncConnection
from sandbox_sdk._async.executions import DEFAULT_TIMEOUT, AsyncJob
from sandbox_sdk._async.files import AsyncFiles, AsyncWatch
from sandbox_sdk._async.kube import API_VERSION, core_path, resource_path
from sandbox_sdk._async.sandbox import READY_TIMEOUT, AsyncSandbox
from sandbox_sdk._async.terminals import AsyncTerminal, AsyncTerminals, AsyncTerminalSession
from sandbox_sdk._async_io import sleep
from sandbox_sdk._objects import condition
from sandbox_sdk._wire import MAX_TIMEOUT, FileContent, timeout_seconds
from sandbox_sdk.errors import Gone, NotFound, NotReady, ServerError
from sandbox_sdk.types import CommandResult, OutputEvent, Runtime, Sink, Template

if TYPE_CHECKING:
    from sandbox_sdk.models import resources
else:  # the generated models are built on first use: see sandbox_sdk._lazy
    resources = _lazy.module("sandbox_sdk.models.resources")

# The handles' classes lived here before the client was split by concern: still
# importable from this module.
__all__ = [
    "AsyncFiles",
    "AsyncJob",
    "AsyncSandbox",
    "AsyncSandboxClient",
    "AsyncTerminal",
    "AsyncTerminalSession",
    "AsyncTerminals",
    "AsyncWatch",
]

JSON = dict[str, Any]
SDK_LABEL = "sandbox.dev/created-by"


def _duration(seconds: float) -> str:
    return f"{max(1, math.ceil(seconds))}s"


def _env_list(env: Mapping[str, str]) -> list[JSON]:
    return [{"name": k, "value": v} for k, v in env.items()]


class AsyncSandboxClient(AsyncConnection):
    """Creates, finds and runs sandboxes.

    Connection (see `sandbox_sdk.config` and `sandbox_sdk._async.gateway`):
    with no arguments, the kubeconfig kubectl would use, or inside a pod its
    ServiceAccount; the gateway is found by its Service. `gateway_url` plus
    `token` (a scoped token) suffices for commands and files of one sandbox.
    The same arguments as one value: `from_options(ConnectionOptions(...))`.

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
                ready = condition(item, "Ready")
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

    # -- snapshots (snapshots.py) and executions --------------------------------------

    list_snapshots = snapshots.list_snapshots
    get_snapshot = snapshots.get_snapshot
    delete_snapshot = snapshots.delete_snapshot
    snapshot_lineage = snapshots.snapshot_lineage

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
