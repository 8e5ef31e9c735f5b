"""The Python SDK against a real API server, the operator, the gateway under the
chart's RBAC and real agents on loopback (the node's part played by the test).

Each way of finding the cluster is exercised with real credentials: an explicit
API server and token, a kubeconfig with a token, the admin's certificate-only
kubeconfig (the SDK then provisions a ServiceAccount for the gateway), and a
pod's ServiceAccount directory with a real token and CA."""

from __future__ import annotations

import asyncio
import inspect
import io
import os
import re
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from devcluster.controlplane import ControlPlane
from sandbox_sdk import (
    AsyncSandbox,
    AsyncSandboxClient,
    CommandLost,
    CommandTimeout,
    Conflict,
    Forbidden,
    Gone,
    Invalid,
    NotFound,
    NotReady,
    Paused,
    Sandbox,
    SandboxClient,
    ServerError,
)
from sandbox_sdk._async.client import (
    AsyncFiles,
    AsyncJob,
    AsyncTerminal,
    AsyncTerminals,
    AsyncTerminalSession,
)
from sandbox_sdk._sync.client import Files, Job, Terminal, Terminals, TerminalSession
from tests.integration.harness import AgentProcess, GatewayProcess, TcpRelay, wait_for
from tests.integration.test_gateway import caller
from tests.kube import KubeJSON, api_path, core_path
from tests.sandboxes import Sandboxes

LiveSandbox = Callable[..., AgentProcess]


@pytest.fixture
def alice(kube: KubeJSON, ns: str) -> str:
    """A token of a ServiceAccount bound to the chart's user role in `ns`, and to
    the built-in `view` role (as people who edit a namespace are): `events()`
    reads Events, which the chart's role does not cover."""
    token = caller(kube, ns, "alice", "user")
    rbac = "rbac.authorization.k8s.io/v1"
    kube.create(
        api_path(rbac, "rolebindings", ns),
        {
            "apiVersion": rbac,
            "kind": "RoleBinding",
            "metadata": {"name": "alice-view"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "view",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "alice", "namespace": ns}],
        },
    )
    return token


@pytest.fixture
def client(
    control_plane: ControlPlane, gateway: GatewayProcess, ns: str, alice: str
) -> Iterator[SandboxClient]:
    """Explicit mode: the API server, a bearer token, the gateway's URL."""
    with SandboxClient(
        ns,
        api_server=control_plane.server,
        token=alice,
        ca_file=str(control_plane.ca_cert),
        gateway_url=gateway.url,
    ) as sdk:
        yield sdk


def _start(live_sandbox: LiveSandbox, name: str) -> AgentProcess:
    """Play the node for a Sandbox the SDK created."""
    return live_sandbox(name, create=False)


def _connections_opened(gateway: GatewayProcess) -> float:
    found = re.search(r"^sandbox_gateway_connections_opened_total (\S+)$", gateway.metrics(), re.M)
    assert found, "the gateway exports sandbox_gateway_connections_opened_total"
    return float(found.group(1))


def test_commands_stream_and_jobs(
    client: SandboxClient, gateway: GatewayProcess, live_sandbox: LiveSandbox
) -> None:
    sandbox = client.create("python", name="box", wait=False)
    # The handle is usable at once: the first call waits for the sandbox.
    node = threading.Thread(target=_start, args=(live_sandbox, "box"))
    node.start()
    try:
        first = sandbox.execute('echo "hi $EXTRA"; pwd', env={"EXTRA": "there"})
    finally:
        node.join(60)
    assert first.ok, first
    assert first.stdout.splitlines()[0] == "hi there"

    sandbox.files.mkdir("sub")
    assert sandbox.execute("pwd", cwd="sub").stdout.strip().endswith("/sub")
    assert sandbox.execute("cat", stdin="typed in").stdout == "typed in"
    assert sandbox.execute(["printf", "%s-%s", "a", "b"]).stdout == "a-b"
    failed = sandbox.execute("echo bad >&2; exit 3")
    assert (failed.exit_code, failed.stderr, failed.ok) == (3, "bad\n", False)

    # Streamed to callbacks and to a file while it runs.
    out: list[str] = []
    err = io.StringIO()
    streamed = sandbox.execute(
        "for i in 1 2 3; do echo $i; sleep 0.1; done; echo e >&2", stdout=out.append, stderr=err
    )
    assert ("".join(out), err.getvalue(), streamed.exit_code) == ("1\n2\n3\n", "e\n", 0)
    # ... and as an iterator, ending with the result.
    events = list(sandbox.stream("echo one; echo two >&2; exit 4"))
    kinds = [(e.kind, e.data) for e in events if e.kind != "exit"]
    assert sorted(kinds) == [("stderr", "two\n"), ("stdout", "one\n")]
    assert events[-1].kind == "exit"
    assert events[-1].result is not None
    assert events[-1].result.exit_code == 4
    # A streamed call reads its answer to the end after `finished`: the next call
    # goes on the same connection (httpx closes one left mid-answer).
    opened = _connections_opened(gateway)
    for _ in range(3):
        assert sandbox.execute("echo again", stdout=out.append).ok
        assert list(sandbox.stream("true"))[-1].kind == "exit"
    assert _connections_opened(gateway) == opened

    # A command past its timeout is stopped; the sandbox stays usable.
    began = time.monotonic()
    with pytest.raises(CommandTimeout) as stopped:
        sandbox.execute("echo started; sleep 30", timeout=1)
    assert time.monotonic() - began < 15
    assert stopped.value.result.stdout == "started\n"
    assert sandbox.execute("echo still here").stdout == "still here\n"
    with pytest.raises(Invalid):
        sandbox.execute("true", timeout=3600)

    # Background jobs: stdin, output by cursor, wait, kill.
    job = sandbox.start("cat; echo done", stdin_open=True)
    job.write("line one\n")
    page = job.output(0, wait=5)
    assert "".join(c.data or "" for c in page.chunks) == "line one\n"
    job.write("line two\n", close=True)
    result = job.wait(timeout=30)
    assert result.stdout == "line one\nline two\ndone\n"
    assert job.logs(page.cursor) == "line two\ndone\n"
    sleeper = sandbox.start("sleep 300")
    assert sleeper.id in {j.id for j in sandbox.jobs(status="running")}
    killed = sleeper.kill()
    assert killed.status == "cancelled"
    assert sandbox.job(job.id).info().status == "completed"
    sandbox.destroy()
    assert client.list() == []


def test_files(client: SandboxClient, live_sandbox: LiveSandbox, tmp_path: Path) -> None:
    sandbox = client.create("python", name="files", wait=False)
    agent = _start(live_sandbox, "files")
    files = sandbox.files
    assert files.write_many({"proj/a.py": "x = 1\ny = 2\nz = 3\n", "proj/b.txt": b"bytes\n"}) == 2
    assert (agent.workspace / "proj" / "a.py").read_text() == "x = 1\ny = 2\nz = 3\n"
    assert files.read("proj/a.py", start_line=2, line_count=1) == "y = 2\n"
    assert files.read("proj/a.py", start_line=3) == "z = 3\n"
    assert files.read_bytes("proj/b.txt", offset=1, length=3) == b"yte"
    info = files.write("proj/run.sh", "echo ran\n", mode="0755")
    assert (info.path, info.mode, info.size) == ("proj/run.sh", "0755", 9)
    assert sorted(e.name for e in files.list("proj")) == ["a.py", "b.txt", "run.sh"]
    assert files.stat("proj/a.py").type == "file"
    assert files.exists("proj/b.txt")
    assert not files.exists("proj/none")
    files.move("proj/b.txt", "proj/c.txt")
    assert files.remove("proj/c.txt")
    assert not files.remove("proj/c.txt", missing_ok=True)
    hits = files.grep(r"y = \d", "proj")
    assert [(m.path, m.line) for m in hits.matches] == [("proj/a.py", 2)]
    assert files.find("*.py") == ["proj/a.py"]
    patch = "--- a/proj/a.py\n+++ b/proj/a.py\n@@ -1,3 +1,3 @@\n x = 1\n-y = 2\n+y = 20\n z = 3\n"
    patched = files.apply_patch(patch)
    assert [(f.path, f.status) for f in patched.files] == [("proj/a.py", "modified")]
    with pytest.raises(Conflict) as conflict:
        files.apply_patch(patch)
    assert conflict.value.code == "patch_conflict"
    assert files.replace("proj/a.py", "20", "21") == 1
    with pytest.raises(Conflict):
        files.replace("proj/a.py", "nowhere", "x")
    assert files.read("proj/a.py") == "x = 1\ny = 21\nz = 3\n"

    # Directories up and down as streamed tars, with progress.
    local = tmp_path / "up"
    (local / "deep").mkdir(parents=True)
    (local / "deep" / "big.bin").write_bytes(os.urandom(3 << 20))
    (local / "top.txt").write_text("top\n")
    seen: list[int] = []
    uploaded = files.upload_dir(local, "uploaded", progress=lambda done, total: seen.append(done))
    assert uploaded.entries >= 3
    assert seen[-1] > 3 << 20
    back = files.download_dir("uploaded", tmp_path / "down")
    assert (back / "deep" / "big.bin").read_bytes() == (local / "deep" / "big.bin").read_bytes()
    archive = tmp_path / "proj.tar"
    size = files.download_tar("proj", archive)
    assert size == archive.stat().st_size
    with tarfile.open(archive) as tar:
        assert any(n.endswith("a.py") for n in tar.getnames())
    url = files.download_url("proj/a.py", ttl=60)
    assert httpx.get(url).text == "x = 1\ny = 21\nz = 3\n"  # no credentials needed
    with pytest.raises(Invalid):
        files.read("../../etc/passwd")
    sandbox.destroy()


def test_errors_are_typed(
    client: SandboxClient,
    kube: KubeJSON,
    ns: str,
    sandboxes: Sandboxes,
    live_sandbox: LiveSandbox,
    control_plane: ControlPlane,
    gateway: GatewayProcess,
) -> None:
    with pytest.raises(NotFound):
        client.connect("nowhere")
    with pytest.raises(NotFound):
        client.get("nowhere")
    # A sandbox whose pod never runs: the wait ends with the Sandbox's own reason.
    stuck = client.create("python", name="stuck", wait=False)
    stuck.ready_timeout = 3
    with pytest.raises(NotReady) as waiting:
        stuck.execute("true")
    assert waiting.value.reason in ("PodPending", "WorkspacePending", "AgentNotReady")
    held = client.create("python", name="held", wait=False)
    held.pause(wait=False)
    wait_for(
        lambda: (sandboxes.get("held") or {}).get("status", {}).get("phase") == "Paused",
        30,
        "paused",
    )
    with pytest.raises(Paused):
        held.execute("true")
    # Another user's rights: a viewer may read files but not run commands.
    live_sandbox("box")
    viewer = caller(kube, ns, "vera", "viewer")
    with SandboxClient(
        ns,
        api_server=control_plane.server,
        token=viewer,
        ca_file=str(control_plane.ca_cert),
        gateway_url=gateway.url,
    ) as other:
        box = other.connect("box")
        with pytest.raises(Forbidden) as refused:
            box.execute("true")
        assert "sandboxes/exec" in refused.value.message
        assert box.files.list() == []
        with pytest.raises(Forbidden):
            other.create("python", name="not-mine")


def test_a_retried_execute_never_runs_twice(
    client: SandboxClient, live_sandbox: LiveSandbox
) -> None:
    """The request body carries the idempotency key: sending it again (what the
    SDK does after a dropped connection or a 502) returns the first run."""
    from sandbox_sdk._wire import exec_body

    live_sandbox("box")
    sandbox = client.connect("box")
    body = exec_body(
        "echo x >> count.txt; cat count.txt",
        env=None,
        cwd=None,
        stdin=None,
        timeout=30,
        combined_output=False,
    )
    first = sandbox._request("POST", "executions", json_body=body).json()
    again = sandbox._request("POST", "executions", json_body=body)
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.json()["id"] == first["id"]
    assert sandbox.files.read("count.txt") == "x\n"


def test_a_command_cut_by_an_agent_crash_is_an_error(
    client: SandboxClient, live_sandbox: LiveSandbox
) -> None:
    """The runner stops what no agent can observe any more; the caller hears
    why instead of a result without an exit code."""
    sandbox = client.create("python", name="crash", wait=False)
    agent = _start(live_sandbox, sandbox.name)
    sandbox.execute("true")  # the gateway knows the pod: both commands start at once
    outcome: dict[str, BaseException | object] = {}

    def run(key: str, stdout: io.StringIO | None) -> None:
        try:
            outcome[key] = sandbox.execute(f"echo {key} > {key}.txt; sleep 60", stdout=stdout)
        except BaseException as exc:  # handed to the test's thread
            outcome[key] = exc

    threads = [
        threading.Thread(target=run, args=("plain", None)),
        threading.Thread(target=run, args=("streamed", io.StringIO())),
    ]
    for thread in threads:
        thread.start()
    wait_for(
        lambda: all((agent.workspace / f"{k}.txt").exists() for k in ("plain", "streamed")),
        30,
        f"both commands to start ({outcome})",
    )
    agent.crash_agent()
    for thread in threads:
        thread.join(120)
    for key in ("plain", "streamed"):
        error = outcome[key]
        assert isinstance(error, CommandLost), (key, error)
        assert error.code == "agent_restarted", (key, error.code)
        assert error.result is not None
        assert error.result.exit_code is None
    assert sandbox.execute("echo after").stdout == "after\n"


def test_lifecycle_through_the_resources(
    client: SandboxClient,
    kube: KubeJSON,
    ns: str,
    live_sandbox: LiveSandbox,
) -> None:
    with client.create("python", name="life", env={"KEEP": "1", "DROP": "2"}, wait=False) as sb:
        # (This tier's agents run without the pod's env; only the overlay the
        # operator pushes on a change reaches them, which is what is checked.)
        _start(live_sandbox, "life")
        assert sb.set_env({"DROP": None, "NEW": "3"}) == {"KEEP": "1", "NEW": "3"}
        # The operator pushed it to the agent before set_env returned.
        assert sb.execute('echo "$KEEP${DROP:-}$NEW"').stdout == "13\n"
        assert [s.metadata.name for s in client.list()] == ["life"]
        assert sb.refresh().status is not None

        sb.pause()
        assert sb.refresh().status.phase == "Paused"  # type: ignore[union-attr]
        wait_for(lambda: kube.get(core_path("pods", ns, "life")) is None, 30, "pod deleted")
        node = threading.Thread(target=_start, args=(live_sandbox, "life"))
        node.start()
        sb.resume()
        node.join(60)
        assert sb.execute("echo back").stdout == "back\n"
        reasons = [e.reason for e in sb.events()]
        assert "EnvironmentUpdated" in reasons
        assert "Paused" in reasons

        # Another process connects by name (a later chat turn, a resumed workflow).
        script = (
            "from sandbox_sdk import SandboxClient\n"
            "with SandboxClient() as c:\n"
            "    print(c.connect('life').execute('echo from elsewhere').stdout, end='')\n"
        )
        other = subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, **_explicit_env(client)},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert other.returncode == 0, other.stderr
        assert other.stdout == "from elsewhere\n"
    # Leaving the block destroyed it, and returned once it was gone.
    assert kube.get(f"/apis/sandbox.dev/v1alpha1/namespaces/{ns}/sandboxes/life") is None


def _explicit_env(client: SandboxClient) -> dict[str, str]:
    """The environment that makes a fresh process find the same cluster: a
    kubeconfig with the client's token, the gateway by URL."""
    assert client.config is not None
    assert client.config.credentials is not None
    token = client.config.credentials.token()
    assert token is not None
    path = Path(f"/tmp/sdk-{os.getpid()}-{client.namespace}.kubeconfig")
    cluster: dict[str, object] = {"server": client.config.server}
    ca = os.environ.get("SDK_TEST_CA")
    if ca:
        cluster["certificate-authority"] = ca
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "u", "user": {"token": token}}],
                "contexts": [
                    {
                        "name": "x",
                        "context": {"cluster": "c", "user": "u", "namespace": client.namespace},
                    }
                ],
                "current-context": "x",
            }
        )
    )
    assert client.gateway.url is not None
    return {"KUBECONFIG": str(path), "SANDBOX_GATEWAY_URL": client.gateway.url}


@pytest.fixture(autouse=True)
def _ca_for_children(control_plane: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SDK_TEST_CA", str(control_plane.ca_cert))


def test_sandboxes_from_templates_and_the_catalog(
    client: SandboxClient, kube: KubeJSON, ns: str, live_sandbox: LiveSandbox
) -> None:
    catalog = f"node-{os.urandom(3).hex()}"
    kube.create(
        api_path("sandbox.dev/v1alpha1", "clustersandboxtemplates"),
        {
            "apiVersion": "sandbox.dev/v1alpha1",
            "kind": "ClusterSandboxTemplate",
            "metadata": {"name": catalog},
            "spec": {"description": "Node.js", "sandbox": {"runtime": "node"}},
        },
    )
    try:
        kube.create(
            api_path("sandbox.dev/v1alpha1", "sandboxtemplates", ns),
            {
                "apiVersion": "sandbox.dev/v1alpha1",
                "kind": "SandboxTemplate",
                "metadata": {"name": "team"},
                "spec": {
                    "description": "the team's defaults",
                    "sandbox": {"runtime": "python", "env": [{"name": "TEAM", "value": "a"}]},
                },
            },
        )
        listed = {(t.kind, t.name): t for t in client.list_templates()}
        team = listed[("SandboxTemplate", "team")]
        assert team.description == "the team's defaults"
        assert team.runtime == "python"
        assert listed[("ClusterSandboxTemplate", catalog)].runtime == "node"

        with client.create(
            template="team", name="teamed", env={"OWN": "b"}, files={"task.md": "hi"}, wait=False
        ) as sb:
            _start(live_sandbox, "teamed")
            assert sb.files.read("task.md") == "hi"  # the first call waits for Ready
            spec = sb.refresh().spec
            assert spec.template_ref is not None
            assert spec.template_ref.name == "team"
            pod = kube.read(core_path("pods", ns, "teamed"))
            env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
            assert env["TEAM"] == "a"
            assert env["OWN"] == "b"
        with client.create(cluster_template=catalog, name="cataloged", profile="dense", wait=False):
            pod = wait_for(lambda: kube.get(core_path("pods", ns, "cataloged")), 20, "pod")
            assert pod["spec"]["containers"][0]["image"] == "sandbox-runtime-node:dev"
            # The dense resource profile's requests.
            assert pod["spec"]["containers"][0]["resources"]["requests"]["memory"] == "32Mi"
        with pytest.raises(ValueError, match="one of template, cluster_template or pool"):
            client.create(template="team", cluster_template=catalog)
        with pytest.raises(ValueError, match="one of template, cluster_template or pool"):
            client.create(template="team", pool="warm")
        with client.create(pool="absent", name="pooled", wait=False):
            path = api_path("sandbox.dev/v1alpha1", "sandboxes", ns, "pooled")
            assert kube.read(path)["spec"]["poolRef"] == {"name": "absent"}
            waiting = wait_for(
                lambda: next(
                    (
                        c
                        for c in (kube.read(path).get("status") or {}).get("conditions", [])
                        if c.get("reason") == "PoolNotFound"
                    ),
                    None,
                ),
                20,
                "PoolNotFound",
            )
            assert "SandboxPool absent does not exist" in waiting["message"]
    finally:
        kube.delete(api_path("sandbox.dev/v1alpha1", "clustersandboxtemplates", name=catalog))


def test_discovery_modes(
    control_plane: ControlPlane,
    kube: KubeJSON,
    ns: str,
    alice: str,
    gateway: GatewayProcess,
    live_sandbox: LiveSandbox,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    live_sandbox("box")
    monkeypatch.setenv("SANDBOX_GATEWAY_URL", gateway.url)

    # A pod's ServiceAccount: a real token and the cluster's CA in the usual files.
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(alice)
    (account / "ca.crt").write_bytes(control_plane.ca_cert.read_bytes())
    (account / "namespace").write_text(ns)
    host, port = control_plane.server.removeprefix("https://").rsplit(":", 1)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))  # nothing there: not used
    from sandbox_sdk import config

    monkeypatch.setattr(config, "SERVICEACCOUNT_DIR", account)
    pod = config.discover(serviceaccount_dir=account)
    assert pod is not None
    assert (pod.in_cluster, pod.namespace) == (True, ns)
    with SandboxClient() as in_pod:
        assert in_pod.config is not None
        assert in_pod.config.in_cluster, in_pod.config.source
        assert in_pod.connect("box").execute("echo pod").stdout == "pod\n"
        # The kubelet rotates the token file: the next call reads the new one.
        (account / "token").write_text("rotated-and-wrong")
        os.utime(account / "token", (time.time() + 5, time.time() + 5))
        with pytest.raises(Exception, match=r"Unauthorized|401|not accepted"):
            in_pod.list()
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")

    # The admin's kubeconfig has a client certificate only: the gateway gets the
    # token of a `sandbox-sdk` ServiceAccount the SDK makes, bound to the user role.
    kube.create(
        core_path("services", "sandbox-system"),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": f"sbx-gateway-{ns}",
                "labels": {
                    "app.kubernetes.io/name": "sandbox-gateway",
                    "app.kubernetes.io/instance": "sbx",
                },
            },
            "spec": {"ports": [{"port": 80}]},
        },
    )
    try:
        monkeypatch.setenv("KUBECONFIG", str(control_plane.kubeconfig))
        with SandboxClient(ns) as admin:
            assert admin.config is not None
            assert admin.config.certificate_only
            assert admin.connect("box").execute("id -un || true").ok
        # Through the API server's proxy the SDK asks the gateway for the URL (on
        # its external URL, if it has one) and never makes one of the API server,
        # which nothing serves without credentials: here, with no gateway behind
        # the Service, that request's failure is what the caller gets.
        monkeypatch.delenv("SANDBOX_GATEWAY_URL")
        with (
            SandboxClient(ns, gateway="proxy") as via_proxy,
            pytest.raises(NotFound, match=f"sbx-gateway-{ns}"),
        ):
            via_proxy.connect("box").files.download_url("anything")
        account_body = kube.read(core_path("serviceaccounts", ns, "sandbox-sdk"))
        assert account_body["metadata"]["name"] == "sandbox-sdk"
    finally:
        kube.delete(core_path("services", "sandbox-system", f"sbx-gateway-{ns}"))

    # Gateway only: a scoped token serves commands of one sandbox, nothing else.
    with SandboxClient(
        ns,
        api_server=control_plane.server,
        token=alice,
        ca_file=str(control_plane.ca_cert),
        gateway_url=gateway.url,
    ) as full:
        scoped = full.connect("box").token(["exec"], ttl=120)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    with SandboxClient(ns, gateway_url=gateway.url, gateway_token=scoped) as limited:
        assert limited.config is None
        assert limited.connect("box").execute("echo scoped").stdout == "scoped\n"
        with pytest.raises(Forbidden):
            limited.connect("box").files.read("x")
        with pytest.raises(Exception, match="no Kubernetes API access"):
            limited.list()


def test_the_async_client_has_the_same_surface(
    control_plane: ControlPlane,
    gateway: GatewayProcess,
    ns: str,
    alice: str,
    live_sandbox: LiveSandbox,
) -> None:
    pairs = [
        (SandboxClient, AsyncSandboxClient),
        (Sandbox, AsyncSandbox),
        (Files, AsyncFiles),
        (Job, AsyncJob),
        (Terminals, AsyncTerminals),
        (Terminal, AsyncTerminal),
        (TerminalSession, AsyncTerminalSession),
    ]
    for sync_cls, async_cls in pairs:
        sync_api = {n for n in dir(sync_cls) if not n.startswith("_")}
        # `aclose` is the async spelling of `close`, as in httpx and asyncio.
        async_api = {
            "close" if n == "aclose" else n for n in dir(async_cls) if not n.startswith("_")
        }
        assert sync_api == async_api, (sync_cls, sync_api ^ async_api)
        for name in sync_api:
            sync_member = getattr(sync_cls, name)
            async_member = getattr(async_cls, "aclose" if name == "close" else name)
            if callable(sync_member):
                assert list(inspect.signature(sync_member).parameters) == list(
                    inspect.signature(async_member).parameters
                ), name
    live_sandbox("box")

    async def use() -> list[str]:
        async with AsyncSandboxClient(
            ns,
            api_server=control_plane.server,
            token=alice,
            ca_file=str(control_plane.ca_cert),
            gateway_url=gateway.url,
        ) as sdk:
            box = await sdk.connect("box")
            await box.files.write("a.txt", "async\n")
            result = await box.execute("cat a.txt")
            events = [e.data async for e in box.stream("echo 1; echo 2") if e.kind == "stdout"]
            term = await box.terminals.create("printf 'async-%s\\n' tty; sleep 0.2")
            shown = b"".join([chunk async for chunk in term])
            return [result.stdout, "".join(events), shown.decode()]

    assert asyncio.run(use()) == ["async\n", "1\n2\n", "async-tty\r\n"]


def test_a_terminal_from_the_sdk(client: SandboxClient, live_sandbox: LiveSandbox) -> None:
    """A shell on a pty: typed into, read until a prompt, resized, interrupted,
    found again by id from another handle, killed."""
    live_sandbox("tty")
    sandbox = client.connect("tty")
    term = sandbox.terminals.create(
        argv=["bash", "--norc", "--noprofile", "-i"], env={"PS1": "sdk> "}, cols=70, rows=15
    )
    term.read_until("sdk> ")
    term.send("stty size\r")
    assert b"15 70" in term.read_until("15 70")
    term.resize(100, 30)
    term.send("stty size\r")
    term.read_until("30 100")  # not the prompt: readline redraws it on a resize
    # "sleeping" once sh is the foreground job (the echo shows "sle%sing").
    term.send("sh -c 'printf \"sle%sing\\n\" ep; exec sleep 100'\r")
    term.read_until("sleeping")
    term.signal("INT")
    term.read_until("sdk> ")
    again = sandbox.terminals.get(term.id)
    assert b"30 100" in again.read(wait=0), "a new handle reads from the oldest output kept"
    assert [t.id for t in sandbox.terminals.list()] == [term.id]
    term.send("exit 7\r")
    ended = term.wait(timeout=30)
    assert (ended.status, ended.exit_code) == ("exited", 7), ended
    term.kill()
    assert sandbox.terminals.list() == []
    with pytest.raises(NotFound):
        again.info()


def _until_lost(session: TerminalSession) -> ServerError:
    """Read until the session says its connection is gone (bounded: a session
    that never notices fails the test)."""
    for _ in range(6):
        try:
            session.read(wait=5)
        except ServerError as exc:
            return exc
    raise AssertionError("the cut connection was not noticed in 30 s")


def test_a_terminal_attached_over_a_websocket(
    control_plane: ControlPlane,
    gateway: GatewayProcess,
    kube: KubeJSON,
    ns: str,
    alice: str,
    live_sandbox: LiveSandbox,
) -> None:
    """`attach()`: keys out and output back on one WebSocket through the
    gateway; a resize and a signal over it. The connection dropped under it (a
    relay in front of the gateway resets its sockets): `read()` says so, and the
    same handle attached again replays what the terminal wrote meanwhile, from
    where reading stopped and not before. Refused: a terminal that does not
    exist (NotFound), a caller without `create sandboxes/exec` (Forbidden)."""
    live_sandbox("tty")
    relay = TcpRelay(gateway.port)
    server, ca = control_plane.server, str(control_plane.ca_cert)
    try:
        with SandboxClient(
            ns, api_server=server, ca_file=ca, token=alice, gateway_url=relay.url
        ) as sdk:
            sandbox = sdk.connect("tty")
            term = sandbox.terminals.create(
                argv=["bash", "--norc", "--noprofile", "-i"], env={"PS1": "ws> "}, cols=70, rows=15
            )
            with term.attach() as session:
                assert session.transport == "websocket"
                session.read_until("ws> ")
                session.resize(100, 30)
                session.send("stty size\r")
                session.read_until("30 100")
                session.send("sh -c 'printf \"sle%sing\\n\" ep; exec sleep 100'\r")
                session.read_until("sleeping")
                session.signal("INT")
                session.read_until("ws> ")
                # The line is the shell's once echoed: it runs on without us.
                session.send("sleep 1; echo after-$((20+22))\r")
                session.read_until("after-$")
                read_to = term.cursor
                relay.cut()
                lost = _until_lost(session)
                assert lost.code == "attachment_lost", lost
                with pytest.raises(ServerError, match="attachment_lost"):
                    session.send("x")
            assert term.cursor == read_to, "nothing was read after the cut"
            with term.attach() as again:
                replay = again.read_until("after-42")
                assert b"after-$((" not in replay, "replayed from the cursor, not from the start"
                assert again.dropped == 0
                again.send("exit 3\r")
                ended = again.wait(timeout=30)
                assert (ended.status, ended.exit_code) == ("exited", 3), ended
                assert again.ended
                assert again.read(wait=0) == b""
            term.kill()

            with pytest.raises(NotFound):
                sandbox.terminals.get("term-0123456789abcdef").attach()
            live = sandbox.terminals.create(argv=["cat"])
            viewer = caller(kube, ns, "tty-viewer", "viewer")
            with (
                SandboxClient(
                    ns,
                    api_server=server,
                    ca_file=ca,
                    token=alice,
                    gateway_token=viewer,
                    gateway_url=gateway.url,
                ) as seer,
                pytest.raises(Forbidden),
            ):
                seer.connect("tty").terminals.get(live.id).attach()
            files_only = sandbox.token(["files:read"], ttl=120)
            with (
                SandboxClient(ns, gateway_url=gateway.url, gateway_token=files_only) as scoped,
                pytest.raises(Forbidden),
            ):
                scoped.connect("tty").terminals.get(live.id).attach()
            live.kill()
    finally:
        relay.close()


def test_a_terminal_session_from_async_code(
    control_plane: ControlPlane,
    gateway: GatewayProcess,
    ns: str,
    alice: str,
    live_sandbox: LiveSandbox,
) -> None:
    """The async session: one task reads while another sends on the same
    WebSocket; the program's end (EOF to `cat`) ends the iteration."""
    live_sandbox("tty")

    async def use() -> tuple[bytes, bytes, int | None]:
        async with AsyncSandboxClient(
            ns,
            api_server=control_plane.server,
            token=alice,
            ca_file=str(control_plane.ca_cert),
            gateway_url=gateway.url,
        ) as sdk:
            box = await sdk.connect("tty")
            term = await box.terminals.create(argv=["cat"])
            async with await term.attach() as session:

                async def copies() -> bytes:
                    seen = b""
                    while seen.count(b"typed-3") < 2:  # the echo, then cat's copy
                        seen += await session.read(wait=10)
                    return seen

                reader = asyncio.create_task(copies())
                for i in range(4):
                    await session.send(f"typed-{i}\r")
                shown = await asyncio.wait_for(reader, 60)
                await session.send("\x04")  # EOF: cat exits
                rest = b"".join([chunk async for chunk in session])
                ended = await session.wait(timeout=30)
            await term.kill()
            return shown, rest, ended.exit_code

    shown, rest, code = asyncio.run(use())
    # Each line twice: the terminal's echo, and cat's copy.
    lines = shown.split(b"\r\n")
    for i in range(4):
        assert lines.count(f"typed-{i}".encode()) == 2, shown
    assert b"typed" not in rest
    assert code == 0


# Headers a proxy does not pass on: hop-by-hop ones (RFC 9110 7.6.1), and those
# it sets itself (host; the length and encoding of a body it reframes).
_NOT_FORWARDED = frozenset(
    {"connection", "upgrade", "keep-alive", "transfer-encoding", "te", "trailer"}
    | {"host", "content-length", "content-encoding"}
)


class _PlainProxy:
    """An HTTP/1.1 reverse proxy that knows nothing of WebSockets: it drops the
    hop-by-hop headers (Connection, Upgrade, ...) as HTTP proxies must, so an
    upgrade reaches the gateway as a plain GET."""

    def __init__(self, upstream: str) -> None:
        http = httpx.Client(base_url=upstream, timeout=120)
        hop = _NOT_FORWARDED

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in hop}
                answer = http.request(self.command, self.path, headers=headers, content=body)
                self.send_response(answer.status_code)
                for name, value in answer.headers.items():
                    if name.lower() not in hop:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            do_GET = do_POST = do_DELETE = forward

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.http = http
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.http.close()


def test_a_terminal_session_falls_back_to_http_where_no_websocket_passes(
    control_plane: ControlPlane,
    gateway: GatewayProcess,
    ns: str,
    alice: str,
    live_sandbox: LiveSandbox,
) -> None:
    """Behind a proxy that drops the upgrade (the gateway answers the plain GET
    with 426), `attach()` gives a session on the HTTP operations, which does the
    same work: keys in, output out, the end and its exit code."""
    live_sandbox("tty")
    proxy = _PlainProxy(gateway.url)
    try:
        with SandboxClient(
            ns,
            api_server=control_plane.server,
            token=alice,
            ca_file=str(control_plane.ca_cert),
            gateway_url=proxy.url,
        ) as sdk:
            term = sdk.connect("tty").terminals.create(argv=["sh", "-c", "read line; exit 5"])
            with term.attach() as session:
                assert session.transport == "http"
                session.send("via-http\r")
                assert b"via-http" in session.read_until("via-http")
                assert session.wait(timeout=30).exit_code == 5
                assert session.ended
            term.kill()
            with pytest.raises(NotFound):
                sdk.connect("tty").terminals.get("term-0123456789abcdef").attach()
    finally:
        proxy.close()


def test_pause_returns_once_the_pod_is_gone(
    client: SandboxClient, live_sandbox: LiveSandbox, kube: KubeJSON, ns: str
) -> None:
    """A pod takes its grace period to stop; pause() waits for that, not only
    for the phase (which reads Paused as soon as the pod is asked to go)."""
    sandbox = client.create("python", name="box", wait=False)
    _start(live_sandbox, "box")
    pod = core_path("pods", ns, "box")
    # Held by a finalizer, the pod stays Terminating (as a kubelet stopping
    # its containers keeps it) until the test lets it go.
    kube.patch(pod, {"metadata": {"finalizers": ["test.sandbox.dev/hold"]}})
    done = threading.Event()

    def pause() -> None:
        sandbox.pause()
        done.set()

    pauser = threading.Thread(target=pause)
    pauser.start()
    try:
        wait_for(
            lambda: (kube.get(pod) or {}).get("metadata", {}).get("deletionTimestamp"),
            30,
            "the pod to be terminating",
        )
        wait_for(lambda: sandbox.refresh().status.phase == "Paused", 30, "Paused")  # type: ignore[union-attr]
        time.sleep(1.0)  # time for a pause() that returns too early to do so
        assert not done.is_set(), "pause() returned while the pod was still there"
    finally:
        kube.patch(pod, {"metadata": {"finalizers": None}})
    pauser.join(60)
    assert done.is_set()
    assert kube.get(pod) is None


def test_events_are_oldest_first_within_a_second(
    client: SandboxClient, kube: KubeJSON, ns: str
) -> None:
    """Events of one second: lastTimestamp cannot order them, and the API
    server lists them by name; the order they were written in decides."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    names = ["ghost.e", "ghost.d", "ghost.c", "ghost.b", "ghost.a"]  # written in this order
    for i, name in enumerate(names):
        kube.create(
            core_path("events", ns),
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": name},
                "involvedObject": {"kind": "Sandbox", "name": "ghost", "namespace": ns},
                "reason": f"Step{i}",
                "message": f"step {i}",
                "type": "Normal",
                "firstTimestamp": stamp,
                "lastTimestamp": stamp,
                "count": 1,
                "source": {"component": "test"},
            },
        )
    events = Sandbox(client, "ghost", ns).events()
    assert [e.reason for e in events] == [f"Step{i}" for i in range(5)]


def test_deleting_a_missing_snapshot_is_not_found(client: SandboxClient) -> None:
    with pytest.raises(NotFound):
        client.delete_snapshot("no-such-snapshot")
    with pytest.raises(NotFound):
        client.connect("no-such-sandbox")


def test_shell_errors_read_as_a_shell_s_and_a_pruned_log_is_gone(
    client: SandboxClient, live_sandbox: LiveSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agent keeps at most 100 KB of logs: a second 60 KB one prunes the first.
    monkeypatch.setenv("SANDBOX_AGENT_MAX_LOG_DIR_BYTES", "100000")
    sandbox = client.create("python", name="box", wait=False)
    _start(live_sandbox, "box")

    missing = sandbox.execute("no-such-command-x")
    assert missing.exit_code == 127
    assert "/dev/fd" not in missing.stderr, missing.stderr
    assert missing.stderr.endswith(": 1: no-such-command-x: not found\n"), missing.stderr
    # A script too large for argv still runs (from a descriptor).
    large = sandbox.execute(": padding\n" * 8000 + "echo large")
    assert (large.exit_code, large.stdout) == (0, "large\n"), large.stderr

    first = sandbox.start("head -c 60000 /dev/zero")
    first.wait()
    assert len(first.output(0).chunks) == 1
    sandbox.start("head -c 60000 /dev/zero").wait()
    with pytest.raises(Gone) as gone:
        first.output(0)
    assert (gone.value.status, gone.value.code) == (410, "log_pruned")
    assert first.wait().exit_code == 0  # the record stays


def test_code_runs_keep_state_through_the_gateway(
    client: SandboxClient, live_sandbox: LiveSandbox
) -> None:
    """run_code on a real kernel: state across runs, rich results, errors that
    leave the context usable, a timeout, separate contexts."""
    live_sandbox("kernel")
    sandbox = client.connect("kernel")
    printed: list[str] = []
    first = sandbox.run_code("x = 20\nprint('hello')\nx * 2 + 2", on_stdout=printed.append)
    assert (first.status, first.text, first.logs.stdout) == ("ok", "42", ["hello\n"])
    assert printed == ["hello\n"]
    assert first.context_id == "default-python"

    shown = sandbox.run_code(
        "from IPython.display import HTML, display\ndisplay(HTML('<i>t</i>'))\n{'k': x}"
    )
    assert [r.formats() for r in shown.results] == [["text", "html"], ["text"]]
    assert shown.results[0].html == "<i>t</i>"
    assert not shown.results[0].is_main
    assert shown.text == "{'k': 20}"

    failed = sandbox.run_code("undefined_name")
    assert failed.status == "error"
    assert failed.error is not None
    assert (failed.error.name, failed.error.value) == (
        "NameError",
        "name 'undefined_name' is not defined",
    )
    assert sandbox.run_code("x").text == "20"

    stopped = sandbox.run_code("while True:\n    pass", timeout=1)
    assert stopped.status == "timed_out"
    assert stopped.error is not None
    assert stopped.error.name == "KeyboardInterrupt"
    assert not stopped.restarted
    assert sandbox.run_code("x + 1").text == "21"

    other = sandbox.contexts.create()
    assert sandbox.run_code("'x' in dir()", context=other).text == "False"
    assert {c.id for c in sandbox.contexts.list()} == {"default-python", other.id}
    assert sandbox.contexts.restart(other).restarts == 1
    sandbox.contexts.delete(other)
    with pytest.raises(NotFound) as gone:
        sandbox.run_code("1", context=other)
    assert gone.value.code == "context_not_found"
    with pytest.raises(Invalid):
        sandbox.run_code("1", language="cobol")
