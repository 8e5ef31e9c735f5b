"""Code contexts with real Jupyter kernels, started by the real runner."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import Sandbox, wait_until


def run(sb: Sandbox, code: str, **body: Any) -> list[dict[str, Any]]:
    r = sb.client.post("/v1/code/run", json={"code": code, **body}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    events = [json.loads(line) for line in r.text.splitlines() if line]
    assert events[0]["type"] == "started" and events[-1]["type"] == "finished", events
    return events


def kinds(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


def main_result(events: list[dict[str, Any]]) -> dict[str, Any]:
    (result,) = [e for e in events if e["type"] == "result" and e.get("isMain")]
    return result


def test_state_output_results_and_errors(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    first = run(sb, "x = 41\nprint('out'); import sys; print('err', file=sys.stderr)\nx + 1")
    assert first[0]["contextId"] == "default-python"
    assert [e["text"] for e in kinds(first, "stdout")] == ["out\n"]
    assert [e["text"] for e in kinds(first, "stderr")] == ["err\n"]
    result = main_result(first)
    assert result["data"] == {"text/plain": "42"} and result["executionCount"] == 1
    assert first[-1]["status"] == "ok" and first[-1]["executionCount"] == 1

    shown = run(
        sb,
        "from IPython.display import HTML, display\ndisplay(HTML('<b>bold</b>'))\n{'a': [1, 2]}",
    )
    display = [e for e in kinds(shown, "result") if not e["isMain"]]
    assert display[0]["data"]["text/html"] == "<b>bold</b>"
    assert main_result(shown)["data"]["text/plain"] == "{'a': [1, 2]}"

    failed = run(sb, "def f():\n    return 1 / 0\nf()")
    (error,) = kinds(failed, "error")
    assert error["name"] == "ZeroDivisionError" and error["value"] == "division by zero"
    assert any("f()" in line for line in error["traceback"])
    assert failed[-1]["status"] == "error"
    # the context lives on, with its state
    assert main_result(run(sb, "x"))["data"]["text/plain"] == "41"
    listed = sb.client.get("/v1/contexts").json()["contexts"]
    assert [(c["id"], c["status"], c["executions"]) for c in listed] == [
        ("default-python", "idle", 4)
    ]


def test_timeout_interrupts_and_keeps_state(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    run(sb, "kept = 'yes'")
    events = run(sb, "while True:\n    pass", timeoutSeconds=1)
    assert events[-1]["status"] == "timed_out", events
    assert kinds(events, "error")[0]["name"] == "KeyboardInterrupt"
    assert "restarted" not in events[-1]
    assert main_result(run(sb, "kept"))["data"]["text/plain"] == "'yes'"


def test_code_deaf_to_interrupts_gets_a_new_kernel(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    run(sb, "kept = 1")
    events = run(
        sb,
        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n"
        "    time.sleep(0.1)",
        timeoutSeconds=1,
    )
    assert events[-1]["status"] == "timed_out" and events[-1]["restarted"] is True, events
    assert "interrupt" in events[-1]["message"]
    after = run(sb, "'kept' in dir()")
    assert main_result(after)["data"]["text/plain"] == "False"  # a new kernel: state gone
    (ctx,) = sb.client.get("/v1/contexts").json()["contexts"]
    assert ctx["restarts"] == 1 and ctx["status"] == "idle"


def test_contexts_are_separate_and_restart_clears(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    (sb.workspace / "sub").mkdir()
    r = sb.client.post("/v1/contexts", json={"language": "python", "cwd": "sub"}, timeout=120)
    assert r.status_code == 201, r.text
    ctx = r.json()
    assert ctx["status"] == "idle" and ctx["cwd"] == "sub" and ctx["pid"]
    run(sb, "secret = 'a'", contextId=ctx["id"])
    other = run(sb, "'secret' in dir()")  # the default context
    assert main_result(other)["data"]["text/plain"] == "False"
    cwd = run(sb, "import os; os.getcwd()", contextId=ctx["id"])
    assert main_result(cwd)["data"]["text/plain"].endswith("/sub'")

    r = sb.client.post(f"/v1/contexts/{ctx['id']}/restart", timeout=120)
    assert r.status_code == 200 and r.json()["restarts"] == 1
    gone = run(sb, "'secret' in dir()", contextId=ctx["id"])
    assert main_result(gone)["data"]["text/plain"] == "False"

    assert sb.client.delete(f"/v1/contexts/{ctx['id']}").status_code == 204
    r = sb.client.post("/v1/code/run", json={"code": "1", "contextId": ctx["id"]})
    assert sb.error(r, 404) == "context_not_found"


def test_a_client_that_leaves_interrupts_its_run(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    run(sb, "n = 0")
    with sb.client.stream(
        "POST", "/v1/code/run", json={"code": "import time\nwhile True:\n    time.sleep(0.05)"}
    ) as r:
        assert r.status_code == 200
        first = next(r.iter_lines())
        assert json.loads(first)["type"] == "started"
    # the next run gets its turn once the abandoned one was interrupted (a run
    # in progress is activity, as a running command is)
    began = time.monotonic()
    after = run(sb, "n + 1")
    assert time.monotonic() - began < 60
    if after[0].get("restarted"):
        # On a loaded machine the interrupt may take longer than its grace: the
        # kernel was started again, and the run says so.
        assert kinds(after, "error")[0]["name"] == "NameError", after
    else:
        assert main_result(after)["data"]["text/plain"] == "1"


def test_bad_requests(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(env={"SANDBOX_AGENT_MAX_CONTEXTS": "2"})
    r = sb.client.post("/v1/code/run", json={"code": "1", "language": "cobol"})
    assert sb.error(r, 400) == "invalid_request"
    r = sb.client.post("/v1/code/run", json={"code": "1", "contextId": "../x"})
    assert sb.error(r, 400) == "invalid_request"
    r = sb.client.post("/v1/code/run", json={"code": "1", "timeoutSeconds": 0})
    assert sb.error(r, 400) == "invalid_request"
    r = sb.client.post("/v1/contexts", json={"cwd": "../outside"})
    assert sb.error(r, 400) == "path_traversal"
    r = sb.client.get("/v1/contexts/ctx-none")
    assert sb.error(r, 404) == "context_not_found"
    for _ in range(2):
        assert sb.client.post("/v1/contexts", json={}, timeout=120).status_code == 201
    r = sb.client.post("/v1/contexts", json={}, timeout=120)
    assert sb.error(r, 429) == "too_many_contexts"


def test_an_image_without_jupyter_is_told_so(
    fresh: Callable[..., Sandbox], world_tmp: Path
) -> None:
    # The runner as another user runs on the system python3, which has no
    # jupyter_client: what an image without it gives.
    sb = fresh(runner=False, root=world_tmp)
    os.chmod(sb.root, 0o755)
    sb.start_runner(user=65534)
    for _ in range(3):  # each time a new default context: none kills the next one's bridge
        r = sb.client.post("/v1/code/run", json={"code": "1"}, timeout=120)
        assert sb.error(r, 409) == "kernel_unavailable"  # the image's, not a passing failure
        assert "jupyter_client" in r.json()["error"]["message"]
    assert sb.client.get("/v1/contexts").json()["contexts"] == []
    assert sb.sh("echo still")["stdout"] == "still\n"


def test_a_planted_bridge_cannot_hurt_the_agent(fresh: Callable[..., Sandbox]) -> None:
    """User code may replace kernel.py; what it says is bounded and checked."""
    sb = fresh()
    (sb.runtime / "kernel.py").write_text(
        "import sys, json\n"
        "w = sys.stdout.buffer.write\n"
        'w(b\'{"type":"ready"}\\n\')\n'
        "sys.stdout.flush()\n"
        "op = json.loads(sys.stdin.readline())\n"
        "w(b'x' * (40 << 20) + b'\\n')\n"  # a line over the bound
        'w(b\'not json\\n[1,2]\\n{"id":"other","type":"stdout","text":"no"}\\n\')\n'
        "w(json.dumps({'id': op['id'], 'type': 'result', 'data': 5}).encode() + b'\\n')\n"
        "w(json.dumps({'id': op['id'], 'type': 'stdout', 'text': 7}).encode() + b'\\n')\n"
        "w(json.dumps({'id': op['id'], 'type': 'finished', 'status': 'bogus',"
        " 'executionCount': 'x'}).encode() + b'\\n')\n"
        "sys.stdout.flush()\n"
        "sys.stdin.read()\n"
    )
    events = run(sb, "anything")
    assert [e["type"] for e in events] == ["started", "stderr", "finished"], events
    assert "left out" in events[1]["text"]
    assert events[-1]["status"] == "error" and "executionCount" not in events[-1]
    assert sb.sh("echo fine")["stdout"] == "fine\n"


def test_runs_in_one_context_take_turns(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    run(sb, "order = []")
    results: list[list[dict[str, Any]]] = []

    def one(i: int) -> None:
        results.append(run(sb, f"import time; time.sleep(0.2); order.append({i}); len(order)"))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    counts = sorted(main_result(r)["data"]["text/plain"] for r in results)
    assert counts == ["1", "2", "3"]  # one after another, none lost


def test_quiesce_stops_kernels_too(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    run(
        sb,
        "import threading, time, pathlib\n"
        "def tick():\n"
        "    while True:\n"
        "        pathlib.Path('ticks').write_text(str(time.time())); time.sleep(0.05)\n"
        "threading.Thread(target=tick, daemon=True).start()",
    )
    wait_until(lambda: (sb.workspace / "ticks").exists())
    r = sb.client.post("/v1/workspace/quiesce", json={"seconds": 30})
    assert r.status_code == 200, r.text
    time.sleep(0.3)
    frozen = (sb.workspace / "ticks").read_text()
    time.sleep(0.5)
    assert (sb.workspace / "ticks").read_text() == frozen
    assert sb.client.post("/v1/workspace/resume").status_code == 200
    wait_until(lambda: (sb.workspace / "ticks").read_text() != frozen)


def test_javascript_keeps_state_in_order(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    first = run(sb, "let total = 40; console.log('one'); total + 2", language="javascript")
    assert first[0]["contextId"] == "default-javascript"
    assert [e["type"] for e in first] == ["started", "stdout", "result", "finished"]
    assert main_result(first)["data"] == {"text/plain": "42"}
    awaited = run(
        sb,
        "total += 1; await new Promise((r) => setTimeout(r, 10)); console.error('two')",
        language="javascript",
    )
    assert [e["text"] for e in kinds(awaited, "stderr")] == ["two\n"]
    sub = run(
        sb,
        "require('child_process').execSync('echo from-a-child', {stdio: 'inherit'}); total",
        language="javascript",
    )
    assert [e["text"] for e in kinds(sub, "stdout")] == ["from-a-child\n"]
    assert main_result(sub)["data"]["text/plain"] == "41"
    failed = run(sb, "null.field", language="javascript")
    (error,) = kinds(failed, "error")
    assert error["name"] == "TypeError"
    assert error["traceback"][0].startswith("TypeError")
    assert not any("kernel.js" in line for line in error["traceback"])
    looped = run(sb, "while (true) {}", language="javascript", timeoutSeconds=1)
    assert looped[-1]["status"] == "timed_out", looped
    assert "restarted" not in looped[-1]
    assert main_result(run(sb, "total", language="javascript"))["data"]["text/plain"] == "41"
    # the two languages' default contexts are two kernels
    listed = {c["id"]: c["language"] for c in sb.client.get("/v1/contexts").json()["contexts"]}
    assert listed == {"default-javascript": "javascript"}


def test_env_is_set_for_one_run(fresh: Callable[..., Sandbox]) -> None:
    """A run's env is in the kernel's environment (and its children's) while it
    runs, then the values from before are back; setting it costs no execution."""
    sb = fresh()
    run(sb, "import os, subprocess\nos.environ['KEPT'] = 'before'")
    during = run(
        sb,
        "print(subprocess.run(['sh', '-c', 'echo $ONE'], capture_output=True, text=True)"
        ".stdout, end='')\n(os.environ['ONE'], os.environ['KEPT'])",
        env={"ONE": "1", "KEPT": "during"},
    )
    assert [e["text"] for e in kinds(during, "stdout")] == ["1\n"]
    assert main_result(during)["data"]["text/plain"] == "('1', 'during')"
    assert during[-1]["executionCount"] == 2
    after = run(sb, "(os.environ.get('ONE'), os.environ['KEPT'])")
    assert main_result(after)["data"]["text/plain"] == "(None, 'before')"
    assert after[-1]["executionCount"] == 3
    js = run(
        sb,
        "[process.env.ONE, process.env.HOME !== undefined]",
        language="javascript",
        env={"ONE": "js"},
    )
    assert main_result(js)["data"]["text/plain"] == "[ 'js', true ]"
    later = run(sb, "process.env.ONE", language="javascript")
    assert "result" not in [e["type"] for e in later]  # undefined: no value to show
    r = sb.client.post("/v1/code/run", json={"code": "1", "env": {"A=B": "x"}})
    assert sb.error(r, 400) == "invalid_request"


def test_a_reader_slower_than_a_flood_costs_bounded_memory(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    run(sb, "import sys")
    total = 48 << 20
    with sb.client.stream(
        "POST",
        "/v1/code/run",
        json={"code": f"for _ in range({total >> 20}): sys.stdout.write('x' * (1 << 20))"},
        timeout=120,
    ) as r:
        lines = r.iter_lines()
        assert json.loads(next(lines))["type"] == "started"
        time.sleep(5)  # the code floods while nobody reads
        events = [json.loads(line) for line in lines if line]
    received = sum(len(e["text"]) for e in kinds(events, "stdout"))
    finished = events[-1]
    assert finished["status"] == "ok", finished
    assert finished.get("droppedBytes", 0) > 0, (finished, received)
    assert received + finished["droppedBytes"] == total
    assert received >= 16 << 20  # what was held for the reader came through


def test_a_kernel_that_dies_is_replaced_on_the_next_run(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    run(sb, "kept = 1")
    died = run(sb, "import os; os._exit(3)")
    assert died[-1]["status"] in ("error", "aborted"), died
    (ctx,) = sb.client.get("/v1/contexts").json()["contexts"]
    assert ctx["status"] == "dead"
    assert ctx["message"]
    again = run(sb, "'kept' in dir()")
    assert again[0]["restarted"] is True
    assert main_result(again)["data"]["text/plain"] == "False"


def test_a_run_in_progress_counts_as_activity(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh()
    run(sb, "import time")
    with sb.client.stream("POST", "/v1/code/run", json={"code": "time.sleep(3)"}) as r:
        lines = r.iter_lines()
        assert json.loads(next(lines))["type"] == "started"
        assert sb.client.get("/v1/info").json()["activeExecutions"] == 1
        assert json.loads([line for line in lines if line][-1])["status"] == "ok"
    assert sb.client.get("/v1/info").json()["activeExecutions"] == 0


def test_output_comes_while_the_cell_still_runs(fresh: Callable[..., Sandbox]) -> None:
    """The bridge holds output only while the kernel keeps producing it: what a
    cell printed and displayed reaches the client before the cell ends. The
    cell waits for a file that the test writes once it has seen both."""
    sb = fresh()
    code = (
        "import pathlib, time\n"
        "from IPython.display import display\n"
        "print('early', flush=True)\n"
        "display({'shown': 1}, raw=True)\n"
        "while not pathlib.Path('go').exists():\n"
        "    time.sleep(0.02)\n"
        "'late'"
    )
    seen: list[dict[str, Any]] = []
    with sb.client.stream("POST", "/v1/code/run", json={"code": code, "timeoutSeconds": 30}) as r:
        for line in r.iter_lines():
            if not line:
                continue
            seen.append(json.loads(line))
            early = [e.get("text") for e in kinds(seen, "stdout")] == ["early\n"]
            if early and kinds(seen, "result") and not (sb.workspace / "go").exists():
                assert seen[-1]["type"] != "finished"
                (sb.workspace / "go").write_text("")
    assert (sb.workspace / "go").exists(), seen  # else the cell timed out first
    assert seen[-1]["status"] == "ok", seen
    assert main_result(seen)["data"]["text/plain"] == "'late'"
    assert kinds(seen, "result")[0]["data"] == {"shown": 1}


def test_clients_that_leave_at_once_never_cost_the_kernel_its_state(
    fresh: Callable[..., Sandbox],
) -> None:
    """A client that leaves right after `started`: its run, over a moment later,
    must not be interrupted then, since SIGINT that reaches IPython between two
    cells can end the kernel (its loop does not catch it) or leave a request
    without a reply. The variables stay (before: a new kernel 6 times in 200)."""
    sb = fresh()
    run(sb, "x = 1")
    host, port = sb.base_url.split("//")[1].rsplit(":", 1)
    body = json.dumps({"code": "x + 1"}).encode()
    request = (
        b"POST /v1/code/run HTTP/1.1\r\nHost: agent\r\nAuthorization: Bearer "
        + sb.token.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        + body
    )
    for _ in range(100):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(request)
            assert b'"started"' in s.recv(4096)
        events = run(sb, "x")
        assert "restarted" not in events[0], events
        assert main_result(events)["data"]["text/plain"] == "1", events
