"""Idempotency across an agent restart (the journal), with the real runner kept."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from conftest import Sandbox, wait_until


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_keys_survive_agent_restart(fresh: Callable[..., Sandbox], how: int) -> None:
    sb = fresh()
    done = sb.sh("echo once >> ran.txt; echo finished", idempotencyKey="k-done")
    running = sb.run(
        expect=202,
        command="echo started >> ran.txt; sleep 30; echo never >> ran.txt",
        background=True,
        idempotencyKey="k-running",
    )
    pid = wait_until(lambda: sb.client.get(f"/v1/executions/{running['id']}").json()["pid"])
    wait_until(lambda: (sb.workspace / "ran.txt").read_text().count("started") == 1)
    assert sb.agent is not None
    sb.agent.send_signal(how)
    sb.agent.wait(10)
    # the runner kills what nobody can observe any more
    wait_until(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), 5)
    sb.start_agent()
    wait_until(lambda: sb.anon.get("/readyz").status_code == 200)

    again = sb.sh("echo once >> ran.txt; echo finished", idempotencyKey="k-done")
    assert again["id"] == done["id"]
    assert again["status"] == "completed" and again["exitCode"] == 0
    assert again["stdoutBytes"] == len("finished\n")

    lost = sb.run(
        expect=200,
        command="echo started >> ran.txt; sleep 30; echo never >> ran.txt",
        background=True,
        idempotencyKey="k-running",
    )
    assert lost["id"] == running["id"]
    assert lost["status"] == "lost"
    assert lost["error"]["code"] == (
        "agent_stopping" if how == signal.SIGTERM else "agent_restarted"
    )
    assert (sb.workspace / "ran.txt").read_text() == "once\nstarted\n"  # nothing ran twice

    # A streamed POST retried with its key (a client that lost the connection
    # before the first header) hears how the command ended, not an error.
    events = _events(
        sb.client.post(
            "/v1/executions/stream",
            json={
                "command": "echo started >> ran.txt; sleep 30; echo never >> ran.txt",
                "background": True,
                "idempotencyKey": "k-running",
            },
        )
    )
    assert [e["type"] for e in events] == ["started", "truncated", "finished"]
    assert events[-1]["execution"]["status"] == "lost"
    # A reader's cursor from before the restart is past the restored log: gone.
    r = sb.client.get(f"/v1/executions/{running['id']}/stream", params={"cursor": 4096})
    assert sb.error(r, 410) == "log_pruned"
    assert (sb.workspace / "ran.txt").read_text() == "once\nstarted\n"

    r = sb.client.post("/v1/executions", json={"command": "echo other", "idempotencyKey": "k-done"})
    assert sb.error(r, 409) == "idempotency_key_reused"
    listed = {e["id"] for e in sb.client.get("/v1/executions").json()["executions"]}
    assert {done["id"], running["id"]} <= listed


def test_spilled_output_readable_after_restart(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(env={"SANDBOX_AGENT_LOG_MEMORY_BYTES": "1000"})
    ex = sb.sh("head -c 5000 /dev/zero | tr '\\0' z")
    small = sb.sh("echo tiny")
    assert sb.agent is not None
    sb.agent.terminate()
    sb.agent.wait(10)
    sb.start_agent()
    page = sb.client.get(f"/v1/executions/{ex['id']}/output", params={"maxBytes": 1 << 20}).json()
    assert "".join(c["data"] for c in page["chunks"]) == "z" * 5000
    r = sb.client.get(f"/v1/executions/{small['id']}/output")
    assert sb.error(r, 410) == "log_pruned"  # it only lived in memory
    got = sb.client.get(f"/v1/executions/{small['id']}").json()
    assert got["exitCode"] == 0 and got["stdoutTruncated"] is True


def test_corrupt_journal_is_survived(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    sb.sh("true", idempotencyKey="before")
    assert sb.agent is not None
    sb.agent.terminate()
    sb.agent.wait(10)
    with open(sb.logs / "executions.journal", "ab") as f:
        f.write(b'{"op":"new","id":"x","key":"half-written\n[1,2]\n{"op":"end"}\n\xff\xfe\n')
    sb.start_agent()
    wait_until(lambda: sb.anon.get("/readyz").status_code == 200)
    assert sb.sh("true", idempotencyKey="before")["status"] == "completed"
    assert sb.sh("echo after")["stdout"] == "after\n"


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines() if line]


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_records_keep_a_prefix_of_long_commands(fresh: Callable[..., Sandbox]) -> None:
    """A 4 MiB script runs whole, but its record (kept for up to max_records
    executions, and journaled) keeps only its first 4 KiB and its size; the
    idempotency key still tells that script from another."""
    sb = fresh()
    script = "true\n" + "# " + "é" * (2 << 20) + "\necho ran\n"  # ~4 MiB of UTF-8
    size = len(script.encode())
    ids = []
    for i in range(6):
        done = sb.sh(script, idempotencyKey=f"big-{i}")
        assert done["stdout"] == "ran\n", done
        assert done["commandTruncated"] is True and done["commandBytes"] == size
        assert done["command"].startswith("true\n# é") and len(done["command"].encode()) <= 4096
        ids.append(done["id"])
    assert (sb.logs / "executions.journal").stat().st_size < 100_000
    listed = sb.client.get("/v1/executions").json()["executions"]
    assert sum(len(e["command"]) for e in listed) < 6 * 4096
    r = sb.client.post(
        "/v1/executions", json={"command": script + "# other\n", "idempotencyKey": "big-0"}
    )
    assert sb.error(r, 409) == "idempotency_key_reused"
    assert sb.agent is not None
    sb.agent.terminate()
    sb.agent.wait(10)
    sb.start_agent()
    again = sb.sh(script, idempotencyKey="big-0")
    assert again["id"] == ids[0] and again["commandTruncated"] is True
    assert again["commandBytes"] == size
    small = sb.sh("echo hi")
    assert small["command"] == "echo hi" and small["commandTruncated"] is False


def test_the_journal_counts_against_the_log_budget(fresh: Callable[..., Sandbox]) -> None:
    """Output logs and the journal share the log directory's budget: logs of
    finished commands are pruned to leave the journal its room."""
    budget = 400_000
    sb = fresh(max_log_dir_bytes=budget, log_memory_bytes=1000)  # every log spills to disk
    script = "head -c 20000 /dev/zero | tr '\\0' o\n# " + "x" * 5000 + "\n"
    for _ in range(60):
        assert sb.sh(script)["exitCode"] == 0
    journal = (sb.logs / "executions.journal").stat().st_size
    logs = sum(p.stat().st_size for p in sb.logs.glob("*.log"))
    assert journal > 100_000  # 60 records of 4 KiB commands
    assert journal + logs <= budget, (journal, logs)
