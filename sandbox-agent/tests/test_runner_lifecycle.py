"""Runner death, restart, misbehaviour and placement."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import PY, Sandbox, wait_until

from sandbox_agent import __version__
from sandbox_agent import runner as wire
from sandbox_agent.server import PLACED

SRC_RUNNER = Path(wire.__file__)


def _kill_group(pid: int | None) -> None:
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def test_runner_placed_atomically_with_mode_0644(fresh: Callable[..., Sandbox]) -> None:
    """The runner and the code-context bridges it starts, each whole, mode 0644."""
    sb = fresh(runner=False)
    for name in PLACED:
        placed = sb.runtime / name
        assert placed.read_bytes() == SRC_RUNNER.with_name(name).read_bytes(), name
        assert stat.S_IMODE(placed.stat().st_mode) == 0o644, name
    assert sorted(p.name for p in sb.runtime.iterdir()) == sorted(PLACED)  # no temp leftovers


def test_not_ready_without_runner_then_ready(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(runner=False)
    r = sb.anon.get("/readyz")
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "not_ready" and body["reason"] == "runner_not_connected"
    assert body["message"] == "no runner is connected"  # fixed: no socket path for anyone
    r = sb.client.post("/v1/executions", json={"command": "true"})
    assert sb.error(r, 503) == "runner_unavailable"
    info = sb.client.get("/v1/info").json()
    assert info["runnerConnected"] is False and info["runnerVersion"] is None
    sb.start_runner()
    info = sb.client.get("/v1/info").json()
    assert info["runnerConnected"] is True and info["runnerVersion"] == __version__
    assert sb.sh("echo ok")["stdout"] == "ok\n"


def test_runner_death_mid_command(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    bg = sb.run(expect=202, command="echo started; sleep 60", background=True)
    wait_until(lambda: sb.client.get(f"/v1/executions/{bg['id']}").json()["stdoutBytes"])
    result: dict[str, Any] = {}

    def foreground() -> None:
        r = sb.client.post("/v1/executions", json={"command": "sleep 60"})
        result.update(r.json())

    t = threading.Thread(target=foreground)
    t.start()
    wait_until(lambda: sb.client.get("/v1/info").json()["activeExecutions"] == 2)
    killed_at = time.monotonic()
    sb.kill_runner(signal.SIGKILL)
    t.join(10)
    assert not t.is_alive(), "a foreground execution hung after the runner died"
    assert time.monotonic() - killed_at < 3
    assert result["status"] == "lost"
    assert result["error"]["code"] == "runner_lost"
    done = sb.wait_finished(bg["id"], 5)
    assert done["status"] == "lost" and done["error"]["code"] == "runner_lost"
    assert done["stdout"] == "started\n"  # output before the loss is kept
    for pid in (result.get("pid"), done["pid"]):
        _kill_group(pid)
    r = sb.anon.get("/readyz")
    assert r.status_code == 503 and r.json()["status"] == "not_ready"
    assert sb.client.get("/v1/info").json()["activeExecutions"] == 0
    r = sb.client.post("/v1/executions", json={"command": "true"})
    assert sb.error(r, 503) == "runner_unavailable"
    # a new runner brings readiness back
    sb.start_runner()
    assert sb.sh("echo back")["stdout"] == "back\n"


def test_runner_sigterm_stops_its_commands(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    ex = sb.run(expect=202, command="sleep 60", background=True)
    pid = wait_until(lambda: sb.client.get(f"/v1/executions/{ex['id']}").json()["pid"])
    sb.kill_runner(signal.SIGTERM)
    assert sb.runner is not None and sb.runner.returncode == 0
    wait_until(lambda: not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), 5)
    done = sb.wait_finished(ex["id"], 5)
    assert done["status"] in ("completed", "lost")


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_runner_reaps_orphans(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    ex = sb.sh("sh -c 'sleep 0.2 & echo $!' ")
    orphan = int(ex["stdout"])
    time.sleep(0.6)
    assert sb.runner is not None
    # the orphan was re-parented to the runner (subreaper) and reaped: no zombie
    assert not os.path.exists(f"/proc/{orphan}") or not _is_zombie(orphan)


def test_runner_socket_mode_and_uid_split(fresh: Callable[..., Sandbox], world_tmp: Path) -> None:
    """Runner as another UID (nobody), agent as us: like the pod's two containers."""
    sb = fresh(runner=False, root=world_tmp)
    os.chmod(sb.root, 0o755)
    sb.start_runner(user=65534)
    sock = sb.runtime / "runner.sock"
    st = sock.stat()
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_uid == 65534
    info = sb.client.get("/v1/info").json()
    assert info["runnerUid"] == 65534
    ex = sb.sh("id -u; touch made-by-runner; stat -c %a made-by-runner")
    uid, mode = ex["stdout"].split()
    assert uid == "65534"
    assert mode == "664"  # runner umask 002: the agent's group may edit it


class FakeRunner:
    """A hostile 'runner' on the socket: user code can replace the real one."""

    def __init__(self, path: Path, behaviour: Callable[[socket.socket], None]) -> None:
        if path.exists():
            path.unlink()
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(str(path))
        self.srv.listen(4)
        self.behaviour = behaviour
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self.behaviour, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self.srv.close()


def _read_frame(conn: socket.socket) -> tuple[int, int, bytes]:
    head = b""
    while len(head) < wire.HEADER.size:
        chunk = conn.recv(wire.HEADER.size - len(head))
        if not chunk:
            raise ConnectionError
        head += chunk
    length, ftype, chan = wire.HEADER.unpack(head)
    payload = b""
    while len(payload) < length:
        payload += conn.recv(length - len(payload))
    return ftype, chan, payload


def _send(conn: socket.socket, ftype: int, chan: int, payload: bytes) -> None:
    conn.sendall(wire.HEADER.pack(len(payload), ftype, chan) + payload)


def _hello(conn: socket.socket) -> None:
    _read_frame(conn)
    ack = {"protocol": wire.PROTOCOL, "version": "evil", "pid": 1, "uid": 0, "python": "3"}
    _send(conn, wire.T_HELLO_ACK, 0, json.dumps(ack).encode())


def _run_against_fake(
    fresh: Callable[..., Sandbox], after_spawn: Callable[[socket.socket, int], None]
) -> tuple[Sandbox, dict[str, Any], float]:
    sb = fresh(runner=False)

    def behaviour(conn: socket.socket) -> None:
        try:
            _hello(conn)
            while True:
                ftype, chan, _ = _read_frame(conn)
                if ftype == wire.T_PING:
                    _send(conn, wire.T_PONG, chan, _)
                elif ftype == wire.T_SPAWN:
                    after_spawn(conn, chan)
        except (ConnectionError, OSError):
            pass

    fake = FakeRunner(sb.runtime / "runner.sock", behaviour)
    try:
        wait_until(lambda: sb.anon.get("/readyz").status_code == 200)
        t = time.monotonic()
        r = sb.client.post("/v1/executions", json={"command": "x", "timeoutSeconds": 2})
        return sb, r.json(), time.monotonic() - t
    finally:
        fake.close()


def test_oversized_frame_from_runner_drops_it(fresh: Callable[..., Sandbox]) -> None:
    def after_spawn(conn: socket.socket, chan: int) -> None:
        _send(conn, wire.T_STARTED, chan, b'{"pid": 4242}')
        conn.sendall(struct.pack(">IBI", wire.MAX_PAYLOAD + 1, wire.T_STDOUT, chan))

    _, ex, elapsed = _run_against_fake(fresh, after_spawn)
    assert ex["status"] == "lost"
    assert ex["error"]["code"] == "runner_protocol_error"
    assert "exceeds" in ex["error"]["message"]
    assert elapsed < 2


def test_garbage_from_runner_drops_it(fresh: Callable[..., Sandbox]) -> None:
    def after_spawn(conn: socket.socket, chan: int) -> None:
        _send(conn, wire.T_EXIT, chan, b'{"exitCode": "zero"}')

    _, ex, _ = _run_against_fake(fresh, after_spawn)
    assert ex["status"] == "lost" and ex["error"]["code"] == "runner_protocol_error"


def test_unknown_frame_and_channel_drop_it(fresh: Callable[..., Sandbox]) -> None:
    def after_spawn(conn: socket.socket, chan: int) -> None:
        _send(conn, wire.T_STDOUT, chan + 999, b"spoofed")

    _, ex, _ = _run_against_fake(fresh, after_spawn)
    assert ex["status"] == "lost" and "unknown channel" in ex["error"]["message"]


def test_runner_that_ignores_kill_is_given_up(fresh: Callable[..., Sandbox]) -> None:
    def after_spawn(conn: socket.socket, chan: int) -> None:
        _send(conn, wire.T_STARTED, chan, b'{"pid": 4242}')  # then never exits

    sb, ex, elapsed = _run_against_fake(fresh, after_spawn)
    # timeout 2 s + kill grace (5 s default): bounded, never a hang. The record
    # ends as what it was (timed out); the runtime is to be restarted to end
    # the process, which only that can do now.
    assert ex["status"] == "timed_out" and ex["error"]["code"] == "runner_unresponsive"
    assert ex["timedOut"] is True
    assert "restarted" in ex["error"]["message"]
    assert elapsed < 10
    live = sb.anon.get("/livez/runtime")
    assert live.status_code == 503, live.text
    assert live.json()["reason"] == "kill_not_confirmed" and live.json()["executions"] == [ex["id"]]
    assert sb.anon.get("/readyz").json()["reason"] == "runtime_restart_pending"
    r = sb.client.post("/v1/executions", json={"command": "true"})
    assert sb.error(r, 503) == "runtime_restarting"  # it would die with the runtime


def test_silent_runner_is_not_ready(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(runner=False)
    fake = FakeRunner(sb.runtime / "runner.sock", lambda conn: time.sleep(30))
    try:
        time.sleep(0.5)
        r = sb.anon.get("/readyz")
        assert r.status_code == 503
    finally:
        fake.close()


def test_runner_runs_as_plain_file_with_explicit_socket(tmp_path: Path) -> None:
    """python3 runner.py with SANDBOX_RUNNER_SOCKET, spoken to directly."""
    sock_path = tmp_path / "custom.sock"
    proc = subprocess.Popen(
        [PY, str(SRC_RUNNER)],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"], "SANDBOX_RUNNER_SOCKET": str(sock_path)},
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(sock_path.exists, 10)
        c = socket.socket(socket.AF_UNIX)
        c.connect(str(sock_path))
        _send(c, wire.T_HELLO, 0, json.dumps({"protocol": wire.PROTOCOL}).encode())
        ftype, _, payload = _read_frame(c)
        assert ftype == wire.T_HELLO_ACK and json.loads(payload)["version"] == __version__
        _send(c, wire.T_SPAWN, 7, json.dumps({"argv": ["sh", "-c", "echo hi; exit 3"]}).encode())
        frames = []
        while True:
            ftype, chan, payload = _read_frame(c)
            assert chan == 7
            frames.append((ftype, payload))
            if ftype == wire.T_EXIT:
                break
        assert frames[0][0] == wire.T_STARTED
        assert (wire.T_STDOUT, b"hi\n") in frames
        assert json.loads(frames[-1][1])["exitCode"] == 3
        # an unspawnable request fails that spawn only, not the connection
        bad = {"argv": ["true"], "env": {"A": "x\u0000y"}}
        _send(c, wire.T_SPAWN, 8, json.dumps(bad).encode())
        ftype, chan, payload = _read_frame(c)
        assert (ftype, chan) == (wire.T_SPAWN_FAILED, 8), payload
        _send(c, wire.T_PING, 0, b"still")
        assert _read_frame(c) == (wire.T_PONG, 0, b"still")
        # a broken client only loses its own connection
        c.sendall(struct.pack(">IBI", 1 << 30, wire.T_SPAWN, 1))
        assert c.recv(10) == b""
        c2 = socket.socket(socket.AF_UNIX)
        c2.connect(str(sock_path))
        _send(c2, wire.T_PING, 0, b"abc")
        assert _read_frame(c2) == (wire.T_PONG, 0, b"abc")
    finally:
        proc.terminate()
        proc.wait(5)
    assert proc.returncode == 0
    assert not sock_path.exists()


def test_runner_bounds_unread_stdin(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(runner=False)
    sb.start_runner(extra_env={"SANDBOX_RUNNER_STDIN_BUFFER_BYTES": "1000"})
    ex = sb.run(expect=202, command="sleep 10", stdinOpen=True, background=True)
    wait_until(lambda: sb.client.get(f"/v1/executions/{ex['id']}").json()["pid"])
    for _ in range(4):  # more than the pipe holds plus the runner's buffer
        sb.client.post(f"/v1/executions/{ex['id']}/stdin", json={"data": "x" * 65536})
    wait_until(lambda: not sb.client.get(f"/v1/executions/{ex['id']}").json()["stdinOpen"])
    r = sb.client.post(f"/v1/executions/{ex['id']}/stdin", json={"data": "x"})
    assert sb.error(r, 409) == "stdin_closed"
    assert sb.client.get(f"/v1/executions/{ex['id']}").json()["status"] == "running"
    sb.client.post(f"/v1/executions/{ex['id']}/cancel")


def test_readiness_can_wait_for_the_runner(fresh: Callable[..., Sandbox]) -> None:
    """The kubelet probes /readyz right after the agent starts, before the sandbox
    container's runner connects: with waitSeconds the probe waits instead of failing."""
    sb = fresh(runner=False)
    answer: dict[str, Any] = {}

    def probe() -> None:
        began = time.monotonic()
        r = sb.anon.get("/readyz", params={"waitSeconds": 5})
        answer.update(r.json(), status=r.status_code, waited=time.monotonic() - began)

    t = threading.Thread(target=probe)
    t.start()
    time.sleep(0.3)  # the probe is waiting by now (or about to)
    sb.start_runner(wait_ready=False)
    t.join(30)
    assert answer["status"] == 200, answer
    assert answer["status"] == 200 and answer["runnerVersion"] == __version__

    # no runner at all: the answer is held for the wait, then 503 as before
    sb.kill_runner()
    wait_until(lambda: sb.anon.get("/readyz").status_code == 503)
    began = time.monotonic()
    r = sb.anon.get("/readyz", params={"waitSeconds": 1})
    assert time.monotonic() - began >= 0.9
    assert r.status_code == 503 and r.json()["reason"] == "runner_not_connected"
    for bad in ("6", "-1", "x", "nan"):
        assert sb.error(sb.anon.get("/readyz", params={"waitSeconds": bad}), 400)
