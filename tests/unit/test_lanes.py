"""devcluster.lanes: test tiers side by side, each lane's end said plainly; the host
limits a node cluster raises."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from devcluster import hostdeps, lanes, phases


@pytest.fixture(autouse=True)
def _outside_any_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests may themselves run inside a CI lane: its variables are not theirs."""
    monkeypatch.delenv(phases.ENV, raising=False)
    monkeypatch.delenv(phases.LANE_ENV, raising=False)


def test_lanes_are_name_equals_command(tmp_path: Path) -> None:
    parsed = lanes.parse_lanes(["node=pytest tests/e2e", "processes=a && b=c"], tmp_path)
    assert [(lane.name, lane.command) for lane in parsed] == [
        ("node", "pytest tests/e2e"),
        ("processes", "a && b=c"),
    ]
    for bad in (["nocommand"], ["=x"], ["a= "], ["a=x", "a=y"]):
        with pytest.raises(ValueError, match="lane"):
            lanes.parse_lanes(bad, tmp_path)


def test_counts_of_a_pytest_summary() -> None:
    assert lanes.counts_of("3 failed, 120 passed, 2 skipped, 1 error") == {
        "failed": 4,
        "passed": 120,
        "skipped": 2,
    }


def test_lanes_run_at_once_and_end_with_one_closing_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = tmp_path / "phases.jsonl"
    monkeypatch.setenv(phases.ENV, str(record))
    marker = tmp_path / "a-started"
    # b waits for a to have started: they run at the same time or not at all.
    specs = [
        f"a=touch {marker}; echo one; echo '==== 1 failed, 5 passed in 1.00s ===='; "
        "echo '==== 3 passed in 1.00s ===='; exit 1",  # two sessions: both count
        f"b=for i in $(seq 50); do [ -e {marker} ] && break; sleep 0.1; done; [ -e {marker} ]"
        " && echo '==== 7 passed, 2 skipped in 2.00s ===='",
    ]
    out = io.StringIO()
    status = lanes.run(lanes.parse_lanes(specs, tmp_path), out)
    text = out.getvalue()
    assert status == 1
    assert "[a] one" in text
    assert "lane a: exit status 1" in text
    assert "lane b: ok" in text
    assert text.rstrip().splitlines()[-1] == "15 passed, 1 failed, 2 skipped"
    assert (tmp_path / "a.log").read_text().startswith("one\n")
    records = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(r["kind"], r["name"], r["ok"]) for r in records] == [
        ("lane", "a", False),
        ("lane", "b", True),
    ]


def test_each_lane_is_timed_to_its_own_end(tmp_path: Path) -> None:
    parsed = lanes.parse_lanes(["slow=sleep 1.5", "quick=true"], tmp_path)
    lanes.run(parsed, io.StringIO())
    slow, quick = parsed
    assert slow.seconds >= 1.4
    assert quick.seconds < 1.0, quick.seconds


def test_shared_jobs_go_to_whichever_lane_is_free_first(tmp_path: Path) -> None:
    marker = tmp_path / "jobs-done"
    specs = [
        # `slow` ends only once both jobs ran: `quick` must have taken them.
        f"slow=for i in $(seq 100); do [ -e {marker} ] && break; sleep 0.1; done; [ -e {marker} ]",
        "quick=echo '==== 2 passed in 0.10s ===='",
        "+one=echo '==== 1 failed, 4 passed in 0.10s ===='; exit 1",
        f"+two=echo from-two; touch {marker}",
    ]
    parsed, jobs = lanes.parse(specs, tmp_path)
    assert [lane.name for lane in parsed] == ["slow", "quick"]
    assert jobs == [lanes.Job("one", specs[2][5:]), lanes.Job("two", specs[3][5:])]
    out = io.StringIO()
    assert lanes.run(parsed, out, jobs) == 1
    slow, quick = parsed
    assert (slow.status, slow.jobs) == (0, [])
    # A failed job fails its lane, and the lane still runs the next one.
    assert (quick.status, quick.jobs) == (1, ["one", "two"])
    assert quick.counts == {"passed": 6, "failed": 1}
    assert "from-two" in (tmp_path / "quick.log").read_text()
    text = out.getvalue()
    assert "[quick] -- taking the shared job one" in text
    assert "lane quick: exit status 1" in text
    assert "then one, two; log:" in text
    for bad in (["+job=x"], ["a=x", "+a=y"], ["a=x", "+=y"]):
        with pytest.raises(ValueError, match="lane"):
            lanes.parse(bad, tmp_path)


def test_no_shared_job_starts_after_a_signal(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    specs = [f"a=echo $$ > {marker}; sleep 60", f"+late=touch {tmp_path / 'late'}"]
    parsed, jobs = lanes.parse(specs, tmp_path)

    def kill_soon() -> None:
        while not marker.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=kill_soon, daemon=True).start()
    assert lanes.run(parsed, io.StringIO(), jobs) == 128 + signal.SIGTERM
    assert not (tmp_path / "late").exists()


def test_a_lane_that_dies_before_pytest_counts_as_failed(tmp_path: Path) -> None:
    parsed = lanes.parse_lanes(["a=exit 3"], tmp_path)
    assert lanes.run(parsed, io.StringIO()) == 1
    assert lanes.closing_line(parsed) == "0 passed, 1 failed"


def test_the_report_shows_lanes_side_by_side() -> None:
    records: list[dict[str, object]] = [
        {"kind": "phase", "name": "install", "seconds": 60.0, "ok": True},
        {"kind": "phase", "name": "image x", "seconds": 100.0, "ok": True, "lane": "node"},
        {"kind": "tier", "name": "tests/e2e", "seconds": 500.0, "passed": 9, "lane": "node"},
        {"kind": "tier", "name": "tests/unit", "seconds": 20.0, "passed": 3, "lane": "processes"},
        {"kind": "lane", "name": "node", "seconds": 650.0, "ok": True},
        {"kind": "lane", "name": "processes", "seconds": 300.0, "ok": True},
    ]
    text = phases.render(records, wall=720.0)
    rows = [line.split() for line in text.splitlines()]
    assert ["lanes,", "side", "by", "side", "(the", "longest", "counts)", "650.0", "10:50"] in rows
    assert "    tier tests/e2e" in text
    assert "  lane processes" in text
    # install + the longest lane; what the lanes held is not added again.
    assert ["other", "(outside", "these", "phases)", "10.0", "00:10"] in rows
    assert text.rstrip().splitlines()[-1] == "12 passed, 0 failed"


def test_host_limits_are_raised_never_lowered(tmp_path: Path) -> None:
    low, high = tmp_path / "low", tmp_path / "high"
    low.write_text("128\n")
    high.write_text("999999\n")
    limits = {str(low): 8192, str(high): 1024}
    assert hostdeps.raise_limits(limits) == {str(low): 8192}
    assert low.read_text() == "8192\n"
    assert high.read_text() == "999999\n"
    assert hostdeps.raise_limits(limits) == {}


def test_a_signal_to_the_runner_reaches_every_lane(tmp_path: Path) -> None:
    """Killing `make test` must not leave pytest sessions (and their clusters)
    running: each lane's process group gets the signal."""
    marker = tmp_path / "children"
    specs = [f"a=echo $$ >> {marker}; sleep 60", f"b=echo $$ >> {marker}; sleep 60"]
    parsed = lanes.parse_lanes(specs, tmp_path)

    def kill_soon() -> None:
        while not marker.exists() or len(marker.read_text().split()) < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=kill_soon, daemon=True).start()
    began = time.monotonic()
    assert lanes.run(parsed, io.StringIO()) == 128 + signal.SIGTERM
    assert time.monotonic() - began < 30
    for pid in marker.read_text().split():
        assert not Path(f"/proc/{pid}").exists(), f"lane shell {pid} survived"
