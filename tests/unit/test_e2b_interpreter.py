"""The E2B code interpreter's pure parts: an E2B request into the agent's, the
agent's events into E2B's NDJSON lines, working directories both ways, and
the context list with its default contexts."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest

from sandbox_operator.gateway.e2b.core import Adapter
from sandbox_operator.gateway.e2b.interpreter import (
    MAX_CODE,
    RUN_SECONDS,
    Interpreter,
    InterpreterError,
    Translation,
    context_body,
    e2b_contexts,
    encode,
    relative_cwd,
    result_line,
    run_body,
)

WS = "/home/user"


def refused(call: Any, *args: Any) -> tuple[int, str]:
    with pytest.raises(InterpreterError) as info:
        call(*args)
    return info.value.status, info.value.message


def test_a_run_goes_to_the_context_or_the_languages_default() -> None:
    assert run_body({"code": "x = 1"}) == {
        "code": "x = 1",
        "timeoutSeconds": RUN_SECONDS,
        "language": "python",
    }
    # What the SDKs send when a field is not given: null (Python), absent (JS).
    sent = {"code": "1", "context_id": None, "language": None, "env_vars": None}
    assert run_body(sent)["language"] == "python"
    assert run_body({"code": "1", "language": " JS "})["language"] == "javascript"
    assert run_body({"code": "1", "language": "javascript"})["language"] == "javascript"
    assert run_body({"code": "1", "context_id": "ctx-1"}) == {
        "code": "1",
        "timeoutSeconds": RUN_SECONDS,
        "contextId": "ctx-1",
    }
    # The listed default contexts are the agent's defaults, started on first use.
    default = run_body({"code": "1", "context_id": "default-javascript"})
    assert default["language"] == "javascript"
    assert "contextId" not in default
    # Fields E2B's server does not know are ignored, as it ignores them.
    assert "later" not in run_body({"code": "1", "later": True})
    env = run_body({"code": "1", "env_vars": {"FOO": "bar", "EMPTY": ""}})
    assert env["env"] == {"FOO": "bar", "EMPTY": ""}
    assert "env" not in run_body({"code": "1", "env_vars": {}})


def test_bad_runs_are_refused_in_plain_words() -> None:
    assert refused(run_body, ["code"])[0] == 400
    assert refused(run_body, {})[0] == 400
    assert refused(run_body, {"code": 1})[0] == 400
    assert refused(run_body, {"code": "x" * (MAX_CODE + 1)})[0] == 413
    assert refused(run_body, {"code": "1", "context_id": 5})[0] == 400
    both = refused(run_body, {"code": "1", "context_id": "ctx-1", "language": "python"})
    assert both == (400, "Only one of context_id or language can be provided")
    status, message = refused(run_body, {"code": "1", "language": "r"})
    assert status == 400
    assert "python and javascript" in message
    assert refused(run_body, {"code": "1", "language": ["python"]})[0] == 400
    # An id the agent could never have made is a context that does not exist.
    assert refused(run_body, {"code": "1", "context_id": "../etc"}) == (
        404,
        "Context '../etc' not found",
    )
    status, message = refused(run_body, {"code": "1", "context_id": "x" * 5000})
    assert status == 404
    assert len(message) < 200
    for env in ("A=1", ["A"], {"A=B": "1"}, {"": "1"}, {"A": 1}, {"A": "a\0b"}):
        assert refused(run_body, {"code": "1", "env_vars": env})[0] == 400, env
    assert refused(run_body, {"code": "1", "env_vars": {f"V{i}": "" for i in range(300)}})[0] == 400


def test_working_directories_are_the_workspaces_both_ways() -> None:
    assert context_body(None, WS) == {"language": "python"}
    assert context_body({"language": "js", "cwd": WS}, WS) == {
        "language": "javascript",
        "cwd": ".",
    }
    assert relative_cwd(WS + "/", WS) == "."
    assert relative_cwd(WS + "/project/src", WS) == "project/src"
    assert relative_cwd("project", WS) == "project"  # the agent checks relative ones
    assert relative_cwd("/anything", "/") == "anything"
    for outside in ("/root", "/home/username", "/home"):
        status, message = refused(relative_cwd, outside, WS)
        assert status == 400
        assert "outside the sandbox's workspace" in message
    assert relative_cwd("project/", WS) == "project"
    for crooked in (WS + "/../root", WS + "//x", WS + "/./x", "a/../../etc", "../x", "..", "./a"):
        assert refused(relative_cwd, crooked, WS)[0] == 400
    assert refused(context_body, {"cwd": 3}, WS)[0] == 400
    assert refused(context_body, "python", WS)[0] == 400


def test_the_list_has_the_default_contexts_first_then_the_agents() -> None:
    agent = {
        "contexts": [
            {"id": "ctx-a", "language": "python", "cwd": "project", "status": "idle"},
            {"id": "default-python", "language": "python", "cwd": "."},
            {"not": "a context"},
        ]
    }
    assert e2b_contexts(agent, WS) == [
        {"id": "default-javascript", "language": "javascript", "cwd": WS},
        {"id": "ctx-a", "language": "python", "cwd": WS + "/project"},
        {"id": "default-python", "language": "python", "cwd": WS},
    ]
    assert [c["id"] for c in e2b_contexts(None, WS)] == ["default-python", "default-javascript"]


def test_a_result_has_a_field_per_known_type_and_the_rest_in_extra() -> None:
    line = result_line(
        {
            "text/plain": "'a string'",
            "text/html": "<b>x</b>",
            "image/png": "iVBOR",
            "application/json": {"a": 1},
            "application/vnd.custom": "y",
        },
        True,
    )
    assert line == {
        "type": "result",
        "text": "a string",  # E2B shows a string's value without its quotes
        "html": "<b>x</b>",
        "png": "iVBOR",
        "json": {"a": 1},
        "extra": {"application/vnd.custom": "y"},
        "is_main_result": True,
    }
    figure = result_line({"image/png": "iVBOR", "text/plain": "<Figure>"}, False)
    assert figure["extra"] == {}
    assert figure["is_main_result"] is False
    assert result_line({"text/plain": "'"}, True)["text"] == "'"
    assert result_line({"text/plain": "'a\""}, True)["text"] == "'a\""


def _lines(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    translation = Translation()
    raw = b"".join(json.dumps(e).encode() + b"\n" for e in events)
    return [line for part in raw.split(b"\n") for line in translation.line(part)]


def test_a_runs_events_become_e2bs_lines() -> None:
    lines = _lines(
        [
            {"type": "started", "contextId": "default-python"},
            {"type": "stdout", "text": "hi\n"},
            {"type": "stderr", "text": "careful\n"},
            {"type": "result", "data": {"text/plain": "2"}, "isMain": True, "executionCount": 7},
            {
                "type": "error",
                "name": "NameError",
                "value": "name 'y' is not defined",
                "traceback": ["---", "NameError: name 'y' is not defined"],
            },
            {"type": "finished", "status": "error", "executionCount": 7, "durationMs": 3},
        ]
    )
    stdout, stderr, *rest = lines
    assert stdout["type"] == "stdout"
    assert stdout["text"] == "hi\n"
    assert stdout["timestamp"].endswith("+00:00")  # ISO 8601, as E2B's server sends it
    assert stderr["type"] == "stderr"
    assert stderr["text"] == "careful\n"
    assert rest == [
        {"type": "result", "text": "2", "extra": {}, "is_main_result": True},
        {
            "type": "error",
            "name": "NameError",
            "value": "name 'y' is not defined",
            "traceback": "---\nNameError: name 'y' is not defined",
        },
        {"type": "number_of_executions", "execution_count": 7},
        {"type": "end_of_execution"},
    ]


def test_a_run_that_ends_without_its_own_error_says_why() -> None:
    timed_out = _lines([{"type": "finished", "status": "timed_out", "executionCount": 2}])
    assert [line["type"] for line in timed_out] == [
        "number_of_executions",
        "error",
        "end_of_execution",
    ]
    assert timed_out[1]["name"] == "TimeoutError"
    aborted = _lines(
        [{"type": "finished", "status": "aborted", "restarted": True, "message": "deaf"}]
    )
    assert [line["type"] for line in aborted] == ["error", "end_of_execution"]
    assert aborted[0]["name"] == "ExecutionAborted"
    assert "state is gone" in aborted[0]["value"]
    assert "(deaf)" in aborted[0]["value"]
    # The kernel's own error stands alone (a KeyboardInterrupt, KernelDied).
    died = _lines(
        [
            {"type": "error", "name": "KernelDied", "value": "killed", "traceback": []},
            {"type": "finished", "status": "aborted", "restarted": True},
        ]
    )
    assert [line["type"] for line in died] == ["error", "end_of_execution"]
    assert died[0]["name"] == "KernelDied"


def test_what_is_not_an_event_is_left_out_and_a_broken_stream_is_said() -> None:
    translation = Translation()
    assert translation.line(b"") == []
    assert translation.line(b"not json") == []
    assert translation.line(b"[1]") == []
    assert translation.line(b'{"type": "stdout", "text": 5}') == []
    assert translation.line(b'{"type": "result", "data": "x"}') == []
    assert translation.line(b'{"type": "newer-kind"}') == []
    assert translation.line(b'{"type": "stdout", "text": "a"}')[0]["text"] == "a"
    assert [line["type"] for line in translation.broken("the connection broke off")] == [
        "error",
        "end_of_execution",
    ]
    # Nothing after the end.
    assert translation.line(b'{"type": "stdout", "text": "late"}') == []
    assert translation.broken("again") == []
    finished = Translation()
    finished.line(b'{"type": "finished", "status": "ok"}')
    assert finished.broken("after the end") == []


def test_lines_are_ndjson() -> None:
    data = encode([{"type": "stdout", "text": "a\nb"}, {"type": "end_of_execution"}])
    assert data.count(b"\n") == 2
    assert [json.loads(line)["type"] for line in data.splitlines()] == [
        "stdout",
        "end_of_execution",
    ]


def test_the_ports_routes_take_canonical_context_ids_only() -> None:
    endpoints = Interpreter(cast(Adapter, None)).endpoints()

    def served(method: str, path: str) -> dict[str, str] | None:
        for endpoint in endpoints:
            params = endpoint.match(method, path)
            if params is not None:
                return params
        return None

    assert served("POST", "/execute") == {}
    assert served("GET", "/contexts") == {}
    assert served("DELETE", "/contexts/ctx-1") == {"id": "ctx-1"}
    assert served("POST", "/contexts/default-python/restart") == {"id": "default-python"}
    for method, path in (
        ("GET", "/execute"),
        ("DELETE", "/contexts/../x"),
        ("DELETE", "/contexts/"),
        ("POST", "/contexts/a/b/restart"),
        ("POST", "/contexts/-a/restart"),
        ("PUT", "/contexts"),
    ):
        assert served(method, path) is None, (method, path)


def test_errors_are_plain_text_as_e2bs_server_answers() -> None:
    response = InterpreterError(404, "Context 'x' not found").response()
    assert response.status == 404
    assert response.content_type == "text/plain"
    assert response.text == "Context 'x' not found"
