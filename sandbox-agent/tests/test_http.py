"""HTTP/1.1 behaviour of the agent's own server, spoken to over raw sockets."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable

import httpx
from conftest import PY, Sandbox, free_port, stop_process, wait_until


def _conn(sb: Sandbox) -> socket.socket:
    s = socket.create_connection((sb.host, sb.port), timeout=10)
    return s


_LEFTOVER: dict[int, bytes] = {}


def _recv_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one response; bytes of the next (pipelined) one are kept for later."""
    buf = _LEFTOVER.pop(s.fileno(), b"")
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(buf)
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(rest) < n:
            rest += s.recv(65536)
        _LEFTOVER[s.fileno()] = rest[n:]
        return status, headers, rest[:n]
    return status, headers, rest


def _auth(sb: Sandbox) -> bytes:
    return f"Authorization: Bearer {sb.token}\r\n".encode()


def test_keep_alive_and_pipelining(sandbox: Sandbox) -> None:
    s = _conn(sandbox)
    req = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    s.sendall(req * 3)  # three pipelined requests in one packet
    for _ in range(3):
        status, _, body = _recv_response(s)
        assert status == 200 and body == b'{"status":"ok"}'
    s.sendall(req)
    assert _recv_response(s)[0] == 200
    s.close()


def test_connection_close_honoured(sandbox: Sandbox) -> None:
    s = _conn(sandbox)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    status, headers, _ = _recv_response(s)
    assert status == 200 and headers["connection"] == "close"
    assert s.recv(10) == b""
    s = _conn(sandbox)
    s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
    assert _recv_response(s)[0] == 200
    assert s.recv(10) == b""


def test_expect_100_continue(sandbox: Sandbox, wsdir: str) -> None:
    s = _conn(sandbox)
    body = b"x" * 5000
    s.sendall(
        f"PUT /v1/files/content?path={wsdir}/c.txt HTTP/1.1\r\nHost: x\r\n".encode()
        + _auth(sandbox)
        + f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode()
    )
    interim = s.recv(1024)
    assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
    s.sendall(body)
    status, _, resp = _recv_response(s)
    assert status == 200 and b'"size":5000' in resp


def test_expect_100_refused_without_reading_body(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(env={"SANDBOX_AGENT_MAX_UPLOAD_BYTES": "1000"}, runner=False)
    s = _conn(sb)
    s.sendall(
        b"PUT /v1/files/content?path=big HTTP/1.1\r\nHost: x\r\n"
        + _auth(sb)
        + b"Content-Length: 100000000\r\nExpect: 100-continue\r\n\r\n"
    )
    status, _, body = _recv_response(s)
    assert status == 413 and b"body_too_large" in body


def test_chunked_request_body(sandbox: Sandbox, wsdir: str) -> None:
    s = _conn(sandbox)
    s.sendall(
        f"PUT /v1/files/content?path={wsdir}/chunked HTTP/1.1\r\nHost: x\r\n".encode()
        + _auth(sandbox)
        + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    assert _recv_response(s)[0] == 200
    assert sandbox.read(f"{wsdir}/chunked") == b"hello world"


def test_malformed_requests_get_400(sandbox: Sandbox) -> None:
    for raw in (
        b"NONSENSE\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nBad Header\r\n\r\n",
    ):
        s = _conn(sandbox)
        s.sendall(raw)
        status, _, body = _recv_response(s)
        assert status == 400 and b"bad_http" in body
        s.close()
    assert sandbox.anon.get("/healthz").status_code == 200


def test_oversized_headers_get_431(sandbox: Sandbox) -> None:
    s = _conn(sandbox)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n")
    status, _, _ = _recv_response(s)
    assert status == 431


def test_head_and_unknown_routes(sandbox: Sandbox) -> None:
    r = sandbox.client.head("/v1/info")
    assert r.status_code == 200 and r.content == b"" and int(r.headers["content-length"]) > 0
    r = sandbox.client.get("/v1/nothing-here")
    assert sandbox.error(r, 404) == "not_found"
    r = sandbox.client.delete("/v1/info")
    assert sandbox.error(r, 405) == "method_not_allowed"


def _post_stream(s: socket.socket, sandbox: Sandbox, body: bytes) -> None:
    """Start a command whose output is streamed back on `s`."""
    s.sendall(
        b"POST /v1/executions/stream HTTP/1.1\r\nHost: x\r\n"
        + _auth(sandbox)
        + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def test_client_disconnect_mid_stream_keeps_execution(sandbox: Sandbox) -> None:
    s = _conn(sandbox)
    body = b'{"command":"sleep 0.5; echo done"}'
    _post_stream(s, sandbox, body)
    _status, headers, _ = _recv_response(s)
    ex_id = headers["x-execution-id"]
    s.close()  # go away mid-stream
    done = sandbox.wait_finished(ex_id)
    assert done["status"] == "completed" and done["stdout"] == "done\n"


def test_a_streams_last_event_and_its_end_arrive_together(sandbox: Sandbox) -> None:
    """The events of one loop turn go out in one write: a client (the gateway)
    that has read `finished` has the end of the answer with it, and its
    connection is ready for the next call without another wait."""
    s = _conn(sandbox)
    body = b'{"command":"echo hi"}'
    _post_stream(s, sandbox, body)
    received = b""
    while b'"finished"' not in received:
        chunk = s.recv(65536)
        assert chunk, received
        received += chunk
    # The read that brought `finished` brought the terminating chunk too.
    assert received.endswith(b"\r\n0\r\n\r\n"), received[-200:]
    s.close()


def test_uvicorn_fallback_serves_the_same_app(
    tmp_path: object, fresh: Callable[..., Sandbox]
) -> None:
    sb = fresh(env={"SANDBOX_AGENT_SERVER": "uvicorn"})
    assert sb.sh("echo via-uvicorn")["stdout"] == "via-uvicorn\n"
    assert sb.anon.get("/v1/info").status_code == 401


def test_sigterm_stops_agent_cleanly(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    assert sb.agent is not None
    sb.agent.terminate()
    assert sb.agent.wait(10) == 0


def test_port_in_use_is_a_clear_error(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(runner=False)
    p = subprocess.run(
        [PY, "-m", "sandbox_agent"], env=sb.env, capture_output=True, text=True, timeout=30
    )
    assert p.returncode == 1 and "cannot listen" in p.stderr


def test_binds_other_loopback_addresses(tmp_path: object) -> None:
    from pathlib import Path

    root = Path(str(tmp_path)) / "lo2"
    root.mkdir()
    sb = Sandbox(root, host="127.0.0.2")
    try:
        sb.start_agent()
        assert httpx.get(f"http://127.0.0.2:{sb.port}/healthz").status_code == 200
    finally:
        sb.stop()
    assert free_port() > 0 and os.getpid() > 0 and wait_until(lambda: True)
    stop_process(None)
