"""sandbox-gateway against a real API server (TokenReview and SubjectAccessReview
against real RBAC, the chart's own roles) and real agents on loopback."""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import socket
import subprocess
import tarfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import httpx

from devcluster.controlplane import ControlPlane
from sandbox_sdk import AsyncSandboxClient, SandboxClient
from tests.integration.conftest import OPERATOR_ENV, RELEASE
from tests.integration.harness import (
    AgentProcess,
    GatewayProcess,
    Node,
    OperatorProcess,
    secret_token,
    service_account_token,
    wait_for,
)
from tests.kube import KubeJSON, api_path, core_path
from tests.pools import Kubelet, Pools, members
from tests.sandboxes import Sandboxes
from tests.templates import Templates

LiveSandbox = Callable[..., AgentProcess]


def caller(kube: KubeJSON, ns: str, name: str, role: str | None) -> str:
    """A ServiceAccount `name` in `ns` bound to the chart's `role` (user, viewer or
    none), and a token of it."""
    kube.create(
        core_path("serviceaccounts", ns),
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
    )
    if role is not None:
        rbac = "rbac.authorization.k8s.io/v1"
        kube.create(
            api_path(rbac, "rolebindings", ns),
            {
                "apiVersion": rbac,
                "kind": "RoleBinding",
                "metadata": {"name": f"{name}-{role}"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": f"{RELEASE}-{role}",
                },
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
            },
        )
    return service_account_token(kube, ns, name, seconds=3600)


def client(gateway: GatewayProcess, ns: str, sandbox: str, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(
        base_url=f"{gateway.url}/v1/namespaces/{ns}/sandboxes/{sandbox}",
        headers=headers,
        timeout=60,
    )


def code(response: httpx.Response) -> str:
    return str(response.json()["error"]["code"])


def test_a_user_runs_commands_and_edits_files_through_the_gateway(
    gateway: GatewayProcess, kube: KubeJSON, ns: str, live_sandbox: LiveSandbox
) -> None:
    live_sandbox("box")
    token = caller(kube, ns, "alice", "user")
    with client(gateway, ns, "box", token) as http:
        ran = http.post("/executions", json={"command": "echo hello; echo oops >&2; exit 3"})
        assert ran.status_code == 200, ran.text
        assert (ran.json()["stdout"], ran.json()["stderr"], ran.json()["exitCode"]) == (
            "hello\n",
            "oops\n",
            3,
        )
        # Streaming, event by event.
        with http.stream(
            "POST", "/executions/stream", json={"command": "for i in 1 2 3; do echo $i; done"}
        ) as stream:
            events = [json.loads(line) for line in stream.iter_lines() if line]
        output = "".join(e["data"] for e in events if e["type"] == "output")
        assert output == "1\n2\n3\n"
        assert events[-1]["type"] == "finished"
        # A background job with stdin, then its output by cursor.
        job = http.post(
            "/executions", json={"command": "cat", "background": True, "stdinOpen": True}
        ).json()
        wrote = http.post(f"/executions/{job['id']}/stdin", json={"data": "typed\n", "close": True})
        assert wrote.status_code == 200, wrote.text
        tail = http.get(f"/executions/{job['id']}/output", params={"waitSeconds": "5"})
        assert "typed" in tail.text, tail.text
        # Files: write, read, list, search, patch.
        assert http.post(
            "/files/write", json={"path": "src/a.txt", "content": "one\ntwo\n", "parents": True}
        ).status_code in (200, 201)
        assert http.get("/files/content", params={"path": "src/a.txt"}).text == "one\ntwo\n"
        listed = http.get("/files/list", params={"path": "src"}).json()
        assert [e["name"] for e in listed["entries"]] == ["a.txt"]
        found = http.post("/files/search", json={"pattern": "tw", "path": "."}).json()
        assert found["matches"][0]["path"] == "src/a.txt"
        patch = "--- a/src/a.txt\n+++ b/src/a.txt\n@@ -1,2 +1,2 @@\n one\n-two\n+three\n"
        assert http.post("/files/patch", json={"patch": patch}).status_code == 200
        assert http.get("/files/content", params={"path": "src/a.txt"}).text == "one\nthree\n"
        # A tar up and down, streamed.
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            data = b"x" * (3 << 20)
            info = tarfile.TarInfo("big.bin")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        up = http.put("/files/archive", params={"path": "up"}, content=archive.getvalue())
        assert up.status_code in (200, 201), up.text
        down = http.get("/files/archive", params={"path": "up"})
        with tarfile.open(fileobj=io.BytesIO(down.content)) as tar:
            names = {m.name.removeprefix("./"): m for m in tar.getmembers()}
            member = tar.extractfile(names["big.bin"])
            assert member is not None
            assert len(member.read()) == 3 << 20
        # Info is served; the operator's own endpoints are not.
        assert http.get("/info").status_code == 200
        assert http.post("/workspace/quiesce", json={}).status_code == 404
        assert http.get("/environment").status_code == 404


def test_who_may_do_what_is_decided_by_rbac(
    gateway: GatewayProcess, kube: KubeJSON, ns: str, live_sandbox: LiveSandbox
) -> None:
    agent = live_sandbox("box")
    (agent.workspace / "readme.txt").write_text("hi\n")
    viewer = caller(kube, ns, "vera", "viewer")
    stranger = caller(kube, ns, "bob", None)
    with client(gateway, ns, "box", viewer) as http:
        assert http.get("/files/content", params={"path": "readme.txt"}).text == "hi\n"
        refused = http.post("/executions", json={"command": "true"})
        assert refused.status_code == 403
        assert "create sandboxes/exec.sandbox.dev" in refused.json()["error"]["message"]
        write = http.post("/files/write", json={"path": "x", "content": "y"})
        assert write.status_code == 403
        assert "update sandboxes/files.sandbox.dev" in write.json()["error"]["message"]
    with client(gateway, ns, "box", stranger) as http:
        refused = http.get("/files/content", params={"path": "readme.txt"})
        assert refused.status_code == 403
        assert f"system:serviceaccount:{ns}:bob" in refused.json()["error"]["message"]
    with client(gateway, ns, "box", None) as http:
        assert http.get("/info").status_code == 401
    with client(gateway, ns, "box", "not-a-token") as http:
        assert http.get("/info").status_code == 401


def test_errors_say_what_is_wrong(
    gateway: GatewayProcess,
    kube: KubeJSON,
    ns: str,
    sandboxes: Sandboxes,
    live_sandbox: LiveSandbox,
) -> None:
    token = caller(kube, ns, "alice", "user")
    with client(gateway, ns, "nowhere", token) as http:
        missing = http.get("/info")
        assert (missing.status_code, code(missing)) == (404, "sandbox_not_found")
    sandboxes.create("starting")  # no node plays its pod: it never gets ready
    wait_for(lambda: gateway_route(gateway, ns, "starting", token), 20, "the route")
    with client(gateway, ns, "starting", token) as http:
        waiting = http.get("/info")
        assert (waiting.status_code, code(waiting)) == (503, "sandbox_not_ready")
        assert waiting.headers["Retry-After"] == "2"
    sandboxes.create("held", {"paused": True})
    wait_for(lambda: gateway_route(gateway, ns, "held", token), 20, "the route")
    with client(gateway, ns, "held", token) as http:
        held = http.get("/info")
        assert (held.status_code, code(held)) == (409, "sandbox_paused")
    # An agent error passes through with its own body.
    live_sandbox("box")
    with client(gateway, ns, "box", token) as http:
        absent = http.get("/files/content", params={"path": "nope.txt"})
        assert absent.status_code == 404
        assert code(absent) != "sandbox_not_found"


def gateway_route(gateway: GatewayProcess, ns: str, name: str, token: str) -> bool:
    """Whether the gateway's table knows the sandbox (anything but 404)."""
    response = httpx.get(
        f"{gateway.url}/v1/namespaces/{ns}/sandboxes/{name}/info",
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    return response.status_code != 404


def test_an_idle_paused_sandbox_is_resumed_for_a_request(
    gateway: GatewayProcess,
    kube: KubeJSON,
    ns: str,
    sandboxes: Sandboxes,
    live_sandbox: LiveSandbox,
) -> None:
    live_sandbox("sleepy", {"lifecycle": {"idleTimeout": "2s", "onIdle": "Pause"}})
    sandboxes.wait_phase("sleepy", "Paused", timeout=30)
    wait_for(lambda: kube.get(core_path("pods", ns, "sleepy")) is None, 30, "pod deleted")
    token = caller(kube, ns, "alice", "user")
    # Play the node for the new pod while the request waits in the gateway.
    node = threading.Thread(target=live_sandbox, args=("sleepy",), kwargs={"create": False})
    node.start()
    with client(gateway, ns, "sleepy", token) as http:
        ran = http.post("/executions", json={"command": "echo back"})
    node.join(60)
    assert ran.status_code == 200, ran.text
    assert ran.json()["stdout"] == "back\n"


def test_scoped_tokens_and_signed_urls(
    gateway: GatewayProcess,
    kube: KubeJSON,
    ns: str,
    sandboxes: Sandboxes,
    live_sandbox: LiveSandbox,
) -> None:
    agent = live_sandbox("box")
    (agent.workspace / "report").mkdir()
    (agent.workspace / "report" / "data.csv").write_text("a,b\n1,2\n")
    alice = caller(kube, ns, "alice", "user")
    vera = caller(kube, ns, "vera", "viewer")
    with client(gateway, ns, "box", alice) as http:
        minted = http.post("/tokens", json={"operations": ["exec"], "ttlSeconds": 300})
        assert minted.status_code == 201, minted.text
        scoped = minted.json()["token"]
        signed = http.post("/urls", json={"path": "report/data.csv", "ttlSeconds": 300})
        assert signed.status_code == 201, signed.text
        url = signed.json()["path"]
        folder = http.post("/urls", json={"path": "report", "ttlSeconds": 300}).json()["path"]
        short = http.post("/urls", json={"path": "report/data.csv", "ttlSeconds": 1}).json()["path"]
    with client(gateway, ns, "box", vera) as http:
        # A caller can hand on only what it holds itself.
        refused = http.post("/tokens", json={"operations": ["exec"], "ttlSeconds": 60})
        assert refused.status_code == 403
    with client(gateway, ns, "box", scoped) as http:
        assert (
            http.post("/executions", json={"command": "echo scoped"}).json()["stdout"] == "scoped\n"
        )
        assert http.get("/files/content", params={"path": "report/data.csv"}).status_code == 403
        assert http.post("/tokens", json={"operations": ["exec"]}).status_code == 403
    tampered = scoped[:-4] + ("AAAA" if not scoped.endswith("AAAA") else "BBBB")
    with client(gateway, ns, "box", tampered) as http:
        assert http.get("/info").status_code == 401

    # Signed URLs: no credentials; a file, or a directory as tar.
    got = httpx.get(gateway.url + url)
    assert got.status_code == 200, got.text
    assert got.text == "a,b\n1,2\n"
    assert 'filename="data.csv"' in got.headers["Content-Disposition"]
    tar = httpx.get(gateway.url + folder)
    assert tar.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(tar.content)) as archive:
        assert any(name.endswith("data.csv") for name in archive.getnames())
    # A URL that does not verify is a credential not accepted: 401, as a bad token.
    bad = url.replace("data.csv", "other.csv")
    assert bad != url
    assert httpx.get(gateway.url + bad).status_code == 401
    sig = url.split("sig=")[1].split("&")[0]
    assert httpx.get(gateway.url + url.replace(sig, sig[::-1])).status_code == 401
    time.sleep(2.1)
    expired = httpx.get(gateway.url + short)
    assert (expired.status_code, code(expired)) == (401, "invalid_signature")
    assert "expired" in expired.json()["error"]["message"]

    # A namesake made after the token refuses it (the token is bound to the UID).
    sandboxes.delete("box")
    sandboxes.wait_gone("box", 60, "the sandbox deleted")
    live_sandbox("box")
    with client(gateway, ns, "box", scoped) as http:
        stale = http.post("/executions", json={"command": "true"})
        assert stale.status_code == 403
        assert "deleted" in stale.json()["error"]["message"]
    assert httpx.get(gateway.url + url).status_code == 401


def _serve_preview(ip: str, port: int) -> Callable[[], None]:
    """An HTTP and WebSocket server where a sandbox's exposed port would be."""
    script = (
        "import asyncio\n"
        "from aiohttp import web\n"
        "async def page(request):\n"
        "    return web.Response(text=f'preview {request.path} {request.query_string}')\n"
        "async def echo(request):\n"
        "    ws = web.WebSocketResponse(protocols=('chat.v1',))\n"
        "    await ws.prepare(request)\n"
        "    await ws.send_str('hello ' + request.rel_url.raw_query_string)\n"
        "    async for message in ws:\n"
        "        await ws.send_str('echo:' + message.data)\n"
        "    return ws\n"
        "app = web.Application()\n"
        "app.router.add_get('/ws', echo)\n"
        "app.router.add_get('/{tail:.*}', page)\n"
        f"web.run_app(app, host='{ip}', port={port}, print=None)\n"
    )
    import sys

    proc = subprocess.Popen([sys.executable, "-c", script])

    def listening() -> bool:
        with socket.socket() as sock:
            return sock.connect_ex((ip, port)) == 0

    wait_for(listening, 30, f"the preview server on {ip}:{port}")

    def stop() -> None:
        # Killed, not asked to stop: its graceful shutdown is not under test, and
        # on a loaded machine (CI beside a CPU hog) it took longer than 10 s.
        proc.kill()
        proc.wait(30)

    return stop


def test_preview_ports_serve_http_and_websockets(
    gateway: GatewayProcess, kube: KubeJSON, ns: str, live_sandbox: LiveSandbox
) -> None:
    # Not 18000-18999: the node lane's tests give pods hostPorts there, which
    # DNAT every local connection to that port, whatever its address.
    ports = [
        {"name": "app", "port": 17000},
        {"name": "docs", "port": 17001, "public": True},
    ]
    agent = live_sandbox("web", {"network": {"exposedPorts": ports}})
    stops = [_serve_preview(agent.ip, 17000), _serve_preview(agent.ip, 17001)]
    try:
        base = f"{gateway.url}/v1/namespaces/{ns}/sandboxes/web/ports"
        assert httpx.get(f"{base}/17001/guide").text == "preview /guide "
        # A link's token is the gateway's: a public port's server never sees it.
        assert httpx.get(f"{base}/17001/guide?token=sbxt1.x.y&a=1&a=2").text == (
            "preview /guide a=1&a=2"
        )
        assert httpx.get(f"{base}/17000/").status_code == 401
        # Which ports exist is told only to a caller who may reach them.
        assert httpx.get(f"{base}/9999/").status_code == 401
        alice = caller(kube, ns, "alice", "user")
        for port in (9999, 8080):  # 8080: the agent's own port is never a preview port
            assert (
                httpx.get(
                    f"{base}/{port}/healthz", headers={"Authorization": f"Bearer {alice}"}
                ).status_code
                == 404
            )
        assert httpx.get(
            f"{base}/17000/app?x=1", headers={"Authorization": f"Bearer {alice}"}
        ).text == ("preview /app x=1")
        with client(gateway, ns, "web", alice) as http:
            scoped = http.post("/tokens", json={"operations": ["ports"], "ttlSeconds": 300}).json()[
                "token"
            ]
        with httpx.Client(follow_redirects=True) as browser:
            page = browser.get(f"{base}/17000/app", params={"token": scoped, "x": "2"})
            assert page.status_code == 200, page.text
            assert page.text == "preview /app x=2"
            assert "token=" not in str(page.url)
            again = browser.get(f"{base}/17000/other")  # the cookie carries on
            assert again.text == "preview /other "
        status = wait_for(
            lambda: kube.read(api_path("sandbox.dev/v1alpha1", "sandboxes", ns, "web"))[
                "status"
            ].get("ports"),
            20,
            "status.ports",
        )
        assert [p["port"] for p in status] == [17000, 17001]
        ws_base = base.replace("http://", "ws://")
        _websocket_echo(f"{ws_base}/17000/ws", alice, "room=a%20b&x=1", "room=a%20b&x=1")
        _websocket_echo(f"{ws_base}/17001/ws", None, "token=sbxt1.x.y&x=%2F", "x=%2F")
    finally:
        for stop in stops:
            stop()


def _websocket_echo(url: str, token: str | None, query: str, seen: str) -> None:
    """The handshake goes through whole: the query (`seen` by the app: without a
    link's token), the subprotocol and compression are the app's and the
    client's to agree on."""
    import asyncio

    import aiohttp

    big = "x" * 300_000 + "end"

    async def talk() -> tuple[list[str], str | None, int]:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(
                f"{url}?{query}",
                headers={"Authorization": f"Bearer {token}"} if token else {},
                protocols=("chat.v1",),
                compress=15,
            ) as ws,
        ):
            said = [str((await ws.receive(timeout=10)).data)]
            for text in ("ping", big):
                await ws.send_str(text)
                said.append(str((await ws.receive(timeout=10)).data))
            return said, ws.protocol, ws.compress

    said, protocol, compress = asyncio.run(talk())
    assert said == [f"hello {seen}", "echo:ping", "echo:" + big]
    assert (protocol, compress) == ("chat.v1", 15)


def test_a_warm_gateway_asks_the_api_server_nothing_per_call(
    gateway: GatewayProcess, kube: KubeJSON, ns: str, live_sandbox: LiveSandbox
) -> None:
    live_sandbox("box")
    token = caller(kube, ns, "alice", "user")

    def reviews() -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in gateway.metrics().splitlines()
            if line.startswith("sandbox_gateway_reviews_total{")
        )

    with client(gateway, ns, "box", token) as http:
        assert http.post("/executions", json={"command": "true"}).status_code == 200
        before = reviews()
        for _ in range(20):
            assert http.post("/executions", json={"command": "true"}).status_code == 200
        assert reviews() == before


def test_an_upload_the_caller_abandons_is_abandoned_by_the_agent(
    gateway: GatewayProcess, kube: KubeJSON, ns: str, live_sandbox: LiveSandbox
) -> None:
    """Bodies stream through (nothing waits for the whole of them), and a caller
    that goes away mid-upload is seen by the agent: no file is left."""
    agent = live_sandbox("box")
    token = caller(kube, ns, "alice", "user")
    path = f"/v1/namespaces/{ns}/sandboxes/box/files/content?path=partial.bin"
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        head = (
            f"PUT {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Length: {100 << 20}\r\n\r\n"
        )
        sock.sendall(head.encode() + b"z" * (4 << 20))
        time.sleep(1.0)
    time.sleep(2.0)
    assert not (agent.workspace / "partial.bin").exists()
    with client(gateway, ns, "box", token) as http:
        assert http.get("/info").status_code == 200


def test_a_compressed_body_arrives_whole_and_decoded(
    gateway: GatewayProcess, kube: KubeJSON, ns: str, live_sandbox: LiveSandbox
) -> None:
    """A caller's Content-Encoding is undone once, by the gateway: the agent gets
    every decoded byte (not as many as were sent encoded) and no encoding to
    undo again, whether the body is read whole or streamed."""
    agent = live_sandbox("box")
    token = caller(kube, ns, "alice", "user")
    small = b"small and squeezable " * 1000  # 21 KiB, a few hundred bytes gzipped
    large = bytes(range(256)) * 4096 + b"tail"  # 1 MiB, past the read-whole size
    with client(gateway, ns, "box", token) as http:
        for name, data, coding in (
            ("small.bin", small, "gzip"),
            ("large.bin", large, "gzip"),
            ("deflated.bin", large, "deflate"),
        ):
            packed = gzip.compress(data) if coding == "gzip" else zlib.compress(data)
            put = http.put(
                "/files/content",
                params={"path": name},
                content=packed,
                headers={"Content-Encoding": coding},
            )
            assert put.status_code in (200, 201), (name, put.text)
            assert (agent.workspace / name).read_bytes() == data, name
        ran = http.post(
            "/executions",
            content=gzip.compress(json.dumps({"command": "echo unpacked"}).encode()),
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )
        assert ran.status_code == 200, ran.text
        assert ran.json()["stdout"] == "unpacked\n"
        # A body that does not decode is the caller's error, said as such.
        broken = http.put(
            "/files/content",
            params={"path": "broken.bin"},
            content=b"not gzip at all" * 10000,
            headers={"Content-Encoding": "gzip"},
        )
        assert broken.status_code == 400, broken.text
        assert "Content-Encoding (gzip)" in broken.json()["error"]["message"]
        assert not (agent.workspace / "broken.bin").exists()


def test_nothing_a_caller_sends_is_a_server_error(
    gateway: GatewayProcess, kube: KubeJSON, ns: str, live_sandbox: LiveSandbox
) -> None:
    live_sandbox("box")
    token = caller(kube, ns, "alice", "user")
    attempts: list[tuple[str, str, dict[str, object]]] = [
        ("POST", "/tokens", {"content": b"{not json"}),
        ("POST", "/tokens", {"json": []}),
        ("POST", "/tokens", {"json": {"operations": ["exec"], "ttlSeconds": 10**12}}),
        ("POST", "/tokens", {"json": {"operations": ["root"]}}),
        ("POST", "/urls", {"json": {"path": 7}}),
        ("POST", "/urls", {"json": {"path": "x" * 5000}}),
        ("GET", "/download", {}),
        ("GET", "/download", {"params": {"path": "a", "exp": "soon", "kid": "?", "sig": "!"}}),
        ("GET", "/ports/notanumber/", {}),
        ("GET", "/ports/99999999999999999999/", {}),
        ("PATCH", "/executions", {"content": b"\x00\xff"}),
        ("POST", "/executions", {"content": b"\x00\xff"}),
        ("GET", "/files/content", {"params": {"path": "../../etc/passwd"}}),
        ("DELETE", "/files/../../../workspace", {}),
        ("GET", "/%2e%2e/%2e%2e/healthz", {}),
    ]
    with client(gateway, ns, "box", token) as http:
        for method, path, kwargs in attempts:
            response = http.request(method, path, **kwargs)  # type: ignore[arg-type]
            assert response.status_code < 500, (method, path, response.status_code, response.text)
            if response.status_code >= 400:
                assert response.json()["error"]["code"], (method, path, response.text)
    with httpx.Client(base_url=gateway.url) as raw:
        for path in ("/v1/namespaces/x", "/v1/namespaces//sandboxes//info", "/nothing"):
            response = raw.get(path, headers={"Authorization": "Bearer " + "A" * 10000})
            assert response.status_code < 500, (path, response.status_code, response.text)


def _peak_rss_kib(pid: int) -> int:
    """The process's high-water mark of resident memory (VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for {pid}")


def test_a_gibibyte_streams_both_ways_and_a_quiet_command_is_not_cut(
    gateway: GatewayProcess, kube: KubeJSON, ns: str, live_sandbox: LiveSandbox
) -> None:
    """1 GiB up as a tar and down again without the gateway holding it (its peak
    RSS barely moves), and a streamed command that prints nothing for longer than
    the usual proxy read timeouts (60 s) still reaches its end."""
    agent = live_sandbox("box")
    token = caller(kube, ns, "alice", "user")
    assert gateway.proc is not None
    size, chunk = 1 << 30, b"\0" * (1 << 20)

    def archive() -> Iterator[bytes]:
        header = tarfile.TarInfo("huge.bin")
        header.size = size
        yield header.tobuf(format=tarfile.PAX_FORMAT)
        for _ in range(size // len(chunk)):
            yield chunk
        yield b"\0" * (2 * tarfile.BLOCKSIZE)  # end of archive (size is block-aligned)

    before = _peak_rss_kib(gateway.proc.pid)
    with httpx.Client(
        base_url=f"{gateway.url}/v1/namespaces/{ns}/sandboxes/box",
        headers={"Authorization": f"Bearer {token}"},
        timeout=None,
    ) as http:
        up = http.put("/files/archive", params={"path": "in"}, content=archive())
        assert up.status_code in (200, 201), up.text
        assert (agent.workspace / "in" / "huge.bin").stat().st_size == size
        received = 0
        with http.stream("GET", "/files/archive", params={"path": "in"}) as down:
            assert down.status_code == 200
            for part in down.iter_bytes():
                received += len(part)
        assert received > size
        (agent.workspace / "in" / "huge.bin").unlink()
        grown_mib = (_peak_rss_kib(gateway.proc.pid) - before) / 1024
        assert grown_mib < 64, f"the gateway's peak RSS grew by {grown_mib:.0f} MiB for 1 GiB"

        with http.stream(
            "POST", "/executions/stream", json={"command": "echo start; sleep 65; echo end"}
        ) as stream:
            events = [json.loads(line) for line in stream.iter_lines() if line]
    output = "".join(e["data"] for e in events if e["type"] == "output")
    assert output == "start\nend\n"
    assert events[-1]["type"] == "finished"
    assert events[-1]["execution"]["exitCode"] == 0


def test_a_claimed_sandbox_is_served_and_its_pool_members_are_not(
    gateway: GatewayProcess,
    kube: KubeJSON,
    ns: str,
    node: Node,
    agents: Callable[[str], AgentProcess],
) -> None:
    """A Sandbox that claimed a pool member is reached by its own name (the member's
    pod and token serve it); nobody reaches a waiting member, or the claimed one
    by the member's name, so no one can leave anything in a sandbox before its
    claimer gets it."""

    def start(namespace: str, pod: str) -> str:
        agent = agents(secret_token(kube, namespace, pod))
        node.run_pod(namespace, pod, agent.ip)
        return agent.ip

    templates, pools, sandboxes = Templates(kube, ns), Pools(kube, ns), Sandboxes(kube, ns)
    templates.create("py", {"sandbox": {"runtime": "python", "workspace": {"ephemeral": True}}})
    token = caller(kube, ns, "alice", "user")
    with Kubelet(kube, ns, start):
        pools.create("warm", {"templateRef": {"name": "py"}, "replicas": 2})
        pools.wait_counts("warm", ready=2, timeout=60)
        sandboxes.create("mine", {"poolRef": {"name": "warm"}})
        member = sandboxes.wait_ready("mine", timeout=20)["status"]["pool"]["member"]
        pools.wait_counts("warm", ready=2, timeout=60)
        waiting = members(kube, ns, "warm")[0]["metadata"]["name"]
    with client(gateway, ns, "mine", token) as http:
        ran = http.post("/executions", json={"command": "echo served"})
        assert ran.status_code == 200, ran.text
        assert ran.json()["stdout"] == "served\n"
    for other in (member, waiting):
        with client(gateway, ns, other, token) as http:
            refused = http.post("/executions", json={"command": "touch /workspace/planted"})
            assert refused.status_code == 409, refused.text
            assert code(refused) == "pool_member"


def test_urls_handed_out_are_on_the_gateways_external_url(
    gateway: GatewayProcess,
    kube: KubeJSON,
    ns: str,
    live_sandbox: LiveSandbox,
    running_operator: OperatorProcess,
    operator_kubeconfig: Path,
    control_plane: ControlPlane,
    tmp_path: Path,
) -> None:
    """With the gateway's external URL in the settings (the chart's
    gateway.externalURL; here `localhost` and the test gateway's port, what this
    host reaches), status.ports[].url and Sandbox.url() are on it and work from
    where the user is: `?token=` -> 302 with an HttpOnly cookie -> 200; signed
    download URLs are on the gateway's own external URL."""
    external = f"http://localhost:{gateway.port}"
    # In place of the session's operator (which `running_operator` starts again).
    running_operator.stop()
    operator = OperatorProcess(
        operator_kubeconfig,
        tmp_path,
        {**OPERATOR_ENV, "SANDBOX_OPERATOR_GATEWAY_URL": external},
        name="external-url",
    )
    operator.start()
    try:
        agent = live_sandbox("web", {"network": {"exposedPorts": [{"name": "app", "port": 17000}]}})
        stop = _serve_preview(agent.ip, 17000)
        try:
            ports = wait_for(
                lambda: kube.read(api_path("sandbox.dev/v1alpha1", "sandboxes", ns, "web"))[
                    "status"
                ].get("ports"),
                20,
                "status.ports",
            )
            url = f"{external}/v1/namespaces/{ns}/sandboxes/web/ports/17000/"
            assert [p["url"] for p in ports] == [url]
            alice = caller(kube, ns, "alice", "user")
            with SandboxClient(
                ns,
                api_server=control_plane.server,
                token=alice,
                ca_file=str(control_plane.ca_cert),
                gateway_url=gateway.url,
            ) as sdk:
                link = sdk.connect("web").url(17000)
                sdk.connect("web").files.write("report.txt", "numbers")
            assert link.startswith(url + "?token=")
            with httpx.Client() as browser:
                first = browser.get(link)
                assert first.status_code == 302, first.text
                assert "HttpOnly" in first.headers["set-cookie"]
                page = browser.get(httpx.URL(link).join(first.headers["location"]))
                assert page.status_code == 200, page.text
                assert page.text == "preview / "
        finally:
            stop()
    finally:
        operator.stop()
        assert operator.errors() == [], f"handler tracebacks in {operator.log}"

    # A gateway with an external URL signs download URLs on it, whichever way the
    # request came; the SDK hands that URL out (here reached directly).
    own = GatewayProcess(
        gateway.kubeconfig,
        tmp_path / "gateway",
        {"SANDBOX_GATEWAY_EXTERNAL_URL": "https://sandboxes.example.test/gw/"},
    )
    own.start()
    try:
        with SandboxClient(
            ns,
            api_server=control_plane.server,
            token=alice,
            ca_file=str(control_plane.ca_cert),
            gateway_url=own.url,
        ) as sdk:
            signed = sdk.connect("web").files.download_url("report.txt")
        assert signed.startswith(
            f"https://sandboxes.example.test/gw/v1/namespaces/{ns}/sandboxes/web/download?"
        )
        # What the Ingress at that address would send on, without its prefix.
        path = signed.removeprefix("https://sandboxes.example.test/gw")
        assert httpx.get(own.url + path).content == b"numbers"
    finally:
        own.stop()


def test_a_terminal_through_the_gateway(
    gateway: GatewayProcess, kube: KubeJSON, ns: str, live_sandbox: LiveSandbox, tmp_path: Path
) -> None:
    """A shell on a pty, created and attached (a WebSocket) through the gateway
    with `create sandboxes/exec`; detached and attached again from a cursor; a
    gateway replica killed under an attachment, the terminal attached again
    through the other one. A viewer cannot attach, nor can a caller without
    credentials."""
    live_sandbox("tty")
    alice = caller(kube, ns, "tty-user", "user")
    viewer = caller(kube, ns, "tty-viewer", "viewer")
    shell = {"argv": ["bash", "--norc", "--noprofile", "-i"], "env": {"PS1": "gw> "}}
    with client(gateway, ns, "tty", alice) as http:
        made = http.post("/terminals", json={**shell, "cols": 90, "rows": 20})
        assert made.status_code == 201, made.text
        term = made.json()["id"]
        plain = http.get(f"/terminals/{term}/attach")
        assert plain.status_code == 426, plain.text
        assert code(plain) == "websocket_required", plain.text
    with client(gateway, ns, "tty", viewer) as http:
        refused = http.post("/terminals", json=shell)
        assert refused.status_code == 403, refused.text
    attach_url = f"{gateway.url}/v1/namespaces/{ns}/sandboxes/tty/terminals/{term}/attach"

    async def session(
        token: str | None, keys: bytes, until: bytes, cursor: int = 0, url: str = attach_url
    ) -> bytes:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with (
            aiohttp.ClientSession() as http,
            http.ws_connect(url, headers=headers, params={"cursor": str(cursor)}) as ws,
        ):
            first = json.loads((await ws.receive(timeout=10)).data)
            assert first["type"] == "attached", first
            await ws.send_bytes(keys)
            seen = b""
            while until not in seen:
                message = await ws.receive(timeout=10)
                assert message.type == aiohttp.WSMsgType.BINARY, message
                seen += message.data
            return seen

    async def status(token: str | None, name: str = term) -> int:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        url = attach_url.replace(term, name)
        async with aiohttp.ClientSession() as http:
            try:
                async with http.ws_connect(url, headers=headers):
                    return 101
            except aiohttp.WSServerHandshakeError as exc:
                return exc.status

    seen = asyncio.run(session(alice, b"stty size\r", b"20 90"))
    assert b"20 90" in seen, seen
    replay = asyncio.run(session(alice, b"", b"20 90", cursor=0))
    assert b"stty size" in replay, replay
    assert asyncio.run(status(viewer)) == 403
    assert asyncio.run(status(None)) == 401
    assert asyncio.run(status(alice, "term-nope")) == 404

    # A second replica: attached through it, it dies (SIGKILL, no drain); the
    # terminal goes on, and the first replica attaches to it again.
    other = GatewayProcess(gateway.kubeconfig, tmp_path / "other")
    other.start()

    async def cut_off() -> None:
        headers = {"Authorization": f"Bearer {alice}"}
        url = attach_url.replace(gateway.url, other.url)
        async with aiohttp.ClientSession() as http, http.ws_connect(url, headers=headers) as ws:
            await ws.receive(timeout=10)  # attached
            await ws.send_bytes(b"sleep 1; echo after-$((20+22))\r")
            echoed = b""
            while b"after-$" not in echoed:  # the shell has the line: it runs without us
                echoed += (await ws.receive(timeout=10)).data
            assert other.proc is not None
            other.proc.kill()
            message = await ws.receive(timeout=30)
            while message.type == aiohttp.WSMsgType.BINARY:  # what was in flight
                message = await ws.receive(timeout=30)
            assert message.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR), message

    asyncio.run(cut_off())
    other.stop()
    again = asyncio.run(session(alice, b"", b"after-42", cursor=0))
    assert b"after-42" in again, again
    with client(gateway, ns, "tty", alice) as http:
        assert http.delete(f"/terminals/{term}").status_code == 204


def _inotify_fds(pid: int) -> int:
    fds = Path(f"/proc/{pid}/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            count += fd.readlink() == Path("anon_inode:inotify")
        except OSError:
            continue
    return count


def test_a_watch_streams_through_the_gateway(
    gateway: GatewayProcess,
    kube: KubeJSON,
    ns: str,
    live_sandbox: LiveSandbox,
    control_plane: ControlPlane,
) -> None:
    """A directory watch is a files:read operation: a viewer may watch, a caller
    without it gets 403. Its events pass the gateway one by one while the stream
    stays open, and a caller who leaves ends the agent's watch."""
    agent = live_sandbox("box")
    assert agent.agent is not None
    pid = agent.agent.pid
    (agent.workspace / "src").mkdir()
    viewer = caller(kube, ns, "vera", "viewer")
    stranger = caller(kube, ns, "bob", None)
    with client(gateway, ns, "box", stranger) as http:
        refused = http.get("/files/watch", params={"path": "src"})
        assert refused.status_code == 403, refused.text
        assert "get sandboxes/files.sandbox.dev" in refused.json()["error"]["message"]
    before = _inotify_fds(pid)
    with (
        client(gateway, ns, "box", viewer) as http,
        http.stream("GET", "/files/watch", params={"path": "src", "recursive": "true"}) as stream,
    ):
        assert stream.status_code == 200, stream.read()
        assert stream.headers["content-type"].startswith("application/x-ndjson")
        lines = (json.loads(line) for line in stream.iter_lines() if line)
        started = next(lines)
        assert (started["type"], started["path"]) == ("started", "src")
        assert _inotify_fds(pid) == before + 1
        changed = time.monotonic()
        (agent.workspace / "src" / "a.txt").write_text("x")
        event = next(lines)
        latency_ms = (time.monotonic() - changed) * 1000
        assert (event["type"], event["path"], event["fileType"]) == ("create", "src/a.txt", "file")
        print(f"\nwatch event through the gateway {latency_ms:.1f} ms after the change")
    wait_for(lambda: _inotify_fds(pid) == before, 30, "the agent's watch to end")
    # The SDK's handle on the same stream.
    with (
        SandboxClient(
            ns,
            api_server=control_plane.server,
            token=viewer,
            ca_file=str(control_plane.ca_cert),
            gateway_url=gateway.url,
        ) as sdk,
        sdk.connect("box").files.watch("src") as changes,
    ):
        assert changes.started is not None
        assert changes.started.path == "src"
        (agent.workspace / "src" / "a.txt").unlink()
        removed = next(changes)
        assert (removed.type, removed.path, removed.file_type) == ("remove", "src/a.txt", "file")
        with sdk.connect("box").files.watch("src", timeout=0.5) as bounded:
            assert list(bounded) == []
            assert bounded.end_reason == "timeout"

    async def watch_async() -> list[tuple[str, str | None, str | None]]:
        async with AsyncSandboxClient(
            ns,
            api_server=control_plane.server,
            token=viewer,
            ca_file=str(control_plane.ca_cert),
            gateway_url=gateway.url,
        ) as sdk:
            sandbox = await sdk.connect("box")
            async with sandbox.files.watch("src", timeout=1) as changes:
                (agent.workspace / "src" / "made").mkdir()
                seen = [(event.type, event.path, event.file_type) async for event in changes]
                assert changes.end_reason == "timeout"
                return seen

    assert asyncio.run(watch_async()) == [("create", "src/made", "directory")]
