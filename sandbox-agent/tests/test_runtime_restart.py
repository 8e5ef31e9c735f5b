"""Kills that need no cooperation from the runner: when the runner cannot end a
command, the agent asks for the sandbox container to be restarted
(GET /livez/runtime: 503), and takes that back once the runtime is replaced."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import Sandbox, wait_until


def _bg(sb: Sandbox, **body: Any) -> dict[str, Any]:
    ex = sb.run(expect=202, command="sleep 300", background=True, **body)
    ex["pid"] = wait_until(lambda: sb.client.get(f"/v1/executions/{ex['id']}").json()["pid"])
    return ex


def _replace_runtime(sb: Sandbox, pids: list[int]) -> None:
    """What the kubelet and the kernel do on a liveness failure: the container's
    processes all die (here: the runner and its commands' process groups), then a
    new runner starts."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    sb.kill_runner(signal.SIGKILL)  # works on a stopped process too
    sb.start_runner()


@pytest.fixture
def stopped() -> Iterator[list[int]]:
    """Runner pids the test stops; continued at the end whatever happens."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _metric(sb: Sandbox) -> str:
    text = sb.client.get("/metrics").text
    return next(
        line
        for line in text.splitlines()
        if line.startswith("sandbox_agent_runtime_restart_requested ")
    )


def test_unconfirmed_kill_requests_a_runtime_restart(
    fresh: Callable[..., Sandbox], stopped: list[int]
) -> None:
    sb = fresh(kill_grace=1, runner_stall_seconds=0)
    assert sb.anon.get("/livez/runtime").json() == {"status": "ok"}
    other = _bg(sb)
    timing_out = _bg(sb, timeoutSeconds=3)
    cancelled = _bg(sb)
    assert sb.runner is not None
    stopped.append(sb.runner.pid)
    os.kill(sb.runner.pid, signal.SIGSTOP)  # the runner can confirm nothing now

    sent = time.monotonic()
    r = sb.client.post(f"/v1/executions/{cancelled['id']}/cancel", json={})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "cancelled", r.json()
    assert r.json()["error"]["code"] == "runner_unresponsive"
    live = wait_until(lambda: (x := sb.anon.get("/livez/runtime")).status_code == 503 and x)
    latency = time.monotonic() - sent
    body = live.json()
    assert body["status"] == "restart_requested" and body["reason"] == "kill_not_confirmed"
    assert "did not confirm the kill (cancel) within 1s" in body["message"]
    assert body["since"].endswith("Z") and cancelled["id"] in body["executions"]
    assert latency >= 1.0  # not before the kill grace
    print(f"unconfirmed kill -> 503 after {latency:.2f}s (kill grace 1s)")

    done = sb.wait_finished(timing_out["id"], 30)
    assert done["status"] == "timed_out" and done["error"]["code"] == "runner_unresponsive"
    assert timing_out["id"] in sb.anon.get("/livez/runtime").json()["executions"]
    info = sb.client.get("/v1/info").json()
    assert info["runtimeRestartRequested"] is True
    assert info["runtimeRestart"]["reason"] == "kill_not_confirmed"
    assert _metric(sb).endswith(" 1.0")
    assert sb.anon.get("/readyz").json()["reason"] == "runtime_restart_pending"
    r = sb.client.post("/v1/executions", json={"command": "true"})
    assert sb.error(r, 503) == "runtime_restarting"
    assert sb.client.get(f"/v1/executions/{other['id']}").json()["status"] == "running"

    _replace_runtime(sb, [other["pid"], timing_out["pid"], cancelled["pid"]])
    assert sb.anon.get("/livez/runtime").json() == {"status": "ok"}
    assert sb.client.get("/v1/info").json()["runtimeRestartRequested"] is False
    assert _metric(sb).endswith(" 0.0")
    lost = sb.wait_finished(other["id"], 10)
    assert lost["status"] == "lost" and lost["error"]["code"] == "runtime_restarted"
    assert "restarted to kill a command that would not die" in lost["error"]["message"]
    assert sb.wait_finished(timing_out["id"])["status"] == "timed_out"
    assert sb.wait_finished(cancelled["id"])["status"] == "cancelled"
    assert sb.sh("echo fine")["stdout"] == "fine\n"
    assert sb.anon.get("/livez/runtime").status_code == 200  # and it stays so


def test_stalled_runner_requests_a_restart_that_survives_an_agent_restart(
    fresh: Callable[..., Sandbox], stopped: list[int]
) -> None:
    sb = fresh(runner_stall_seconds=1)
    running = _bg(sb)
    assert sb.runner is not None
    stopped.append(sb.runner.pid)
    os.kill(sb.runner.pid, signal.SIGSTOP)
    live = wait_until(lambda: (x := sb.anon.get("/livez/runtime")).status_code == 503 and x, 30)
    assert live.json()["reason"] == "runner_unresponsive"
    assert live.json()["executions"] == [running["id"]]

    # A restarted agent remembers (the old runner is still there, wedged).
    assert sb.agent is not None
    sb.agent.terminate()
    sb.agent.wait(10)
    sb.start_agent()
    assert sb.anon.get("/livez/runtime").json()["reason"] == "runner_unresponsive"
    # It is a new runner instance that ends the request (this agent never saw
    # the old connection close).
    _replace_runtime(sb, [running["pid"]])
    assert sb.anon.get("/livez/runtime").json() == {"status": "ok"}
    assert sb.sh("echo fine")["stdout"] == "fine\n"


def test_a_slow_but_working_runner_is_left_alone(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(runner_stall_seconds=1)
    ex = sb.sh("sleep 2.5; echo done")
    assert ex["stdout"] == "done\n"
    assert sb.anon.get("/livez/runtime").status_code == 200
