"""Exec API against a real agent and runner."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import signal
import time
from typing import Any

import pytest
from conftest import Sandbox, wait_until


def test_captured_output_exit_code_and_times(sandbox: Sandbox) -> None:
    ex = sandbox.sh("echo out; echo err >&2; exit 7")
    assert ex["status"] == "completed"
    assert ex["exitCode"] == 7
    assert ex["signal"] is None
    assert ex["stdout"] == "out\n"
    assert ex["stderr"] == "err\n"
    assert ex["stdoutBytes"] == 4 and ex["stderrBytes"] == 4
    assert not ex["stdoutTruncated"] and not ex["stderrTruncated"]
    assert not ex["timedOut"] and not ex["oomKilled"] and not ex["cancelled"]
    assert ex["createdAt"].endswith("Z") and ex["startedAt"] and ex["finishedAt"]
    assert ex["finishedAt"] >= ex["startedAt"] >= ex["createdAt"][:19]
    assert ex["durationSeconds"] >= 0
    assert ex["pid"] > 0
    assert ex["argv"] == ["/bin/sh", "-c", "echo out; echo err >&2; exit 7"]


def test_argv_form_runs_without_shell(sandbox: Sandbox) -> None:
    ex = sandbox.run(argv=["printf", "%s|", "a b", "$HOME", ";"])
    assert ex["stdout"] == "a b|$HOME|;|"
    assert ex["command"] is None


def test_env_and_cwd(sandbox: Sandbox, wsdir: str) -> None:
    (sandbox.workspace / wsdir / "sub").mkdir()
    ex = sandbox.sh('echo "$FOO"; pwd', env={"FOO": "bar baz"}, cwd=f"{wsdir}/sub")
    out = ex["stdout"].splitlines()
    assert out[0] == "bar baz"
    assert os.path.realpath(out[1]) == os.path.realpath(sandbox.workspace / wsdir / "sub")


def test_default_cwd_is_workspace_root(sandbox: Sandbox) -> None:
    ex = sandbox.sh("pwd")
    assert os.path.realpath(ex["stdout"].strip()) == os.path.realpath(sandbox.workspace)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({}, "invalid_request"),
        ({"command": "true", "argv": ["true"]}, "invalid_request"),
        ({"argv": []}, "invalid_request"),
        ({"argv": [""]}, "invalid_request"),
        ({"command": ""}, "invalid_request"),
        ({"command": "true", "timeoutSeconds": 0}, "invalid_request"),
        ({"command": "true", "timeoutSeconds": -1}, "invalid_request"),
        ({"command": "true", "timeoutSeconds": 10_000_000}, "timeout_too_large"),
        ({"command": "true", "env": {"A=B": "x"}}, "invalid_request"),
        ({"command": "true", "env": {"": "x"}}, "invalid_request"),
        ({"command": "true", "cwd": "does-not-exist"}, "invalid_cwd"),
        ({"command": "true", "cwd": "../"}, "path_traversal"),
        ({"command": "true", "stdin": "a", "stdinBase64": "YQ=="}, "invalid_request"),
        ({"command": "true", "stdinBase64": "%%%"}, "invalid_request"),
        ({"command": "true", "unknownField": 1}, "invalid_request"),
        ({"command": 5}, "invalid_request"),
        ({"command": "true", "idempotencyKey": ""}, "invalid_request"),
    ],
)
def test_invalid_exec_requests(sandbox: Sandbox, body: dict[str, Any], code: str) -> None:
    r = sandbox.client.post("/v1/executions", json=body)
    assert 400 <= r.status_code < 500
    assert sandbox.error(r, r.status_code) == code


def test_malformed_json_and_empty_body(sandbox: Sandbox) -> None:
    r = sandbox.client.post("/v1/executions", content=b"{not json")
    assert sandbox.error(r, 400) == "invalid_json"
    r = sandbox.client.post("/v1/executions", content=b"")
    assert sandbox.error(r, 400) == "invalid_request"
    r = sandbox.client.post("/v1/executions", content=b"[1,2]")
    assert sandbox.error(r, 400) == "invalid_request"


def test_spawn_failure_is_reported(sandbox: Sandbox) -> None:
    ex = sandbox.run(argv=["/definitely/not/here"])
    assert ex["status"] == "failed"
    assert ex["error"]["code"] == "spawn_failed"
    assert "No such file" in ex["error"]["message"]
    assert ex["exitCode"] is None


def test_stdin_text_and_base64(sandbox: Sandbox) -> None:
    ex = sandbox.run(argv=["cat"], stdin="hello\nworld")
    assert ex["stdout"] == "hello\nworld"
    raw = bytes(range(256))
    ex = sandbox.run(argv=["od", "-An", "-tx1", "-v"], stdinBase64=base64.b64encode(raw).decode())
    assert ex["stdout"].split() == [f"{b:02x}" for b in raw]


def test_stdin_defaults_to_dev_null(sandbox: Sandbox) -> None:
    ex = sandbox.run(argv=["cat"], timeoutSeconds=5)
    assert ex["status"] == "completed" and ex["stdout"] == ""


def test_interactive_stdin(sandbox: Sandbox) -> None:
    ex = sandbox.run(expect=202, argv=["cat"], stdinOpen=True, background=True)
    assert ex["stdinOpen"] is True
    for part in ("one\n", "two\n"):
        r = sandbox.client.post(f"/v1/executions/{ex['id']}/stdin", json={"data": part})
        assert r.status_code == 200 and r.json()["bytes"] == len(part)
    r = sandbox.client.post(
        f"/v1/executions/{ex['id']}/stdin",
        json={"dataBase64": base64.b64encode(b"three\n").decode(), "close": True},
    )
    assert r.json() == {"bytes": 6, "stdinOpen": False}
    done = sandbox.wait_finished(ex["id"])
    assert done["stdout"] == "one\ntwo\nthree\n"
    r = sandbox.client.post(f"/v1/executions/{ex['id']}/stdin", json={"data": "late"})
    assert sandbox.error(r, 409) == "stdin_closed"


def test_timeout_kills_process_group(sandbox: Sandbox, wsdir: str) -> None:
    marker = sandbox.workspace / wsdir / "survivor"
    t = time.monotonic()
    ex = sandbox.sh(f"(sleep 2; touch {marker}) & sleep 30", timeoutSeconds=0.5, cwd=wsdir)
    assert time.monotonic() - t < 10
    assert ex["status"] == "timed_out"
    assert ex["timedOut"] is True
    assert ex["signal"] == signal.SIGKILL and ex["signalName"] == "SIGKILL"
    assert ex["oomKilled"] is False
    time.sleep(2.5)
    assert not marker.exists(), "a grandchild survived the process-group kill"


def test_default_timeout_is_180_seconds(sandbox: Sandbox) -> None:
    ex = sandbox.sh("true")
    assert ex["timeoutSeconds"] == 180


def test_long_timeouts_are_allowed(sandbox: Sandbox) -> None:
    ex = sandbox.sh("true", timeoutSeconds=1800)
    assert ex["timeoutSeconds"] == 1800 and ex["status"] == "completed"


def test_sigkill_not_sent_by_agent_counts_as_oom(sandbox: Sandbox) -> None:
    ex = sandbox.sh("kill -9 $$")
    assert ex["status"] == "completed"
    assert ex["signal"] == 9
    assert ex["oomKilled"] is True


def test_huge_output_keeps_tail_and_full_log(sandbox: Sandbox) -> None:
    n = 12 * 1024 * 1024  # three times the 4 MiB capture cap
    ex = sandbox.sh(f"head -c {n} /dev/zero | tr '\\0' 'x'; printf END")
    assert ex["status"] == "completed"
    assert ex["stdoutBytes"] == n + 3
    assert ex["stdoutTruncated"] is True
    assert len(ex["stdout"]) == 4 * 1024 * 1024
    assert ex["stdout"].endswith("xxxEND")
    # the full output is on disk, readable by cursor
    cursor, total = 0, 0
    while True:
        r = sandbox.client.get(
            f"/v1/executions/{ex['id']}/output", params={"cursor": cursor, "maxBytes": 4 << 20}
        )
        page = r.json()
        total += sum(len(c["data"]) for c in page["chunks"])
        cursor = page["cursor"]
        if page["finished"]:
            break
    assert total == n + 3
    assert cursor == ex["outputCursor"]


def test_background_and_reattach_by_cursor(sandbox: Sandbox) -> None:
    ex = sandbox.run(
        expect=202,
        command="for i in 1 2 3 4 5; do echo line$i; sleep 0.2; done",
        background=True,
    )
    assert ex["status"] == "running" and ex["stdout"] is None
    r = sandbox.client.get(f"/v1/executions/{ex['id']}/output", params={"waitSeconds": 5})
    first = r.json()
    assert first["chunks"] and first["chunks"][0]["data"].startswith("line1")
    # "disconnect", then come back from the cursor we had
    cursor = first["cursor"]
    seen = "".join(c["data"] for c in first["chunks"])
    while True:
        page = sandbox.client.get(
            f"/v1/executions/{ex['id']}/output", params={"cursor": cursor, "waitSeconds": 5}
        ).json()
        seen += "".join(c["data"] for c in page["chunks"])
        cursor = page["cursor"]
        if page["finished"]:
            break
    assert seen == "".join(f"line{i}\n" for i in range(1, 6))
    assert page["status"] == "completed"


def test_output_cursor_validation(sandbox: Sandbox) -> None:
    ex = sandbox.sh("echo hello; echo world >&2")
    base = f"/v1/executions/{ex['id']}/output"
    r = sandbox.client.get(base, params={"cursor": ex["outputCursor"] + 1})
    assert sandbox.error(r, 400) == "invalid_cursor"
    r = sandbox.client.get(base, params={"cursor": 1})
    assert sandbox.error(r, 400) == "invalid_cursor"
    r = sandbox.client.get(base, params={"cursor": -1})
    assert sandbox.error(r, 400) == "invalid_request"
    r = sandbox.client.get(base, params={"cursor": "x"})
    assert sandbox.error(r, 400) == "invalid_request"
    page = sandbox.client.get(base, params={"encoding": "base64"}).json()
    streams = [(c["stream"], base64.b64decode(c["dataBase64"])) for c in page["chunks"]]
    assert streams == [("stdout", b"hello\n"), ("stderr", b"world\n")]


def _events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines if line.strip()]


def test_stream_ndjson(sandbox: Sandbox) -> None:
    with sandbox.client.stream(
        "POST",
        "/v1/executions/stream",
        json={"command": "echo a; sleep 0.3; echo b >&2; exit 3"},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        arrival: list[float] = []
        lines: list[str] = []
        for line in r.iter_lines():
            arrival.append(time.monotonic())
            lines.append(line)
    events = _events(lines)
    assert events[0]["type"] == "started"
    assert events[-1]["type"] == "finished"
    assert events[-1]["execution"]["exitCode"] == 3
    outs = [(e["stream"], e["data"]) for e in events if e["type"] == "output"]
    assert outs == [("stdout", "a\n"), ("stderr", "b\n")]
    # "a" must arrive before the command ends (streamed, not buffered)
    assert arrival[-1] - arrival[1] >= 0.2


def test_stream_started_event_names_the_pid(sandbox: Sandbox) -> None:
    events = _events(
        sandbox.client.post(
            "/v1/executions/stream", json={"argv": ["sh", "-c", "echo $$"]}
        ).text.splitlines()
    )
    started, finished = events[0], events[-1]
    assert started["type"] == "started" and finished["type"] == "finished"
    pid = started["execution"]["pid"]
    assert isinstance(pid, int) and pid > 0
    assert finished["execution"]["pid"] == pid
    assert "".join(e["data"] for e in events if e["type"] == "output") == f"{pid}\n"
    # Reattaching names it too.
    again = _events(
        sandbox.client.get(
            f"/v1/executions/{started['execution']['id']}/stream", params={"cursor": 0}
        ).text.splitlines()
    )
    assert again[0]["execution"]["pid"] == pid


def test_stream_of_a_command_that_does_not_start(sandbox: Sandbox) -> None:
    events = _events(
        sandbox.client.post(
            "/v1/executions/stream", json={"argv": ["/nonexistent/program"]}
        ).text.splitlines()
    )
    assert [e["type"] for e in events] == ["started", "finished"]
    assert events[0]["execution"]["pid"] is None
    assert events[-1]["execution"]["status"] == "failed"


def test_stream_sse(sandbox: Sandbox) -> None:
    r = sandbox.client.post(
        "/v1/executions/stream",
        json={"command": "echo hi"},
        headers={"Accept": "text/event-stream"},
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in r.text.split("\n\n") if b.strip()]
    kinds = [b.split("\n")[0] for b in blocks]
    assert kinds == ["event: started", "event: output", "event: finished"]
    data = json.loads(blocks[1].split("\n")[1][len("data: ") :])
    assert data["data"] == "hi\n"


def test_reattach_stream_from_cursor(sandbox: Sandbox) -> None:
    ex = sandbox.run(expect=202, command="echo one; sleep 0.3; echo two", background=True)
    first = sandbox.client.get(f"/v1/executions/{ex['id']}/output", params={"waitSeconds": 5})
    cursor = first.json()["cursor"]
    r = sandbox.client.get(f"/v1/executions/{ex['id']}/stream", params={"cursor": cursor})
    events = _events(r.text.splitlines())
    outs = "".join(e["data"] for e in events if e["type"] == "output")
    assert outs == "two\n"
    assert events[-1]["type"] == "finished"


def test_signal_and_cancel(sandbox: Sandbox) -> None:
    ex = sandbox.run(
        expect=202, command="trap 'echo got-term; exit 42' TERM; sleep 30 & wait", background=True
    )
    wait_until(lambda: sandbox.client.get(f"/v1/executions/{ex['id']}").json()["pid"])
    time.sleep(0.2)
    r = sandbox.client.post(f"/v1/executions/{ex['id']}/signal", json={"signal": "TERM"})
    assert r.status_code == 200
    done = sandbox.wait_finished(ex["id"])
    assert done["exitCode"] == 42 and "got-term" in done["stdout"]
    r = sandbox.client.post(f"/v1/executions/{ex['id']}/signal", json={"signal": "TERM"})
    assert sandbox.error(r, 409) == "not_running"

    ex = sandbox.run(expect=202, command="sleep 30", background=True)
    t = time.monotonic()
    r = sandbox.client.post(f"/v1/executions/{ex['id']}/cancel", json={})
    assert time.monotonic() - t < 5
    body = r.json()
    assert body["status"] == "cancelled" and body["cancelled"] is True
    assert body["signal"] == 9 and body["oomKilled"] is False


def test_cancel_with_grace_sends_term_first(sandbox: Sandbox) -> None:
    ex = sandbox.run(
        expect=202, command="trap 'echo bye; exit 0' TERM; sleep 30 & wait", background=True
    )
    wait_until(lambda: sandbox.client.get(f"/v1/executions/{ex['id']}").json()["pid"])
    time.sleep(0.2)
    r = sandbox.client.post(f"/v1/executions/{ex['id']}/cancel", json={"graceSeconds": 5})
    body = sandbox.client.get(f"/v1/executions/{ex['id']}").json()
    assert r.status_code == 200
    assert body["status"] == "cancelled" and body["exitCode"] == 0 and "bye" in body["stdout"]


@pytest.mark.parametrize("sig", ["SIGUSR1", "usr1", 10, "10"])
def test_signal_name_forms(sandbox: Sandbox, sig: Any) -> None:
    ex = sandbox.run(expect=202, command="sleep 30", background=True)
    wait_until(lambda: sandbox.client.get(f"/v1/executions/{ex['id']}").json()["pid"])
    r = sandbox.client.post(f"/v1/executions/{ex['id']}/signal", json={"signal": sig})
    assert r.status_code == 200, r.text
    done = sandbox.wait_finished(ex["id"])
    assert done["signal"] == signal.SIGUSR1


@pytest.mark.parametrize("sig", ["SIGNOPE", "", 0, 65, "-1", 3.5])
def test_invalid_signals(sandbox: Sandbox, sig: Any) -> None:
    ex = sandbox.run(expect=202, command="sleep 30", background=True)
    try:
        r = sandbox.client.post(f"/v1/executions/{ex['id']}/signal", json={"signal": sig})
        assert 400 <= r.status_code < 500 and "error" in r.json()
    finally:
        sandbox.client.post(f"/v1/executions/{ex['id']}/cancel")


def test_unknown_execution_is_404(sandbox: Sandbox) -> None:
    for method, path in [
        ("GET", "/v1/executions/nope"),
        ("GET", "/v1/executions/nope/output"),
        ("GET", "/v1/executions/nope/stream"),
        ("POST", "/v1/executions/nope/cancel"),
        ("DELETE", "/v1/executions/nope"),
    ]:
        r = sandbox.client.request(method, path)
        assert sandbox.error(r, 404) == "not_found"


def _keyed(command: str, cwd: str, key: str, **more: Any) -> dict[str, Any]:
    """An exec body with an idempotency key unique to the test (its directory)."""
    return {"command": command, "cwd": cwd, "idempotencyKey": f"{key}-{cwd}", **more}


def test_idempotency_key_runs_once(sandbox: Sandbox, wsdir: str) -> None:
    body = _keyed("echo run >> count; sleep 0.5; wc -l < count", wsdir, "uid", background=True)
    first = sandbox.client.post("/v1/executions", json=body)
    assert first.status_code == 202
    second = sandbox.client.post("/v1/executions", json=body)  # while running
    assert second.status_code == 200
    assert second.headers["idempotent-replayed"] == "true"
    assert second.json()["id"] == first.json()["id"]
    done = sandbox.wait_finished(first.json()["id"])
    third = sandbox.client.post("/v1/executions", json={**body, "background": False})  # finished
    assert third.json()["id"] == first.json()["id"]
    assert third.json()["stdout"] == done["stdout"] == "1\n"
    assert (sandbox.workspace / wsdir / "count").read_text() == "run\n"
    # same key, different command: refused, nothing runs
    r = sandbox.client.post("/v1/executions", json={**body, "command": "echo other"})
    assert sandbox.error(r, 409) == "idempotency_key_reused"


def test_idempotent_replay_after_cwd_removed(sandbox: Sandbox, wsdir: str) -> None:
    (sandbox.workspace / wsdir / "tmpdir").mkdir()
    body = _keyed("echo hi", f"{wsdir}/tmpdir", "cwd")
    first = sandbox.client.post("/v1/executions", json=body).json()
    (sandbox.workspace / wsdir / "tmpdir").rmdir()
    again = sandbox.client.post("/v1/executions", json=body)
    assert again.status_code == 200 and again.json()["id"] == first["id"]


def test_idempotency_key_header(sandbox: Sandbox, wsdir: str) -> None:
    key = {"Idempotency-Key": f"hdr-{wsdir}"}
    a = sandbox.client.post("/v1/executions", json={"command": "echo $$"}, headers=key)
    b = sandbox.client.post("/v1/executions", json={"command": "echo $$"}, headers=key)
    assert a.json()["id"] == b.json()["id"] and a.json()["stdout"] == b.json()["stdout"]
    r = sandbox.client.post(
        "/v1/executions", json={"command": "echo $$", "idempotencyKey": "other"}, headers=key
    )
    assert sandbox.error(r, 400) == "invalid_request"


def test_concurrent_idempotent_submissions_start_one_process(sandbox: Sandbox, wsdir: str) -> None:
    body = _keyed("echo x >> runs; sleep 0.3", wsdir, "race")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        ids = set(
            pool.map(
                lambda _: sandbox.client.post("/v1/executions", json=body).json()["id"], range(8)
            )
        )
    assert len(ids) == 1
    assert (sandbox.workspace / wsdir / "runs").read_text() == "x\n"


def test_concurrent_executions_run_in_parallel(sandbox: Sandbox) -> None:
    t = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        results = list(pool.map(lambda i: sandbox.sh(f"sleep 1; echo {i}"), range(10)))
    elapsed = time.monotonic() - t
    assert sorted(int(r["stdout"]) for r in results) == list(range(10))
    assert elapsed < 5, f"10 x sleep 1 took {elapsed:.1f}s: not concurrent"


def test_background_grandchild_does_not_hang_result(sandbox: Sandbox) -> None:
    t = time.monotonic()
    ex = sandbox.sh("sleep 5 & echo started")
    assert time.monotonic() - t < 4
    assert ex["status"] == "completed" and ex["stdout"] == "started\n"


def test_list_get_and_delete(sandbox: Sandbox) -> None:
    ex = sandbox.sh("echo listed")
    listed = sandbox.client.get("/v1/executions", params={"status": "completed"}).json()
    entry = next(e for e in listed["executions"] if e["id"] == ex["id"])
    assert entry["stdout"] is None
    got = sandbox.client.get(f"/v1/executions/{ex['id']}", params={"output": "false"}).json()
    assert got["stdout"] is None and got["exitCode"] == 0
    got = sandbox.client.get(f"/v1/executions/{ex['id']}").json()
    assert got["stdout"] == "listed\n"
    running = sandbox.run(expect=202, command="sleep 30", background=True)
    r = sandbox.client.delete(f"/v1/executions/{running['id']}")
    assert sandbox.error(r, 409) == "still_running"
    sandbox.client.post(f"/v1/executions/{running['id']}/cancel")
    assert sandbox.client.delete(f"/v1/executions/{ex['id']}").status_code == 204
    assert sandbox.client.get(f"/v1/executions/{ex['id']}").status_code == 404


def test_utf8_and_binary_output(sandbox: Sandbox) -> None:
    ex = sandbox.sh("printf 'h\\303\\251llo \\377\\n'")
    assert ex["stdout"] == "héllo \ufffd\n"
    page = sandbox.client.get(
        f"/v1/executions/{ex['id']}/output", params={"encoding": "base64"}
    ).json()
    assert base64.b64decode(page["chunks"][0]["dataBase64"]) == "héllo ".encode() + b"\xff\n"


def test_resource_usage_reported(sandbox: Sandbox) -> None:
    ex = sandbox.sh("i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done")
    assert ex["userCpuSeconds"] is not None and ex["userCpuSeconds"] > 0
    assert ex["maxRssKib"] > 0


def test_stdin_closed_by_the_command_is_reported(sandbox: Sandbox) -> None:
    ex = sandbox.run(expect=202, command="exec 0<&-; sleep 2", stdinOpen=True, background=True)
    wait_until(lambda: sandbox.client.get(f"/v1/executions/{ex['id']}").json()["pid"])
    time.sleep(0.3)
    # the first write hits EPIPE in the runner, which tells the agent
    sandbox.client.post(f"/v1/executions/{ex['id']}/stdin", json={"data": "x" * 100})
    wait_until(lambda: not sandbox.client.get(f"/v1/executions/{ex['id']}").json()["stdinOpen"])
    r = sandbox.client.post(f"/v1/executions/{ex['id']}/stdin", json={"data": "more"})
    assert sandbox.error(r, 409) == "stdin_closed"
    sandbox.client.post(f"/v1/executions/{ex['id']}/cancel")


# Two streams written in turn, one line at a time (shell builtins: one write each).
ALTERNATING = 'i=0; while [ $i -lt 300 ]; do echo "o$i"; echo "e$i" >&2; i=$((i+1)); done'
IN_TURN = "".join(f"o{i}\ne{i}\n" for i in range(300))


def test_combined_output_keeps_the_true_order(sandbox: Sandbox) -> None:
    ex = sandbox.sh(ALTERNATING, combinedOutput=True)
    assert ex["stdout"] == IN_TURN
    assert ex["stderr"] == "" and ex["stderrBytes"] == 0  # all of it is in stdout
    assert ex["combinedOutput"] is True
    # the same through the event stream
    with sandbox.client.stream(
        "POST", "/v1/executions/stream", json={"command": ALTERNATING, "combinedOutput": True}
    ) as r:
        events = _events(list(r.iter_lines()))
    outs = [e for e in events if e["type"] == "output"]
    assert {e["stream"] for e in outs} == {"stdout"}
    assert "".join(e["data"] for e in outs) == IN_TURN
    assert events[-1]["execution"]["combinedOutput"] is True
    # and in the background, read back by cursor
    bg = sandbox.run(expect=202, command=ALTERNATING, combinedOutput=True, background=True)
    sandbox.wait_finished(bg["id"])
    page = sandbox.client.get(f"/v1/executions/{bg['id']}/output").json()
    assert "".join(c["data"] for c in page["chunks"]) == IN_TURN
    assert {c["stream"] for c in page["chunks"]} == {"stdout"}


def test_separate_streams_stay_the_default(sandbox: Sandbox) -> None:
    ex = sandbox.sh(ALTERNATING)
    assert ex["combinedOutput"] is False
    assert ex["stdout"] == "".join(f"o{i}\n" for i in range(300))
    assert ex["stderr"] == "".join(f"e{i}\n" for i in range(300))


def test_script_of_one_mebibyte_does_not_go_through_argv(sandbox: Sandbox) -> None:
    # Linux refuses a single argument over 128 KiB ("Argument list too long").
    line = "n=$((n+1)) # " + "x" * 50 + "\n"  # 64 bytes
    script = 'n=0\nprintf "%s|%s|" "$0" "$#"\n' + line * 16384 + 'echo "$n"\n'
    assert len(script) > 1 << 20
    ex = sandbox.sh(script, timeoutSeconds=120)
    assert ex["status"] == "completed", ex["error"]
    assert ex["stdout"] == "/bin/sh|0|16384\n"  # $0 and the positional parameters as with -c
    assert ex["exitCode"] == 0
    # The record keeps the script's first 4 KiB (it ran whole).
    assert ex["commandTruncated"] is True and ex["commandBytes"] == len(script)
    assert ex["argv"] == ["/bin/sh", "-c", ex["command"]] and script.startswith(ex["command"])
    # the idempotency fingerprint still tells scripts apart
    key = {"idempotencyKey": f"big-{time.monotonic_ns()}"}
    assert sandbox.sh(script[:-10] + "echo x\n", **key)["status"] == "completed"
    r = sandbox.client.post("/v1/executions", json={"command": script, **key})
    assert sandbox.error(r, 409) == "idempotency_key_reused"


def test_script_reads_stdin_and_exits_like_sh_c(sandbox: Sandbox) -> None:
    ex = sandbox.sh('read a; echo "got $a"; exit 5', stdin="hello\n")
    assert ex["stdout"] == "got hello\n" and ex["exitCode"] == 5
    ex = sandbox.sh("if then", timeoutSeconds=10)  # a syntax error fails the command
    assert ex["status"] == "completed" and ex["exitCode"] != 0 and ex["stderr"]


def test_timeout_above_the_maximum_names_it(sandbox: Sandbox) -> None:
    info = sandbox.client.get("/v1/info").json()
    assert info["maxTimeoutSeconds"] == 3600 and info["defaultTimeoutSeconds"] == 180
    r = sandbox.client.post("/v1/executions", json={"command": "true", "timeoutSeconds": 3601})
    assert sandbox.error(r, 400) == "timeout_too_large"
    assert "3600" in r.json()["error"]["message"]
    assert r.json()["error"]["details"] == {"maximum": 3600}
    assert sandbox.sh("true", timeoutSeconds=3600)["status"] == "completed"
