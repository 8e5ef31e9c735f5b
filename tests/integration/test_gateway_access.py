"""Every agent operation x every spelling of its path x every kind of caller,
through the real gateway to a real agent that records what reaches it.

The expected answer of each request is derived from the agent's own OpenAPI
document (each operation's `x-access-class`), not from the gateway's code:
a canonical path of a forwarded operation reaches the agent exactly when the
caller holds that permission, and nothing else ever reaches it. Spellings
that are not canonical (dot segments raw, encoded, double-encoded, in mixed
case; `//`; `%2f`; `%5c`; `;x`; a trailing `/`; an encoded letter) are
refused with 400 whoever sends them. Requests go out through http.client,
which sends a path as given (httpx would normalise dot segments first).
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import io
import json
import socket
import tarfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.integration.conftest import RELEASE
from tests.integration.harness import (
    AgentProcess,
    GatewayProcess,
    Node,
    next_pod_ip,
    secret_token,
    service_account_token,
    wait_for,
)
from tests.kube import KubeJSON, api_path, core_path
from tests.sandboxes import Sandboxes

REPO = Path(__file__).resolve().parents[2]
PROBE = "X-Probe"
RBAC = "rbac.authorization.k8s.io/v1"
# The classes the gateway forwards, and the RBAC rule each needs.
RULES = {
    "exec": ("create", "sandboxes/exec"),
    "files:read": ("get", "sandboxes/files"),
    "files:write": ("update", "sandboxes/files"),
    "view": ("get", "sandboxes"),
}
DOTS = ("..", "%2e%2e", "%2E%2e", ".%2E", "%252e%252e")
# Prefixes an attacker walks back from with `..`: the top-level routes of the
# gateway's sandbox prefix, a preview port included.
PREFIXES = ("files", "executions", "info", "ports/17000", "download")
# Every spelling is tried by these callers (a refusal for a spelling comes
# before authentication, so the others add requests, not cases).
SPELLERS = ("nobody", "viewer", "user", "role files:write", "token files:write")


@dataclass(frozen=True)
class Op:
    method: str
    path: str  # the agent's path, `{id}` filled in
    access: str
    query: str = ""  # a stream that only ends at its time limit gets a short one
    websocket: bool = False  # a GET that upgrades (a terminal's attachment)


def agent_operations(execution_id: str) -> list[Op]:
    document = json.loads((REPO / "sandbox-agent/openapi.json").read_text())
    return [
        Op(
            method.upper(),
            path.replace("{id}", execution_id),
            spec["x-access-class"],
            "?timeoutSeconds=1"
            if any(p["name"] == "timeoutSeconds" for p in spec.get("parameters", ()))
            else "",
            "101" in spec["responses"],
        )
        for path, methods in sorted(document["paths"].items())
        for method, spec in sorted(methods.items())
    ]


def variants(tail: str) -> list[str]:
    """Non-canonical spellings that an agent or a normalising proxy might read as
    `tail` (an operation after the sandbox prefix, e.g. `executions/ex-1/output`)."""
    out = [f"{prefix}/{dots}/{tail}" for prefix in PREFIXES for dots in DOTS]
    out += [f"{tail}/", f"{tail}/.", f"./{tail}", tail.replace("/", "//", 1) + "//"]
    out += [f"{tail};x", f"{tail.split('/')[0]};x/{tail.partition('/')[2]}".rstrip("/")]
    if "/" in tail:
        out += [tail.replace("/", "%2f", 1), tail.replace("/", "%2F", 1)]
        out += [tail.replace("/", "%5c", 1), tail.replace("/", "\\", 1)]
    out.append(f"%{ord(tail[0]):02x}{tail[1:]}")  # one letter percent-encoded
    return out


class Recorder:
    """An HTTP server in front of the real agent: passes each request on and
    records (method, raw path) of those carrying a probe id."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.ip = next_pod_ip()
        self.seen: dict[str, list[tuple[str, str]]] = {}
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(10), "the recorder did not start"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())
        self.loop.run_forever()

    async def _serve(self) -> None:
        self.session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._pass)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.ip, 8080).start()
        self.started.set()

    async def _pass(self, request: web.Request) -> web.Response:
        probe = request.headers.get(PROBE)
        if probe:
            self.seen.setdefault(probe, []).append((request.method, request.raw_path))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host",)}
        async with self.session.request(
            request.method,
            f"{self.target}{request.raw_path}",
            headers=headers,
            data=await request.read(),
            allow_redirects=False,
        ) as answer:
            body = await answer.read()
            return web.Response(
                status=answer.status,
                body=body,
                content_type=answer.content_type,
            )

    def stop(self) -> None:
        async def down() -> None:
            await self.runner.cleanup()
            await self.session.close()

        asyncio.run_coroutine_threadsafe(down(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Caller:
    """Raw requests to the gateway over one kept-alive connection."""

    def __init__(self, gateway: GatewayProcess, token: str | None) -> None:
        self.gateway = gateway
        self.token = token
        self.count = 0
        self.connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=60)

    def send(self, method: str, path: str) -> tuple[int, str, str]:
        """(status, error code or "", probe id)."""
        self.count += 1
        probe = f"{id(self)}-{self.count}"
        headers = {PROBE: probe, "Content-Length": "0"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            self.connection.request(method, path, headers=headers)
            response = self.connection.getresponse()
        except (http.client.HTTPException, OSError):
            self.connection.close()
            self.connection = http.client.HTTPConnection("127.0.0.1", self.gateway.port, timeout=60)
            self.connection.request(method, path, headers=headers)
            response = self.connection.getresponse()
        body = response.read()
        code = ""
        if response.getheader("Content-Type", "").startswith("application/json"):
            try:
                parsed: Any = json.loads(body)
                code = (
                    str(parsed.get("error", {}).get("code", "")) if isinstance(parsed, dict) else ""
                )
            except ValueError:
                code = ""
        return response.status, code, probe


def _account(
    kube: KubeJSON,
    ns: str,
    account: str,
    *,
    cluster_role: str | None = None,
    rules: list[tuple[str, str]] | None = None,
) -> str:
    """A ServiceAccount of `ns`, bound there to the ClusterRole `cluster_role` or
    to a Role of `rules` (verb, resource), or to nothing; a token of it."""
    kube.create(
        core_path("serviceaccounts", ns),
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}},
    )
    role: tuple[str, str] | None = ("ClusterRole", cluster_role) if cluster_role else None
    if rules:
        kube.create(
            api_path(RBAC, "roles", ns),
            {
                "apiVersion": RBAC,
                "kind": "Role",
                "metadata": {"name": account},
                "rules": [
                    {"apiGroups": ["sandbox.dev"], "resources": [res], "verbs": [verb]}
                    for verb, res in rules
                ],
            },
        )
        role = ("Role", account)
    if role is not None:
        kube.create(
            api_path(RBAC, "rolebindings", ns),
            {
                "apiVersion": RBAC,
                "kind": "RoleBinding",
                "metadata": {"name": account},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": role[0],
                    "name": role[1],
                },
                "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ns}],
            },
        )
    return service_account_token(kube, ns, account, seconds=3600)


def _scoped(gateway: GatewayProcess, ns: str, sandbox: str, admin: str, ops: list[str]) -> str:
    path = f"/v1/namespaces/{ns}/sandboxes/{sandbox}/tokens"
    status, body = _request(gateway, "POST", path, admin, {"operations": ops, "ttlSeconds": 600})
    assert status == 201, body
    return str(body["token"])


@pytest.fixture
def recorded_sandbox(
    kube: KubeJSON,
    ns: str,
    sandboxes: Sandboxes,
    node: Node,
    agents: Any,
) -> Iterator[Recorder]:
    """Sandbox `box`, served by a real agent behind a recorder (the pod's address)."""
    sandboxes.create(
        "box", {"runtime": "python", "network": {"exposedPorts": [{"name": "app", "port": 17000}]}}
    )
    wait_for(lambda: kube.get(core_path("pods", ns, "box")) is not None, 20, "pod box")
    agent: AgentProcess = agents(secret_token(kube, ns, "box"))
    recorder = Recorder(f"http://{agent.ip}:{agent.port}")
    try:
        node.run_pod(ns, "box", recorder.ip)
        sandboxes.wait_phase("box", "Running")
        yield recorder
    finally:
        recorder.stop()


def test_every_operation_every_spelling_every_caller(
    gateway: GatewayProcess,
    kube: KubeJSON,
    ns: str,
    recorded_sandbox: Recorder,
    access_roles: None,
) -> None:
    recorder = recorded_sandbox
    admin = _account(kube, ns, "admin-user", cluster_role=f"{RELEASE}-user")
    # A real execution id, so that operations on one reach a real record.
    execution = _started(gateway, admin, ns, "echo hi")

    other_ns = f"{ns}-other"
    kube.create(
        core_path("namespaces"),
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": other_ns}},
    )
    try:
        callers: dict[str, tuple[str | None, set[str]]] = {
            "nobody": (None, set()),
            "bad token": ("not-a-token", set()),
            "no role": (_account(kube, ns, "nobody"), set()),
            "viewer": (
                _account(kube, ns, "viewer", cluster_role=f"{RELEASE}-viewer"),
                {"view", "files:read"},
            ),
            "user": (admin, set(RULES)),
            "other tenant": (
                _account(kube, other_ns, "tenant", cluster_role=f"{RELEASE}-user"),
                set(),
            ),
        }
        for cls, rule in RULES.items():
            callers[f"role {cls}"] = (
                _account(kube, ns, cls.replace(":", "-"), rules=[rule]),
                {cls},
            )
            callers[f"token {cls}"] = (_scoped(gateway, ns, "box", admin, [cls]), {cls})
        callers["token ports"] = (_scoped(gateway, ns, "box", admin, ["ports"]), set())
        ops = agent_operations(execution)
        failures: list[str] = []
        prefix = f"/v1/namespaces/{ns}/sandboxes"
        for who, (token, holds) in callers.items():
            client = Caller(gateway, token)
            for op in ops:
                tail = op.path.removeprefix("/v1/").lstrip("/")
                forwarded = op.access in RULES and op.path.startswith("/v1/")
                status, code, probe = client.send(op.method, f"{prefix}/box/{tail}{op.query}")
                reached = recorder.seen.pop(probe, [])
                if forwarded and op.access in holds and op.websocket:
                    # A plain GET of a WebSocket operation: the gateway answers it
                    # itself, after the permission check (upgrades: test_gateway.py).
                    if reached or (status, code) != (426, "websocket_required"):
                        failures.append(f"{who}: {op.method} {op.path}: {status} {code} {reached}")
                elif forwarded and op.access in holds:
                    if reached != [(op.method, op.path + op.query)] or status in (401, 403):
                        failures.append(f"{who}: {op.method} {op.path}: {status} {code} {reached}")
                else:
                    expected = (
                        404 if not forwarded else 401 if who in ("nobody", "bad token") else 403
                    )
                    if reached or status != expected:
                        failures.append(
                            f"{who}: {op.method} {op.path}: {status} {code}, wanted {expected};"
                            f" reached {reached}"
                        )
                    # Refused the same whether the sandbox exists or not.
                    if forwarded:
                        twin = client.send(op.method, f"{prefix}/nosuch/{tail}{op.query}")
                        if twin[:2] != (status, code):
                            failures.append(
                                f"{who}: {op.method} {op.path}: {status} {code} for box but"
                                f" {twin[0]} {twin[1]} for a sandbox that does not exist"
                            )
                for spelling in variants(tail) if who in SPELLERS else ():
                    status, code, probe = client.send(op.method, f"{prefix}/box/{spelling}")
                    reached = recorder.seen.pop(probe, [])
                    if reached or (status, code) != (400, "non_canonical_path"):
                        failures.append(
                            f"{who}: {op.method} {spelling}: {status} {code}, reached {reached}"
                        )
            assert client.count > 0
        assert recorder.seen == {}, f"requests reached the agent unaccounted: {recorder.seen}"
        assert not failures, f"{len(failures)} wrong answers:\n" + "\n".join(failures[:60])
    finally:
        kube.delete(core_path("namespaces", name=other_ns))


def _started(gateway: GatewayProcess, token: str, ns: str, command: str) -> str:
    """The id of a command run to its end in sandbox `box`."""
    path = f"/v1/namespaces/{ns}/sandboxes/box/executions"
    status, body = _request(gateway, "POST", path, token, {"command": command})
    assert status == 200, body
    return str(body["id"])


def _request(
    gateway: GatewayProcess, method: str, path: str, token: str | None, body: object = None
) -> tuple[int, Any]:
    status, _, parsed = _exchange(gateway, method, path, token, body)
    return status, parsed


def _exchange(
    gateway: GatewayProcess, method: str, path: str, token: str | None, body: object = None
) -> tuple[int, dict[str, str], Any]:
    """One request on a new connection: status, headers, the body (JSON if it is)."""
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    connection.request(
        method, path, body=None if body is None else json.dumps(body), headers=headers
    )
    answer = connection.getresponse()
    data = answer.read()
    try:
        parsed: Any = json.loads(data)
    except ValueError:
        parsed = data
    return answer.status, dict(answer.getheaders()), parsed


def test_what_a_credential_mints_never_outlives_it(
    gateway: GatewayProcess,
    kube: KubeJSON,
    ns: str,
    recorded_sandbox: Recorder,
    access_roles: None,
) -> None:
    box = f"/v1/namespaces/{ns}/sandboxes/box"
    admin = _account(kube, ns, "admin-user", cluster_role=f"{RELEASE}-user")
    status, _ = _request(gateway, "POST", f"{box}/files/mkdir", admin, {"path": "dir/sub"})
    assert status == 200
    status, _ = _request(
        gateway, "POST", f"{box}/executions", admin, {"command": "ln -s dir link && echo x > f"}
    )
    assert status == 200
    # A files:read token that lives 3 s mints a URL asked for a day: it ends with the token.
    status, minted = _request(
        gateway, "POST", f"{box}/tokens", admin, {"operations": ["files:read"], "ttlSeconds": 3}
    )
    assert status == 201, minted
    short = minted["token"]
    status, signed = _request(
        gateway, "POST", f"{box}/urls", short, {"path": "f", "ttlSeconds": 86400}
    )
    assert status == 201, signed
    assert signed["expiresAt"] <= minted["expiresAt"]
    assert _request(gateway, "GET", signed["path"], None)[0] == 200
    time.sleep(4)
    assert _request(gateway, "GET", f"{box}/info", short)[0] == 401
    status, refused = _request(gateway, "GET", signed["path"], None)
    assert (status, refused["error"]["code"]) == (401, "invalid_signature"), refused
    assert "expired" in refused["error"]["message"]
    # A ServiceAccount token of 10 minutes (its `exp`) caps a token asked for a day.
    sa = service_account_token(kube, ns, "admin-user", seconds=600)
    status, long = _request(
        gateway, "POST", f"{box}/tokens", sa, {"operations": ["exec"], "ttlSeconds": 86400}
    )
    assert status == 201, long
    lived = datetime.fromisoformat(long["expiresAt"]) - datetime.now(UTC)
    assert lived.total_seconds() <= 601, long
    # Paths that name nothing in the workspace are refused when the URL is asked for.
    for path in ("../../etc/passwd", "/etc/passwd", "%2e%2e/x", "a/../../b", "a\\b"):
        status, body = _request(gateway, "POST", f"{box}/urls", admin, {"path": path})
        assert (status, body["error"]["code"]) == (400, "invalid_request"), (path, body)
    # A symlink to a directory downloads as the directory does: a tar.
    status, signed = _request(gateway, "POST", f"{box}/urls", admin, {"path": "link"})
    assert status == 201
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=60)
    connection.request("GET", signed["path"])
    answer = connection.getresponse()
    data = answer.read()
    assert answer.status == 200, data
    assert 'filename="link.tar"' in answer.getheader("Content-Disposition", "")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert any(name.endswith("sub") for name in tar.getnames()), tar.getnames()
    # Unknown names get the same answer as known ones without a credential.
    for name in ("box", "nosuch"):
        path = f"/v1/namespaces/{ns}/sandboxes/{name}"
        assert _request(gateway, "GET", f"{path}/info", None)[0] == 401
        assert _request(gateway, "POST", f"{path}/tokens", None, {"operations": ["exec"]})[0] == 401
        assert _request(gateway, "POST", f"{path}/urls", None, {"path": "f"})[0] == 401
        status, body = _request(gateway, "GET", f"{path}/download?path=f&exp=9&kid=k&sig=s", None)
        assert (status, body["error"]["code"]) == (401, "invalid_signature")


@pytest.fixture
def strict_gateway(gateway: GatewayProcess, tmp_path: Path) -> Iterator[GatewayProcess]:
    """A second gateway replica with short connection deadlines and a low cap."""
    process = GatewayProcess(
        gateway.kubeconfig,
        tmp_path,
        {
            "SANDBOX_GATEWAY_HEAD_SECONDS": "1",
            "SANDBOX_GATEWAY_IDLE_SECONDS": "2",
            "SANDBOX_GATEWAY_CONNECTIONS_PER_CLIENT": "30",
        },
    )
    process.start()
    yield process
    process.stop()
    assert process.errors() == [], f"handler tracebacks in {process.log}"


def test_idle_trickling_and_too_many_connections_are_closed(
    strict_gateway: GatewayProcess,
) -> None:
    def closed(sock: socket.socket, within: float) -> bool:
        sock.settimeout(within)
        try:
            return sock.recv(1) == b""
        except (TimeoutError, ConnectionResetError):
            return False

    silent = socket.create_connection(("127.0.0.1", strict_gateway.port))
    trickle = socket.create_connection(("127.0.0.1", strict_gateway.port))
    cut = False
    for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 100:
        try:
            trickle.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            cut = True  # closed by the gateway while the head still trickled in
            break
        time.sleep(0.05)
    assert closed(silent, 5), "a connection that sent nothing was kept"
    assert cut or closed(trickle, 5), "a request head sent a byte at a time was kept"
    # Between requests a kept-alive connection may idle up to idle_seconds.
    kept = http.client.HTTPConnection("127.0.0.1", strict_gateway.port, timeout=10)
    kept.request("GET", "/healthz")
    assert kept.getresponse().read()
    time.sleep(1.2)  # longer than the head deadline, shorter than the idle one
    kept.request("GET", "/healthz")
    assert kept.getresponse().status == 200
    assert kept.sock is not None
    assert closed(kept.sock, 5), "an idle kept-alive connection was kept"
    # Past the per-client cap a connection is refused with a 503 it can read.
    held = [socket.create_connection(("127.0.0.1", strict_gateway.port)) for _ in range(30)]
    try:
        extra = socket.create_connection(("127.0.0.1", strict_gateway.port))
        extra.settimeout(5)
        answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert b"too_many_connections" in answer
    finally:
        for sock in held:
            sock.close()
    metrics = strict_gateway.metrics()
    assert 'sandbox_gateway_connections_closed_total{reason="deadline"}' in metrics
    assert 'sandbox_gateway_connections_closed_total{reason="limit"}' in metrics


def _stream_lines(gateway: GatewayProcess, box: str, token: str, command: str) -> Any:
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=60)
    connection.request(
        "POST",
        f"{box}/executions/stream",
        body=json.dumps({"command": command}),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    answer = connection.getresponse()
    assert answer.status == 200
    return answer


def test_a_stream_never_ends_silently(
    gateway: GatewayProcess,
    kube: KubeJSON,
    ns: str,
    sandboxes: Sandboxes,
    node: Node,
    agents: Any,
    tmp_path: Path,
    access_roles: None,
) -> None:
    """A replica that is stopped drains (not ready, still serving, closing each
    connection after its answer); a stream it then cuts, or one cut by the
    agent going away, ends with an `interrupted` event the client can tell
    from an end."""
    sandboxes.create("box", {"runtime": "python"})
    wait_for(lambda: kube.get(core_path("pods", ns, "box")) is not None, 20, "pod box")
    agent: AgentProcess = agents(secret_token(kube, ns, "box"))
    node.run_pod(ns, "box", agent.ip)
    sandboxes.wait_phase("box", "Running")
    box = f"/v1/namespaces/{ns}/sandboxes/box"
    admin = _account(kube, ns, "admin-user", cluster_role=f"{RELEASE}-user")
    replica = GatewayProcess(gateway.kubeconfig, tmp_path, {"SANDBOX_GATEWAY_DRAIN_SECONDS": "4"})
    replica.start()
    try:
        answer = _stream_lines(replica, box, admin, "echo start; sleep 30; echo end")
        first = json.loads(answer.readline())
        assert first["type"] in ("started", "output")
        replica.terminate()
        wait_for(
            lambda: _request(replica, "GET", "/readyz", None)[0] == 503,
            3,
            "readyz 503 while draining",
        )
        assert _request(replica, "GET", "/readyz", None)[1]["status"] == "draining"
        # New connections are still served while the Service catches up.
        status, headers, _ = _exchange(replica, "GET", f"{box}/info", admin)
        assert status == 200
        assert headers.get("Connection", "").lower() == "close", headers
        events = [json.loads(line) for line in answer.read().splitlines() if line.strip()]
        assert replica.proc is not None
        assert replica.proc.wait(20) == 0
    finally:
        replica.stop()
    assert events[-1]["type"] == "interrupted", events
    assert events[-1]["error"]["code"] == "gateway_shutdown"

    answer = _stream_lines(gateway, box, admin, "echo start; sleep 30; echo end")
    assert json.loads(answer.readline())["type"] in ("started", "output")
    assert agent.agent is not None
    agent.agent.kill()
    events = [json.loads(line) for line in answer.read().splitlines() if line.strip()]
    assert events[-1]["type"] == "interrupted", events
    assert events[-1]["error"]["code"] in ("upstream_lost", "upstream_ended")


def _raw(gateway: GatewayProcess, data: bytes, timeout: float = 10) -> bytes:
    """Send bytes as they are; the whole answer (the gateway closes after it)."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def test_hostile_requests_get_a_plain_refusal(
    gateway: GatewayProcess,
    kube: KubeJSON,
    ns: str,
    recorded_sandbox: Recorder,
    access_roles: None,
) -> None:
    """What an attacker sends gets a 4xx in the usual JSON shape: never a 500, a
    dropped connection, or a header it wrote itself (the fixture also fails on
    any traceback in the gateway's log)."""
    box = f"/v1/namespaces/{ns}/sandboxes/box"
    admin = _account(kube, ns, "admin-user", cluster_role=f"{RELEASE}-user")
    status, minted = _request(
        gateway, "POST", f"{box}/tokens", admin, {"operations": ["ports"], "ttlSeconds": 600}
    )
    assert status == 201
    scoped = minted["token"]
    nested = "sbxt1." + base64.urlsafe_b64encode(b"[" * 3000).rstrip(b"=").decode() + ".x"
    ports = f"{box}/ports/17000/"

    def get(target: str, header: bytes = b"") -> bytes:
        return f"GET {target} HTTP/1.1\r\nHost: x\r\n".encode() + header + b"\r\n"

    cases: list[tuple[bytes, int]] = [
        (get(f"{box}/info", b"Authorization: Bearer \xff\r\n"), 401),
        (get(ports, b"Cookie: sandbox-preview=\xff\r\n"), 401),
        (get(f"{box}/info", f"Authorization: Bearer {nested}\r\n".encode()), 401),
        (get(f"{ports}?token={nested}"), 401),
        # A valid token with bytes after it would write its own cookie attributes.
        (get(f"{ports}?token={scoped}=%3B%20Max-Age=9"), 401),
        (get(f"{ports}?token={scoped}%0d%0aX-Injected:%20yes"), 401),
    ]
    for body in ('{"operations": [[1]]}', '{"operations": [{}]}', "[" * 100000):
        head = (
            f"POST {box}/tokens HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {admin}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        cases.append((head.encode() + body.encode(), 400))
    body = json.dumps({"path": "\ud800"})
    cases.append(
        (
            (
                f"POST {box}/urls HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {admin}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
            ).encode(),
            400,
        )
    )
    for request, wanted in cases:
        answer = _raw(
            gateway, request.replace(b"HTTP/1.1\r\nHost", b"HTTP/1.1\r\nConnection: close\r\nHost")
        )
        status_and_headers, _, payload = answer.partition(b"\r\n\r\n")
        assert status_and_headers.startswith(f"HTTP/1.1 {wanted}".encode()), (
            request[:120],
            answer[:300],
        )
        assert b"X-Injected" not in status_and_headers, status_and_headers
        assert b"Max-Age=9" not in status_and_headers, status_and_headers
        assert json.loads(payload)["error"]["code"], payload

    # HEAD of an event stream: headers only, and the next answer on the connection is whole.
    execution = _started(gateway, admin, ns, "echo hi")
    pipelined = (
        f"HEAD {box}/executions/{execution}/stream HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {admin}\r\n\r\n"
        f"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    ).encode()
    answer = _raw(gateway, pipelined)
    first, _, rest = answer.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200"), answer[:300]
    assert rest.startswith(b"HTTP/1.1 200"), rest[:300]
    assert rest.rstrip().endswith(b'{"status": "ok"}'), rest


def test_a_body_that_never_comes_does_not_hold_a_connection(
    strict_gateway: GatewayProcess,
    kube: KubeJSON,
    ns: str,
    recorded_sandbox: Recorder,
    access_roles: None,
) -> None:
    box = f"/v1/namespaces/{ns}/sandboxes/box"
    admin = _account(kube, ns, "admin-user", cluster_role=f"{RELEASE}-user")
    started = time.monotonic()
    # Without credentials: refused before the body is read.
    answer = _raw(
        strict_gateway,
        f"POST {box}/tokens HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n".encode(),
        timeout=15,
    )
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    # With them: the body must come within the head deadline (1 s here).
    answer = _raw(
        strict_gateway,
        (
            f"POST {box}/urls HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {admin}\r\n"
            "Content-Length: 100\r\n\r\n{"
        ).encode(),
        timeout=15,
    )
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - started < 12
