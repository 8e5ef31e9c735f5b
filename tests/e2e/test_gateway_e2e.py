"""The gateway on a real node, as clients in the cluster use it: through its
Service and cluster DNS, under RBAC, with the sandboxes' NetworkPolicies
enforced, and with one replica killed mid-stream."""

from __future__ import annotations

import json
import textwrap
import time
import urllib.parse
import uuid

import pytest

from devcluster import deploy
from tests.e2e.agent import Agent
from tests.e2e.conftest import E2E
from tests.executions import Executions
from tests.integration.harness import wait_for
from tests.kube import JSON, api_path, core_path
from tests.sandboxes import Sandboxes

pytestmark = pytest.mark.timeout(1800)

GATEWAY = f"http://{deploy.RELEASE}-gateway.{deploy.NAMESPACE}.svc"
IMAGE = "sandbox-runtime-python:dev"
RBAC = "rbac.authorization.k8s.io/v1"

# Runs in a client pod: calls the gateway with the pod's own ServiceAccount
# token, and the sandbox's agent directly; prints one JSON line of findings.
CLIENT = textwrap.dedent(
    """
    import json, socket, sys, urllib.error, urllib.request
    gateway, ns, sandbox, agent_ip = sys.argv[1:5]
    token = open("/var/run/secrets/kubernetes.io/serviceaccount/token").read().strip()
    base = f"{gateway}/v1/namespaces/{ns}/sandboxes/{sandbox}"
    def call(method, path, body=None):
        request = urllib.request.Request(
            base + path, method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()
    found = {}
    found["stream"] = call("POST", "/executions/stream",
                           {"command": "for i in 1 2 3; do echo $i; sleep 0.2; done"})
    found["write"] = call("POST", "/files/write",
                          {"path": "from-client.txt", "content": "hello", "parents": True})
    found["read"] = call("GET", "/files/content?path=from-client.txt")
    # A walk from a files route to the exec API, through the Service: refused
    # before any permission is decided.
    found["walk"] = call("POST", "/files/%2e%2e/executions", {"command": "id"})
    try:
        with socket.create_connection((agent_ip, 8080), timeout=5) as direct:
            direct.sendall(b"GET /healthz HTTP/1.0\\r\\n\\r\\n")
            found["direct"] = direct.recv(100).decode(errors="replace")
    except OSError as error:
        found["direct"] = f"refused: {error.__class__.__name__}"
    print(json.dumps(found))
    """
)


def _client_pod(e2e: E2E, ns: str, name: str, account: str, args: list[str]) -> JSON:
    """Run CLIENT in a pod of `ns` as ServiceAccount `account`; its findings."""
    e2e.kube.create(
        core_path("pods", ns),
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "serviceAccountName": account,
                "restartPolicy": "Never",
                "securityContext": {
                    "runAsNonRoot": True,
                    "runAsUser": 1000,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
                "containers": [
                    {
                        "name": "client",
                        "image": IMAGE,
                        "imagePullPolicy": "Never",
                        "command": ["python3", "-c", CLIENT, *args],
                        "securityContext": {
                            "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]},
                        },
                    }
                ],
            },
        },
    )

    def finished() -> JSON | None:
        pod = e2e.kube.read(core_path("pods", ns, name))
        return pod if pod["status"].get("phase") in ("Succeeded", "Failed") else None

    wait_for(finished, 180, f"client pod {name}")
    logs = e2e.kubectl("logs", "-n", ns, name)
    assert logs.returncode == 0, logs.stderr
    found: JSON = json.loads(logs.stdout.strip().splitlines()[-1])
    return found


def _account(e2e: E2E, ns: str, name: str, role: str | None, sandbox_ns: str) -> None:
    e2e.kube.create(
        core_path("serviceaccounts", ns), {"apiVersion": "v1", "metadata": {"name": name}}
    )
    if role:
        e2e.kube.create(
            api_path(RBAC, "rolebindings", sandbox_ns),
            {
                "apiVersion": RBAC,
                "kind": "RoleBinding",
                "metadata": {"name": f"{ns}-{name}"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": f"{deploy.RELEASE}-{role}",
                },
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
            },
        )


def test_a_service_in_another_namespace_uses_a_sandbox_through_the_gateway(e2e: E2E) -> None:
    """Bound to the user role: streams a command and edits files through the
    gateway's Service (cluster DNS, kube-proxy). Not bound: 403. Either way,
    the agent itself is out of reach (the sandbox's NetworkPolicy, enforced)."""
    ns, clients = e2e.namespace(), e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("shared")
    body = sandboxes.wait_ready("shared")
    agent_ip = body["status"]["podIP"]
    _account(e2e, clients, "backend", "user", ns)
    _account(e2e, clients, "stranger", None, ns)
    args = [GATEWAY, ns, "shared", agent_ip]

    found = _client_pod(e2e, clients, "backend", "backend", args)
    status, stream = found["stream"]
    assert status == 200, stream
    events = [json.loads(line) for line in stream.splitlines() if line]
    assert "".join(e.get("data", "") for e in events if e["type"] == "output") == "1\n2\n3\n"
    assert found["write"][0] in (200, 201), found["write"]
    assert found["read"] == [200, "hello"]
    assert found["walk"][0] == 400, found["walk"]
    assert found["direct"].startswith("refused"), found["direct"]

    refused = _client_pod(e2e, clients, "stranger", "stranger", args)
    assert refused["stream"][0] == 403
    assert "sandboxes/exec" in refused["stream"][1]
    assert refused["walk"][0] == 400, refused["walk"]
    assert refused["direct"].startswith("refused"), refused["direct"]


PROBE = textwrap.dedent(
    """
    import json, socket, sys
    found = {}
    for label, host, port in json.loads(sys.argv[1]):
        try:
            with socket.create_connection((host, port), timeout=3):
                found[label] = "connected"
        except OSError as error:
            found[label] = error.__class__.__name__
    try:
        socket.getaddrinfo("kubernetes.default.svc.cluster.local", 443)
        found["dns"] = "resolved"
    except OSError as error:
        found["dns"] = error.__class__.__name__
    print(json.dumps(found))
    """
)


def test_sandboxes_are_isolated_by_their_egress_policy(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("open", {"network": {"egress": "Internet"}})
    sandboxes.create("closed", {"network": {"egress": "None"}})
    sandboxes.create("other")
    other_ip = sandboxes.wait_ready("other")["status"]["podIP"]
    api = e2e.kube.read(core_path("services", "default", "kubernetes"))["spec"]["clusterIP"]
    # The API server where it listens: the node's own address, reached through
    # the input hook rather than forwarded.
    server = urllib.parse.urlsplit(e2e.cluster.server)
    targets = [
        ("other_agent", other_ip, 8080),
        ("api_server", api, 443),
        ("api_server_node", server.hostname, server.port),
        ("metadata", "169.254.169.254", 80),
        ("private", "10.255.255.1", 80),
        ("gateway", f"{deploy.RELEASE}-gateway.{deploy.NAMESPACE}.svc.cluster.local", 80),
    ]
    runs = Executions(e2e.kube, ns)
    for name in ("open", "closed"):
        sandboxes.wait_ready(name)
        runs.create(
            f"probe-{name}",
            {
                "sandboxRef": {"name": name},
                "command": ["python3", "-c", PROBE, json.dumps(targets)],
                "timeout": "2m",
            },
        )
    results = {}
    for name in ("open", "closed"):
        status = runs.wait_done(f"probe-{name}", timeout=180)
        assert status["phase"] == "Succeeded", status
        results[name] = json.loads(status["stdout"])
    # Internet: DNS works, nothing private, internal or metadata does.
    assert results["open"]["dns"] == "resolved", results
    for label in ("other_agent", "api_server", "api_server_node", "metadata", "private"):
        assert results["open"][label] != "connected", (label, results)
    # None: nothing at all, not even DNS.
    assert results["closed"]["dns"] != "resolved", results
    for label, _, _ in targets:
        assert results["closed"][label] != "connected", (label, results)


PREVIEW_SERVER = textwrap.dedent(
    """
    import base64, hashlib, http.server, socketserver
    GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.headers.get("Upgrade", "").lower() == "websocket":
                key = self.headers["Sec-WebSocket-Key"]
                accept = base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()
                self.send_response(101)
                self.send_header("Upgrade", "websocket")
                self.send_header("Connection", "Upgrade")
                self.send_header("Sec-WebSocket-Accept", accept)
                self.end_headers()
                head = self.rfile.read(2)
                length = head[1] & 0x7F
                mask = self.rfile.read(4)
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(length)))
                reply = b"echo:" + data
                self.wfile.write(bytes([0x81, len(reply)]) + reply)
                self.wfile.flush()
                return
            body = f"served {self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    socketserver.TCPServer.allow_reuse_address = True
    http.server.ThreadingHTTPServer(("0.0.0.0", 8000), Handler).serve_forever()
    """
)


def test_a_preview_port_serves_http_and_a_websocket(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create(
        "site", {"network": {"exposedPorts": [{"name": "web", "port": 8000, "public": True}]}}
    )
    sandboxes.wait_ready("site")
    agent = Agent.of(e2e.kube, ns, "site")
    agent.write("server.py", PREVIEW_SERVER)
    agent.start("python3 server.py")
    status = sandboxes.read("site")["status"]
    url = status["ports"][0]["url"]
    assert url == f"{GATEWAY}/v1/namespaces/{ns}/sandboxes/site/ports/8000/"
    page = _from_host(e2e, url + "index.html")
    assert page == "served /index.html"
    assert _websocket_from_host(e2e, url.replace("http://", "ws://") + "ws") == "echo:hi"


def _service_url(e2e: E2E, url: str) -> str:
    """The gateway's URL by its ClusterIP (the test runs on the node, outside DNS)."""
    service = e2e.kube.read(core_path("services", deploy.NAMESPACE, f"{deploy.RELEASE}-gateway"))
    return url.replace(
        f"{deploy.RELEASE}-gateway.{deploy.NAMESPACE}.svc", service["spec"]["clusterIP"]
    )


def _from_host(e2e: E2E, url: str) -> str:
    import httpx

    def fetched() -> str | None:
        response = httpx.get(_service_url(e2e, url), timeout=10)
        return response.text if response.status_code == 200 else None

    return wait_for(fetched, 60, f"{url} served")


def _websocket_from_host(e2e: E2E, url: str) -> str:
    import asyncio

    import aiohttp

    async def talk() -> str:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(_service_url(e2e, url)) as ws,
        ):
            await ws.send_str("hi")
            message = await ws.receive(timeout=10)
            return str(message.data)

    return asyncio.run(talk())


def test_a_gateway_replica_killed_mid_stream(e2e: E2E) -> None:
    """The stream it carried ends (the caller sees it end); new requests go to
    the other replica at once."""
    import httpx

    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("long")
    sandboxes.wait_ready("long")
    admin_token = _admin_token(e2e, ns)
    base = _service_url(e2e, f"{GATEWAY}/v1/namespaces/{ns}/sandboxes/long")
    headers = {"Authorization": f"Bearer {admin_token}"}
    pods = e2e.kube.list(
        core_path("pods", deploy.NAMESPACE), "app.kubernetes.io/name=sandbox-gateway"
    )
    assert len(pods) == 2, [p["metadata"]["name"] for p in pods]
    with (
        httpx.Client(timeout=60) as http,
        http.stream(
            "POST",
            f"{base}/executions/stream",
            headers=headers,
            json={"command": "for i in $(seq 1 600); do echo $i; sleep 0.1; done"},
        ) as stream,
    ):
        lines = stream.iter_lines()
        first = json.loads(next(lines))
        assert first["type"] == "started"
        carrier = _carrier(e2e, pods)
        e2e.kube.delete(core_path("pods", deploy.NAMESPACE, carrier) + "?gracePeriodSeconds=0")
        ended = False
        try:
            for line in lines:
                if line and json.loads(line)["type"] == "finished":
                    break
            ended = True
        except httpx.HTTPError:
            ended = True
        assert ended
    # The other replica serves new requests. Until the Service's endpoints drop the
    # killed pod (the endpoint controller, then kube-proxy: seconds on a busy node)
    # a connection may still be sent to it and refused; nothing reached a gateway
    # then, so a client tries again, as the SDK does.
    started = time.monotonic()
    refused = 0
    with httpx.Client(timeout=30) as http:
        for _ in range(10):
            while True:
                try:
                    done = http.post(
                        f"{base}/executions", headers=headers, json={"command": "true"}
                    )
                    break
                except httpx.ConnectError:
                    refused += 1
                    assert time.monotonic() - started < 30, f"{refused} connections refused"
                    time.sleep(0.2)
            assert done.status_code == 200, done.text
    print(f"after the kill: 10 requests in {time.monotonic() - started:.1f}s, {refused} refused")
    assert time.monotonic() - started < 30


def _carrier(e2e: E2E, pods: list[JSON]) -> str:
    """The gateway pod with the open stream (its own metrics say so)."""
    for pod in pods:
        name = pod["metadata"]["name"]
        metrics = e2e.kubectl(
            "get", "--raw", f"/api/v1/namespaces/{deploy.NAMESPACE}/pods/{name}:9090/proxy/metrics"
        )
        if "sandbox_gateway_requests_in_flight 1.0" in metrics.stdout:
            return str(name)
    return str(pods[0]["metadata"]["name"])


def _admin_token(e2e: E2E, ns: str) -> str:
    name = f"admin-{uuid.uuid4().hex[:6]}"
    _account(e2e, ns, name, "user", ns)
    issued = e2e.kube.create(
        core_path("serviceaccounts", ns, name, "token"),
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}},
    )
    token: str = issued["status"]["token"]
    return token
