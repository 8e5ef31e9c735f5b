"""Quiesce and resume: running executions stop writing while a snapshot is cut."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from conftest import Sandbox, wait_until

# Appends a line every 20 ms for up to a minute: a writer whose progress is visible.
WRITER = "i=0; while [ $i -lt 3000 ]; do echo $i >> {path}; i=$((i+1)); sleep 0.02; done"


def _size(sandbox: Sandbox, path: str) -> int:
    return len(sandbox.read(path))


def _start_writer(sandbox: Sandbox, path: str) -> dict[str, Any]:
    ex = sandbox.run(expect=202, command=WRITER.format(path=path), background=True)
    wait_until(lambda: (sandbox.workspace / path).exists() and _size(sandbox, path) > 0)
    return ex


def _quiesce(sandbox: Sandbox, seconds: float) -> dict[str, Any]:
    r = sandbox.client.post("/v1/workspace/quiesce", json={"seconds": seconds})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _still(sandbox: Sandbox, path: str, seconds: float = 0.6) -> bool:
    before = _size(sandbox, path)
    time.sleep(seconds)
    return _size(sandbox, path) == before


def test_quiesce_stops_writers_until_resume(sandbox: Sandbox, wsdir: str) -> None:
    path = f"{wsdir}/log.txt"
    ex = _start_writer(sandbox, path)
    try:
        body = _quiesce(sandbox, 60)
        assert body["quiesced"] == [ex["id"]]
        assert body["synced"] is True and body["resumeAt"].endswith("Z")
        # A stopped process group may finish the write it was in: give it a moment.
        time.sleep(0.2)
        assert _still(sandbox, path), "the writer kept writing while quiesced"
        status = sandbox.client.get(f"/v1/executions/{ex['id']}").json()["status"]
        assert status == "running"

        r = sandbox.client.post("/v1/workspace/resume")
        assert r.status_code == 200, r.text
        assert not _still(sandbox, path), "the writer did not continue after resume"
    finally:
        sandbox.client.post(f"/v1/executions/{ex['id']}/cancel", json={})


def test_quiesce_resumes_by_itself_after_its_bound(sandbox: Sandbox, wsdir: str) -> None:
    path = f"{wsdir}/log.txt"
    ex = _start_writer(sandbox, path)
    try:
        _quiesce(sandbox, 1)
        time.sleep(0.2)
        assert _still(sandbox, path, 0.4)
        # Nobody calls resume (a crashed operator): the agent continues the writer.
        time.sleep(1.0)
        assert not _still(sandbox, path), "the writer stayed frozen past the bound"
    finally:
        sandbox.client.post(f"/v1/executions/{ex['id']}/cancel", json={})


def test_quiesce_without_executions_and_bad_input(sandbox: Sandbox) -> None:
    # The shared sandbox may have no running execution: quiesce still syncs.
    r = sandbox.client.post("/v1/workspace/quiesce", content=b"")
    assert r.status_code == 200, r.text
    assert r.json()["synced"] is True
    assert sandbox.client.post("/v1/workspace/resume").status_code == 200
    assert sandbox.error(sandbox.client.post("/v1/workspace/quiesce", json={"seconds": 0}), 400)
    assert sandbox.error(sandbox.client.post("/v1/workspace/quiesce", json={"seconds": 601}), 400)
    assert sandbox.error(sandbox.client.post("/v1/workspace/quiesce", json={"x": 1}), 400)
    assert sandbox.anon.post("/v1/workspace/quiesce").status_code == 401


def test_quiesce_refuses_when_the_runner_is_gone(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    ex = sb.run(expect=202, command="sleep 30", background=True)
    assert ex["status"] == "running"
    sb.kill_runner()
    wait_until(lambda: sb.anon.get("/readyz").status_code == 503)
    r = sb.client.post("/v1/workspace/quiesce", json={"seconds": 5})
    # The runner's death ends its executions ("lost"); if the agent has not noticed
    # yet, it must refuse rather than claim a quiesce it cannot do.
    if r.status_code == 503:
        assert sb.error(r, 503) == "runner_unavailable"
    else:
        assert r.status_code == 200, r.text
        assert r.json()["quiesced"] == []


def test_writes_wait_while_quiesced_and_reads_do_not(sandbox: Sandbox, wsdir: str) -> None:
    path = f"{wsdir}/late.txt"
    _quiesce(sandbox, 1.5)
    began = time.monotonic()
    # A read goes through at once.
    assert sandbox.client.get("/v1/info").status_code == 200
    assert time.monotonic() - began < 1.0
    # A write waits for the resume (here: the quiesce's own bound), then lands.
    sandbox.write(path, b"after\n")
    waited = time.monotonic() - began
    assert waited >= 1.0, waited
    assert sandbox.read(path) == b"after\n"
    # And a command, after an explicit resume, starts at once.
    sandbox.client.post("/v1/workspace/quiesce", json={"seconds": 30})
    sandbox.client.post("/v1/workspace/resume")
    began = time.monotonic()
    assert sandbox.sh("true")["exitCode"] == 0
    assert time.monotonic() - began < 5
