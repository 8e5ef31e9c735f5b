"""The pure parts of Execution handling: requests, outcomes, status, scheduling."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest

from sandbox_operator.api.execution import ExecutionPhase, ExecutionSpec, ExecutionStatus
from sandbox_operator.api.sandbox import SandboxSpec
from sandbox_operator.builders import execution as build
from sandbox_operator.handlers.execution import may_start, sandbox_of, slot_entry
from sandbox_operator.resources import EXECUTION_ANNOTATION, LABEL_EXECUTION_UID

SANDBOX_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@pytest.mark.parametrize(
    "name", ["run", "My.Job-1", "9lives", "-", "a" * 253, "x.y.z", "ends-with-dash-"]
)
def test_one_shot_names_are_valid_sandbox_names(name: str) -> None:
    made = build.one_shot_name(name, "0f1e2d3c-aaaa-bbbb-cccc-000000000000")
    assert SANDBOX_NAME.match(made), made
    assert len(made) <= 50
    assert made.endswith("-0f1e2d3c")


def test_one_shot_sandbox_is_owned_and_labelled() -> None:
    meta = {"name": "job" * 80, "namespace": "ns", "uid": "1234567890"}
    body = build.build_one_shot_sandbox(meta, SandboxSpec(runtime="python"))
    assert body["metadata"]["name"] == "jobjobjobjobjobjobjobjobjobjobjobjob-12345678"
    # A label value holds at most 63 characters: the UID, never the (long) name.
    assert body["metadata"]["labels"][LABEL_EXECUTION_UID] == "1234567890"
    assert body["metadata"]["annotations"][EXECUTION_ANNOTATION] == "job" * 80
    assert all(len(value) <= 63 for value in body["metadata"]["labels"].values())
    owner = body["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("Execution", "1234567890", True)
    assert body["spec"]["runtime"] == "python"


def test_agent_request_carries_the_uid_as_idempotency_key() -> None:
    spec = ExecutionSpec.model_validate(
        {
            "sandboxRef": {"name": "s"},
            "command": ["python3", "-c", "print(1)"],
            "workingDir": "src",
            "stdin": "in",
            "timeout": "1m30s",
        }
    )
    request = build.agent_request(spec, "uid-1", {"A": "1"})
    assert request == {
        "idempotencyKey": "uid-1",
        "timeoutSeconds": 90.0,
        "env": {"A": "1"},
        "argv": ["python3", "-c", "print(1)"],
        "cwd": "src",
        "stdin": "in",
    }
    script = ExecutionSpec.model_validate({"sandboxRef": {"name": "s"}, "script": "echo hi"})
    assert build.agent_request(script, "u", {})["command"] == "echo hi"


@pytest.mark.parametrize(
    ("record", "phase", "reason"),
    [
        ({"status": "running"}, None, None),
        ({"status": "completed", "exitCode": 0}, ExecutionPhase.SUCCEEDED, "Succeeded"),
        ({"status": "completed", "exitCode": 2}, ExecutionPhase.FAILED, "NonZeroExit"),
        ({"status": "completed", "signalName": "SIGSEGV"}, ExecutionPhase.FAILED, "Signaled"),
        (
            {"status": "completed", "signalName": "SIGKILL", "oomKilled": True},
            ExecutionPhase.FAILED,
            "OOMKilled",
        ),
        ({"status": "timed_out", "timeoutSeconds": 5}, ExecutionPhase.TIMED_OUT, "TimedOut"),
        ({"status": "cancelled"}, ExecutionPhase.CANCELLED, "Cancelled"),
        ({"status": "lost", "error": {"message": "runner"}}, ExecutionPhase.FAILED, "Lost"),
        (
            {"status": "failed", "error": {"message": "no such file"}},
            ExecutionPhase.FAILED,
            "StartFailed",
        ),
    ],
)
def test_outcome_of_agent_records(
    record: dict[str, object], phase: ExecutionPhase | None, reason: str | None
) -> None:
    outcome = build.outcome_of(record)
    if phase is None:
        assert outcome is None
    else:
        assert outcome is not None
        assert (outcome.phase, outcome.reason) == (phase, reason)


def test_tails_are_bounded_in_bytes_without_breaking_characters() -> None:
    assert build.tail("short", 10) == ("short", False)
    assert build.tail(None, 10) == (None, False)
    text, cut = build.tail("é" * 10, 5)  # 2 bytes each: 5 bytes hold 2 whole ones
    assert (text, cut) == ("éé", True)
    fields = build.record_fields({"id": "x", "stdout": "a" * 100, "durationSeconds": 0.0123}, 10)
    assert fields["stdout"] == "a" * 10
    assert fields["stdout_truncated"] is True
    assert fields["stderr_truncated"] is False
    assert fields["duration"] == "12ms"


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(0.0004, "0ms"), (0.25, "250ms"), (1.5, "1.5s"), (125, "2m5s"), (3725, "1h2m")],
)
def test_durations_read_like_kubectl(seconds: float, shown: str) -> None:
    assert build.format_duration(seconds) == shown


def test_conditions_follow_the_phase() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    queued = build.build_status(
        ExecutionStatus(),
        {"phase": "Queued", "reason": "ConcurrencyLimit", "message": "full"},
        1,
        now,
    )
    by_type = {c.type: c for c in queued.conditions}
    assert by_type["Scheduled"].status == "False"
    assert by_type["Scheduled"].reason == "ConcurrencyLimit"
    assert by_type["Complete"].status == "False"
    assert "Succeeded" not in by_type
    done = build.build_status(
        queued,
        {"phase": "Failed", "reason": "NonZeroExit", "pod_uid": "p", "message": None},
        1,
        now,
    )
    by_type = {c.type: c for c in done.conditions}
    assert by_type["Scheduled"].status == "True"
    assert (by_type["Complete"].status, by_type["Complete"].reason) == ("True", "NonZeroExit")
    assert by_type["Succeeded"].status == "False"
    assert "message" not in done.to_wire()
    with pytest.raises(TypeError, match="podUID"):
        build.build_status(queued, {"podUID": "p"}, 1, now)  # wire names are not field names


def _entry(name: str, created: str, started: bool = False, done: bool = False) -> dict[str, object]:
    return {"name": name, "created": created, "started": started, "done": done}


def test_slots_go_to_the_oldest_waiting_executions() -> None:
    entries = [
        _entry("a", "t1", started=True),
        _entry("b", "t2"),
        _entry("c", "t3"),
        _entry("old", "t0", started=True, done=True),
    ]
    assert may_start("a", "t1", entries, set(), 2)  # already holds a slot
    assert may_start("b", "t2", entries, set(), 2)
    assert not may_start("c", "t3", entries, set(), 2)
    assert not may_start("b", "t2", entries, {"x"}, 2)  # a claim not yet in the index
    assert may_start("c", "t3", entries, set(), 3)
    # Same second: the name decides, so every process agrees on the order.
    assert may_start("d", "t2", [_entry("a", "t1", started=True), _entry("e", "t2")], set(), 2)


def test_sandbox_of_prefers_status_then_reference_then_one_shot_name() -> None:
    meta = {"name": "job", "uid": "abcdef12-0000"}
    assert sandbox_of({"metadata": meta, "spec": {"sandboxRef": {"name": "s"}}}) == "s"
    assert sandbox_of({"metadata": meta, "spec": {}, "status": {"sandbox": "t"}}) == "t"
    assert sandbox_of({"metadata": meta, "spec": {"sandboxTemplate": {}}}) == "job-abcdef12"
    entry = slot_entry({"metadata": {**meta, "creationTimestamp": "t"}, "status": {"podUID": "p"}})
    assert entry == {
        "name": "job",
        "created": "t",
        "started": True,
        "done": False,
        "quota": False,
    }
