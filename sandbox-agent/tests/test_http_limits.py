"""The HTTP server's bounds before authentication: pipelining floods, unread
answers, connection counts, errors that must not cost the connection."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from conftest import PY, Sandbox, free_port, rss_kib, stop_process, wait_until


def _flood(host: str, port: int, request: bytes, total: int, stall: float = 2.0) -> tuple[int, int]:
    """Send ``total`` requests back to back without reading a single answer.

    Returns (requests fully sent, bytes sent). Sending stops when the agent
    stops reading (the send blocks for ``stall`` seconds)."""
    s = socket.create_connection((host, port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # answers pile up at the agent
    s.settimeout(stall)
    batch = request * 1000
    sent = 0
    try:
        while sent < len(request) * total:
            try:
                sent += s.send(batch[sent % len(batch) :])
            except TimeoutError:
                break
    finally:
        s.close()
    return sent // len(request), sent


def _buffer_max(name: str) -> int:
    """The largest a TCP socket buffer grows to (`net.ipv4.<name>`, its third field)."""
    return int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2])


def test_pipelining_flood_is_bounded_before_auth(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    assert sb.agent is not None
    before = rss_kib(sb.agent.pid)
    # Unauthenticated and unread: tiny requests on one connection, twice what
    # the kernel's socket buffers can take (they grow up to tcp_rmem and
    # tcp_wmem's maximum), so that the sending stops only if the agent does.
    req = b"GET /v1/info HTTP/1.1\r\nHost: x\r\n\r\n"
    total = 2 * (_buffer_max("tcp_rmem") + _buffer_max("tcp_wmem")) // len(req)
    done, sent = _flood(sb.host, sb.port, req, total)
    after = rss_kib(sb.agent.pid)
    # The agent stopped reading long before the end: what it took is what
    # fits in the kernel's buffers and its own small bounds.
    assert done < total, (done, sent)
    assert after - before < 24 * 1024, (before, after, done)
    # ...and it still serves everyone else.
    assert sb.anon.get("/healthz").status_code == 200
    assert sb.client.get("/v1/info").status_code == 200


def test_pipelined_answers_are_all_delivered_in_order(sandbox: Sandbox) -> None:
    """The bounds hold requests back; they never drop or reorder them."""
    s = socket.create_connection((sandbox.host, sandbox.port), timeout=30)
    n = 2000
    s.sendall(b"".join(b"GET /healthz?n=%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(n)))
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    data = b""
    while chunk := s.recv(1 << 16):
        data += chunk
    s.close()
    assert data.count(b"HTTP/1.1 200 OK") == n + 1


def test_large_pipelined_bodies_wait_unbuffered(fresh: Callable[..., Sandbox]) -> None:
    """Bodies behind a request in flight (or before auth) are not read into memory."""
    sb = fresh(runner=False)
    assert sb.agent is not None
    before = rss_kib(sb.agent.pid)
    socks = []
    for _ in range(8):
        s = socket.create_connection((sb.host, sb.port))
        s.settimeout(2.0)
        # a public request that waits, then a 64 MiB body nobody has asked for yet
        s.sendall(b"GET /readyz?waitSeconds=5 HTTP/1.1\r\nHost: x\r\n\r\n")
        s.sendall(b"PUT /v1/files/content?path=x HTTP/1.1\r\nHost: x\r\n")
        s.sendall(b"Content-Length: %d\r\n\r\n" % (64 << 20))
        chunk = b"\0" * (1 << 20)
        for _ in range(64):
            try:
                s.sendall(chunk)
            except TimeoutError:
                break
        socks.append(s)
    grown = rss_kib(sb.agent.pid) - before
    for s in socks:
        s.close()
    assert grown < 24 * 1024, grown


def test_connection_cap_evicts_idle_then_refuses(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(runner=False, max_connections=4)
    sb.client.close()
    sb.anon.close()
    idle = []
    for _ in range(4):
        s = socket.create_connection((sb.host, sb.port), timeout=10)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        idle.append(s)
        time.sleep(0.05)
    # A fifth connection is served; the longest idle one was closed for it.
    s5 = socket.create_connection((sb.host, sb.port), timeout=10)
    s5.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert s5.recv(4096).startswith(b"HTTP/1.1 200")
    assert idle[0].recv(10) == b""
    for s in [*idle, s5]:
        s.close()
    # Four busy connections that carried the token (readiness waits for a
    # runner that never comes): the fifth is refused at once with a 503
    # instead of being queued.
    busy = []
    for _ in range(4):
        s = socket.create_connection((sb.host, sb.port), timeout=10)
        s.sendall(
            b"GET /readyz?waitSeconds=3 HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {sb.token}\r\n\r\n".encode()
        )
        busy.append(s)
    time.sleep(0.3)
    s6 = socket.create_connection((sb.host, sb.port), timeout=10)
    s6.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = s6.recv(4096)
    assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer, answer
    for s in [*busy, s6]:
        s.close()
    wait_until(lambda: httpx.get(f"{sb.base_url}/healthz").status_code == 200)


def test_server_error_keeps_the_connection(tmp_path: Path) -> None:
    """An app that answers 500 and then re-raises (as Starlette's error
    middleware does) leaves a usable keep-alive connection."""
    port = free_port()
    script = tmp_path / "app.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from sandbox_agent.httpserver import run

            async def app(scope, receive, send):
                if scope["type"] == "lifespan":
                    await receive()
                    await send({{"type": "lifespan.startup.complete"}})
                    await receive()
                    return
                if scope["path"] == "/boom":
                    await send({{"type": "http.response.start", "status": 500, "headers": []}})
                    await send({{"type": "http.response.body", "body": b"boom"}})
                    raise RuntimeError("after the answer")
                await send({{"type": "http.response.start", "status": 200, "headers": []}})
                await send({{"type": "http.response.body", "body": b"fine"}})

            run(app, "127.0.0.1", {port})
            """
        )
    )
    p = subprocess.Popen([PY, str(script)], stderr=subprocess.PIPE)
    try:
        wait_until(lambda: _answers(port), 15.0)
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
        first = s.recv(4096)
        assert first.startswith(b"HTTP/1.1 500") and first.endswith(b"boom"), first
        s.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        second = s.recv(4096)
        assert second.startswith(b"HTTP/1.1 200") and second.endswith(b"fine"), second
        s.close()
    finally:
        stop_process(p)
        assert p.stderr is not None
        p.stderr.close()


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ok").status_code == 200
    except httpx.TransportError:
        return False


def test_readiness_reveals_no_paths(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(runner=False)
    r = sb.anon.get("/readyz")
    assert r.status_code == 503
    body = r.text
    assert str(sb.root) not in body and "sock" not in body, body
    assert r.json()["reason"] == "runner_not_connected"


def test_bounds_never_stall_a_legitimate_pipeline(sandbox: Sandbox, wsdir: str) -> None:
    """Requests, a chunked upload and a large upload sent back to back on one
    connection before any answer is read: all are served, in order, whole."""
    auth = f"Authorization: Bearer {sandbox.token}\r\n".encode()
    big = os.urandom(1 << 20) * 24  # 24 MiB, far past every pre-read bound
    chunked = (
        b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (b"a" * 70000, b"b" * 5)) + b"0\r\n\r\n"
    )
    wire = (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 20
        + f"PUT /v1/files/content?path={wsdir}/chunked HTTP/1.1\r\nHost: x\r\n".encode()
        + auth
        + b"Transfer-Encoding: chunked\r\n\r\n"
        + chunked
        + f"PUT /v1/files/content?path={wsdir}/big HTTP/1.1\r\nHost: x\r\n".encode()
        + auth
        + b"Content-Length: %d\r\n\r\n" % len(big)
        + big
        + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    s = socket.create_connection((sandbox.host, sandbox.port), timeout=60)
    sender = threading.Thread(target=s.sendall, args=(wire,))
    sender.start()
    data = b""
    while chunk := s.recv(1 << 16):
        data += chunk
    sender.join()
    s.close()
    statuses = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", data)]
    assert statuses == [200] * 23, statuses
    assert (sandbox.workspace / wsdir / "chunked").read_bytes() == b"a" * 70000 + b"b" * 5
    assert (sandbox.workspace / wsdir / "big").read_bytes() == big


def _held_before_auth(sb: Sandbox) -> socket.socket:
    """A connection without the token that announces a large body, sends a few
    bytes of it and keeps going: it gets its 401, then is drained."""
    s = socket.create_connection((sb.host, sb.port), timeout=10)
    s.sendall(
        b"PUT /v1/files/content?path=x HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: 100000000\r\n\r\n" + b"y" * 100
    )
    assert s.recv(4096).startswith(b"HTTP/1.1 401")
    return s


def test_connections_without_the_token_cannot_hold_slots(fresh: Callable[..., Sandbox]) -> None:
    """Connections held before authentication (a 401 whose body keeps coming)
    give way to probes and to callers with the token, and are drained only
    briefly; connections with the token keep their slots."""
    sb = fresh(runner=False, max_connections=6)
    sb.client.close()
    sb.anon.close()
    trusted = socket.create_connection((sb.host, sb.port), timeout=10)
    trusted.sendall(
        b"GET /readyz?waitSeconds=5 HTTP/1.1\r\nHost: x\r\n"
        + f"Authorization: Bearer {sb.token}\r\n\r\n".encode()
    )
    held = [_held_before_auth(sb) for _ in range(5)]
    stop = threading.Event()

    def trickle() -> None:  # the body keeps coming, so none of them is idle
        while not stop.wait(0.2):
            for h in held:
                with contextlib.suppress(OSError):
                    h.send(b"y")

    feeder = threading.Thread(target=trickle)
    feeder.start()
    try:
        # Probes and a caller with the token are served, every time.
        for _ in range(10):
            with httpx.Client(base_url=sb.base_url, timeout=5) as c:
                assert c.get("/healthz").status_code == 200
            with httpx.Client(
                base_url=sb.base_url, timeout=5, headers={"Authorization": f"Bearer {sb.token}"}
            ) as c:
                assert c.get("/v1/info").status_code == 200
        # The connection with the token kept its slot: it gets its answer
        # (no runner here) rather than being closed for a newcomer.
        trusted.settimeout(10)
        assert trusted.recv(4096).startswith(b"HTTP/1.1 503")
    finally:
        stop.set()
        feeder.join()
    # Without eviction, a pre-auth drain ends within about two seconds anyway.
    last = _held_before_auth(sb)
    t = time.monotonic()
    last.settimeout(10)
    assert last.recv(10) == b""
    assert time.monotonic() - t < 20  # drained for 2 s (it was 30 s)
    for h in [*held, last, trusted]:
        h.close()


def test_stalled_connections_make_room_for_new_ones(fresh: Callable[..., Sandbox]) -> None:
    """Connections whose clients read none of their answers cannot lock the
    operator out: at the cap, the longest stalled one is dropped."""
    sb = fresh(runner=False, max_connections=4)
    sb.client.close()
    sb.anon.close()
    floods = []
    for _ in range(4):
        s = socket.create_connection((sb.host, sb.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(1.0)
        batch = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 1000
        with contextlib.suppress(TimeoutError):
            while True:
                s.send(batch)
        floods.append(s)
    for _ in range(3):
        with httpx.Client(base_url=sb.base_url, timeout=10) as c:
            assert c.get("/healthz").status_code == 200
    for s in floods:
        s.close()


def test_waiting_readiness_probes_are_bounded(fresh: Callable[..., Sandbox]) -> None:
    """Only a few probes may hold their answer (the only way to keep a
    connection busy without a token); the others answer at once."""
    sb = fresh(runner=False)
    took: list[float] = []

    def probe() -> None:
        with httpx.Client(base_url=sb.base_url, timeout=10) as c:
            t = time.monotonic()
            assert c.get("/readyz", params={"waitSeconds": 3}).status_code == 503
            took.append(time.monotonic() - t)

    threads = [threading.Thread(target=probe) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(took) == 12
    assert sum(1 for d in took if d < 1.5) >= 4, sorted(took)
    assert sum(1 for d in took if d >= 2.5) <= 8, sorted(took)
