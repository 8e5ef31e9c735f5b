"""CI's phase table (devcluster/phases.py): phases recorded as JSON lines in
the file `SANDBOX_CI_PHASES` names (nothing when unset), per-tier test time
without the cluster starts counted twice, and the plain-text table rendered
from a record file.

Every test here names its own file: under `.ci/run` this session's
SANDBOX_CI_PHASES is the real run's record file, which must stay clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from devcluster import phases
from tests.conftest import REPO


@pytest.fixture(autouse=True)
def _outside_any_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests may themselves run inside a CI lane: its variables are not theirs."""
    monkeypatch.delenv(phases.ENV, raising=False)
    monkeypatch.delenv(phases.LANE_ENV, raising=False)


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_phase_is_recorded_with_its_time_and_outcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = tmp_path / "phases.jsonl"
    monkeypatch.setenv(phases.ENV, str(record))
    with phases.phase("install"):
        pass
    with pytest.raises(RuntimeError, match="no go"), phases.phase("binaries: helm"):
        raise RuntimeError("no go")
    first, second = lines(record)
    assert first == {"kind": "phase", "name": "install", "seconds": first["seconds"], "ok": True}
    assert isinstance(first["seconds"], float)
    assert 0 <= first["seconds"] < 5
    # A failed step still took its time: recorded, and the error goes on.
    assert (second["name"], second["ok"]) == ("binaries: helm", False)


def test_nothing_is_recorded_when_the_variable_is_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(phases.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    ran = []
    with phases.phase("install"):
        ran.append(True)
    phases.append({"kind": "phase", "name": "x", "seconds": 1.0, "ok": True})
    assert ran == [True]
    assert phases.destination() is None
    assert list(tmp_path.iterdir()) == []


def test_run_times_a_command_and_keeps_its_exit_status(tmp_path: Path) -> None:
    record = tmp_path / "phases.jsonl"
    env = {**os.environ, phases.ENV: str(record)}

    def run(name: str, code: str) -> int:
        command = [sys.executable, "-m", "devcluster.phases", "run", name, "--"]
        command += [sys.executable, "-c", code]
        return subprocess.run(command, cwd=REPO, env=env, timeout=60, check=False).returncode

    assert run("lint", "pass") == 0
    assert run("install", "raise SystemExit(3)") == 3
    assert run("killed", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)") == 143
    assert [(r["name"], r["ok"]) for r in lines(record)] == [
        ("lint", True),
        ("install", False),
        ("killed", False),
    ]


def test_tiers_are_the_longest_given_path_holding_the_test() -> None:
    tally = phases.TestTally(
        ["tests/unit", "tests/integration/", "tests/integration/test_sdk.py", "sandbox-agent/tests"]
    )
    assert tally.tier_of("tests/unit/test_x.py::test_a[1]") == "tests/unit"
    assert tally.tier_of("tests/integration/test_sdk.py::test_b") == "tests/integration/test_sdk.py"
    assert tally.tier_of("tests/integration/test_pools.py::test_c") == "tests/integration"
    assert tally.tier_of("sandbox-agent/tests/test_exec.py::test_d") == "sandbox-agent/tests"
    # A prefix of a name is no parent directory.
    assert tally.tier_of("tests/unitx/test_y.py::test_e") == "tests/unitx"


def test_tier_time_is_setup_call_teardown_without_cluster_starts() -> None:
    tally = phases.TestTally(["tests/unit", "tests/integration"])
    tally.add("tests/unit/test_a.py::test_ok", "setup", "passed", 0.5)
    tally.add("tests/unit/test_a.py::test_ok", "call", "passed", 2.0)
    tally.add("tests/unit/test_a.py::test_ok", "teardown", "passed", 0.5)
    # The first integration test's setup started the control plane (30 s of
    # its 31 s): that has its own row, so the test is charged 1 s.
    tally.exclude(30.0)
    tally.add("tests/integration/test_b.py::test_first", "setup", "passed", 31.0)
    tally.add("tests/integration/test_b.py::test_first", "call", "failed", 4.0)
    tally.add("tests/integration/test_b.py::test_first", "teardown", "passed", 0.0)
    tally.add("tests/integration/test_b.py::test_skip", "setup", "skipped", 0.25)
    tally.add("tests/integration/test_b.py::test_skip", "teardown", "passed", 0.0)
    tally.add("tests/integration/test_b.py::test_err", "setup", "failed", 1.0)
    tally.add("tests/integration/test_b.py::test_err", "teardown", "passed", 0.0)
    records = tally.records()
    assert records[:2] == [
        {
            "kind": "tier",
            "name": "tests/unit",
            "seconds": 3.0,
            "passed": 1,
            "failed": 0,
            "skipped": 0,
        },
        {
            "kind": "tier",
            "name": "tests/integration",
            "seconds": 6.25,
            "passed": 0,
            "failed": 2,
            "skipped": 1,
        },
    ]
    assert [(r["name"], r["seconds"], r["outcome"]) for r in records[2:]] == [
        ("tests/integration/test_b.py::test_first", 5.0, "failed"),
        ("tests/unit/test_a.py::test_ok", 3.0, "passed"),
        ("tests/integration/test_b.py::test_err", 1.0, "failed"),
        ("tests/integration/test_b.py::test_skip", 0.25, "skipped"),
    ]


def test_only_the_slowest_tests_are_kept() -> None:
    tally = phases.TestTally(["tests"])
    for i in range(30):
        tally.add(f"tests/test_n.py::test_{i}", "call", "passed", float(i))
    tests = [r for r in tally.records() if r["kind"] == "test"]
    assert len(tests) == phases.SLOWEST == 20
    assert [r["seconds"] for r in tests] == [float(i) for i in range(29, 9, -1)]


def test_mmss() -> None:
    assert phases.mmss(0) == "00:00"
    assert phases.mmss(59.6) == "01:00"
    assert phases.mmss(754.2) == "12:34"
    assert phases.mmss(6000) == "100:00"
    assert phases.mmss(-3) == "-00:03"


def write_records(path: Path, records: list[dict[str, object]], junk: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + junk)


RECORDS: list[dict[str, object]] = [
    {"kind": "phase", "name": "install", "seconds": 181.24, "ok": True},
    {"kind": "phase", "name": "binaries: etcd, Kubernetes", "seconds": 402.0, "ok": True},
    {"kind": "phase", "name": "lint", "seconds": 61.5, "ok": False},
    {"kind": "phase", "name": "cluster start: control_plane", "seconds": 9.8, "ok": True},
    {
        "kind": "tier",
        "name": "tests/unit",
        "seconds": 12.3,
        "passed": 300,
        "failed": 0,
        "skipped": 0,
    },
    {
        "kind": "tier",
        "name": "tests/integration",
        "seconds": 612.5,
        "passed": 180,
        "failed": 1,
        "skipped": 2,
    },
    {"kind": "test", "name": "tests/unit/test_a.py::test_x", "seconds": 1.0, "outcome": "passed"},
    {
        "kind": "test",
        "name": "tests/integration/t.py::test_y",
        "seconds": 95.2,
        "outcome": "failed",
    },
]


def test_the_report_is_an_aligned_table_with_other_and_total(tmp_path: Path) -> None:
    path = tmp_path / "phases.jsonl"
    # The last line as a killed process might leave it.
    write_records(path, RECORDS, junk='{"kind": "phase", "na')
    records, bad = phases.read(path)
    assert bad == 1
    assert phases.render(records, wall=1300.0, bad=bad) == textwrap.dedent(
        """\
        CI phases
        phase                         seconds  mm:ss  result
        install                         181.2  03:01  ok
        binaries: etcd, Kubernetes      402.0  06:42  ok
        lint                             61.5  01:02  FAILED
        cluster start: control_plane      9.8  00:10  ok
        tier tests/unit                  12.3  00:12  300 passed
        tier tests/integration          612.5  10:12  180 passed, 1 failed, 2 skipped
        other (outside these phases)     20.7  00:21
        -----------------------------------------------------------------------------
        total (wall time of the run)   1300.0  21:40
        (1 line(s) of the record file were not records and are left out)

        2 slowest tests (setup + call + teardown)
        seconds  mm:ss  test
           95.2  01:35  tests/integration/t.py::test_y  (failed)
            1.0  00:01  tests/unit/test_a.py::test_x

        480 passed, 1 failed, 2 skipped
        """
    )


def test_without_the_wall_time_the_total_is_the_sum() -> None:
    text = phases.render(RECORDS[:2])
    assert text == textwrap.dedent(
        """\
        CI phases
        phase                       seconds  mm:ss  result
        install                       181.2  03:01  ok
        binaries: etcd, Kubernetes    402.0  06:42  ok
        --------------------------------------------------
        total (sum of the phases)     583.2  09:43

        slowest tests (setup + call + teardown)
        (no tests recorded)
        """
    )


def test_report_of_a_missing_file_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert phases.main(["report", str(tmp_path / "never-written.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "(no phases recorded)" in out
    assert "(no tests recorded)" in out


def test_a_pytest_session_records_its_tiers_and_slowest_tests(tmp_path: Path) -> None:
    """The plugin end to end, in a pytest of its own with two tiers; none of
    its tests uses a cluster, so nothing is built."""
    for tier, body in {
        "alpha": "def test_pass():\n    pass\n\ndef test_fail():\n    assert False\n",
        "beta": "import pytest\n\n@pytest.mark.skip\ndef test_skip():\n    pass\n",
    }.items():
        (tmp_path / tier).mkdir()
        (tmp_path / tier / f"test_{tier}.py").write_text(body)
    record = tmp_path / "phases.jsonl"
    env = {**os.environ, phases.ENV: str(record), "PYTHONPATH": str(REPO)}
    plugins = ["-p", "devcluster.pytest_plugin", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *plugins,
            "-q",
            "--rootdir",
            str(tmp_path),
            "alpha",
            "beta",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    got = lines(record)
    tiers = [r for r in got if r["kind"] == "tier"]
    assert [(r["name"], r["passed"], r["failed"], r["skipped"]) for r in tiers] == [
        ("alpha", 1, 1, 0),
        ("beta", 0, 0, 1),
    ]
    tests = [r for r in got if r["kind"] == "test"]
    assert {(r["name"], r["outcome"]) for r in tests} == {
        ("alpha/test_alpha.py::test_pass", "passed"),
        ("alpha/test_alpha.py::test_fail", "failed"),
        ("beta/test_beta.py::test_skip", "skipped"),
    }
    seconds = [r["seconds"] for r in tests]
    assert seconds == sorted(seconds, reverse=True)


def test_a_rounded_tiny_negative_is_no_minus_zero() -> None:
    text = phases.render([{"kind": "phase", "name": "a", "seconds": 0.01, "ok": True}], wall=0.0)
    assert "other (outside these phases)      0.0  00:00" in text
