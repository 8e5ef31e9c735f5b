"""Where the time of a CI run goes: a table of its phases and its slowest tests.

`.ci/run` names a file in `SANDBOX_CI_PHASES`; every step of the run that
takes long appends one JSON line to it as it ends: the install, each Go
build entry point (`python -m devcluster.build`, `devcluster.helm`,
`devcluster.luahealth`), lint, and inside pytest (devcluster.pytest_plugin)
the node tier's host packages, binaries and each image build, each cluster
start and stop of the session fixtures, then at the session's end one line
per test tier and the slowest tests. At the end `.ci/run` prints

    python -m devcluster.phases report FILE --wall SECONDS

With `SANDBOX_CI_PHASES` unset (a developer's `make test`) nothing is
recorded and nothing changes.

The rows are meant to be disjoint, so they add up to the run's wall time:
a tier's time is the sum of its tests' setup + call + teardown durations
*minus* the cluster starts and stops that happened inside them (those have
rows of their own), and the builds run during collection, outside any test.
What no row covers (pytest's start and collection, make) is the "other" row.

Standard library only: `.ci/run` calls it with the system Python before the
virtualenv exists (to time the install itself).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

ENV = "SANDBOX_CI_PHASES"
# Set by devcluster.lanes in each lane: what is recorded there says so.
LANE_ENV = "SANDBOX_CI_LANE"
SLOWEST = 20

Record = dict[str, Any]


def destination() -> Path | None:
    """The file of this run's records, or None when nobody asked for them."""
    value = os.environ.get(ENV, "")
    return Path(value) if value else None


def append(record: Mapping[str, object], into: Path | None = None) -> None:
    """Add one record to `into` (default: `$SANDBOX_CI_PHASES`; no-op when unset).

    One write of one line to a file opened for appending: the build entry
    points, make and pytest are separate processes writing the same file, and
    O_APPEND keeps such short lines whole and in the order they ended."""
    path = into if into is not None else destination()
    if path is None:
        return
    entry = dict(record)
    lane = os.environ.get(LANE_ENV, "")
    if lane and entry.get("kind") != "lane":
        entry.setdefault("lane", lane)
    line = json.dumps(entry, sort_keys=True) + "\n"
    with path.open("a", encoding="utf-8") as handle:
        handle.write(line)


def _record_phase(name: str, seconds: float, ok: bool, into: Path | None) -> None:
    append({"kind": "phase", "name": name, "seconds": round(seconds, 3), "ok": ok}, into)


@contextlib.contextmanager
def phase(name: str, into: Path | None = None) -> Iterator[None]:
    """Time the body and record `{"kind": "phase", "name", "seconds", "ok"}`.

    Recorded also when the body raises (ok false: a failed build is part of
    where the time went), and the exception goes on unchanged."""
    began = time.monotonic()
    ok = False
    try:
        yield
        ok = True
    finally:
        _record_phase(name, time.monotonic() - began, ok, into)


@dataclass
class _TestTime:
    tier: str
    seconds: float = 0.0
    outcome: str = ""


class TestTally:
    """Per-test durations of one pytest session, summed per tier.

    Fed one `add` per report (setup, call, teardown), in the order pytest
    makes them; pure, so the unit tests drive it without running pytest."""

    __test__ = False  # a helper named Test*, not a test class for pytest

    def __init__(self, tiers: Sequence[str]) -> None:
        # Longest first: `tests/integration/test_sdk.py` wins over `tests/integration`.
        self.tiers = sorted(
            {t.split("::")[0].rstrip("/") for t in tiers if t}, key=len, reverse=True
        )
        self.tests: dict[str, _TestTime] = {}
        self._excluded = 0.0

    def tier_of(self, nodeid: str) -> str:
        """The tier (a path pytest was given) that holds the test; without one,
        the directory of its file."""
        path = nodeid.split("::")[0]
        for tier in self.tiers:
            if tier in (".", path) or path.startswith(tier + "/"):
                return tier
        return str(PurePosixPath(path).parent)

    def exclude(self, seconds: float) -> None:
        """Time spent inside the running test that has a row of its own (a
        cluster start or stop in a session fixture): taken off its next report,
        so the tier's total does not count it twice."""
        self._excluded += seconds

    def add(self, nodeid: str, when: str, outcome: str, duration: float) -> None:
        test = self.tests.get(nodeid)
        if test is None:
            test = self.tests[nodeid] = _TestTime(self.tier_of(nodeid))
        test.seconds += max(0.0, duration - self._excluded)
        self._excluded = 0.0
        # A failure in any phase fails the test (an erroring fixture costs the
        # tier as much as a failing assertion); a skip only hides a pass.
        if outcome == "failed":
            test.outcome = "failed"
        elif outcome == "skipped" and test.outcome != "failed":
            test.outcome = "skipped"
        elif outcome == "passed" and when == "call" and not test.outcome:
            test.outcome = "passed"

    def records(self, slowest: int = SLOWEST) -> list[Record]:
        """One "tier" record per tier (in the order they ran), then the
        `slowest` tests as "test" records, slowest first."""
        tiers: dict[str, Record] = {}
        for test in self.tests.values():
            row = tiers.setdefault(
                test.tier,
                {
                    "kind": "tier",
                    "name": test.tier,
                    "seconds": 0.0,
                    "passed": 0,
                    "failed": 0,
                    "skipped": 0,
                },
            )
            row["seconds"] += test.seconds
            if test.outcome in ("passed", "failed", "skipped"):
                row[test.outcome] += 1
        for row in tiers.values():
            row["seconds"] = round(row["seconds"], 3)
        ranked = sorted(self.tests.items(), key=lambda item: item[1].seconds, reverse=True)
        tests: list[Record] = [
            {
                "kind": "test",
                "name": nodeid,
                "seconds": round(test.seconds, 3),
                "outcome": test.outcome or "unknown",
            }
            for nodeid, test in ranked[:slowest]
        ]
        return [*tiers.values(), *tests]


def read(path: Path) -> tuple[list[Record], int]:
    """The records of `path` and how many lines were not records (a process
    killed in mid-write must not cost the whole table)."""
    records: list[Record] = []
    bad = 0
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(record, dict) and _number(record.get("seconds")) is not None:
                records.append(record)
            else:
                bad += 1
    return records, bad


def _number(value: object) -> float | None:
    # bool is an int to Python, never a duration.
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def mmss(seconds: float) -> str:
    """mm:ss (minutes go past 99 rather than wrap: a CI run is no clock)."""
    whole = round(seconds)
    sign = "-" if whole < 0 else ""
    whole = abs(whole)
    return f"{sign}{whole // 60:02d}:{whole % 60:02d}"


def _seconds(seconds: float) -> str:
    # + 0.0 turns the -0.0 of a rounded tiny negative into 0.0.
    return f"{round(seconds, 1) + 0.0:.1f}"


def _result(record: Record) -> str:
    if record.get("kind") == "tier":
        counts = [
            f"{record.get(key, 0)} {key}"
            for key in ("passed", "failed", "skipped")
            if record.get(key) or key == "passed"
        ]
        return ", ".join(counts)
    return "ok" if record.get("ok") is True else "FAILED"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], right: set[int]) -> list[str]:
    """Plain aligned columns (CI logs have no terminal); the last column is
    left unpadded so a long test id does not widen the others."""
    rows = [list(row) for row in rows]
    widths = [max(len(row[i]) for row in [list(header), *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, cell in enumerate(cells):
            if i == len(cells) - 1:
                out.append(cell)
            elif i in right:
                out.append(cell.rjust(widths[i]))
            else:
                out.append(cell.ljust(widths[i]))
        return "  ".join(out).rstrip()

    return [line(header), *(line(row) for row in rows)]


def _row(record: Record, indent: str = "") -> list[str]:
    seconds = _number(record.get("seconds")) or 0.0
    label = str(record.get("name", "?"))
    kind = record.get("kind", "phase")
    name = {"tier": f"tier {label}", "lane": f"lane {label}"}.get(str(kind), label)
    return [indent + name, _seconds(seconds), mmss(seconds), _result(record)]


def render(records: Sequence[Record], wall: float | None = None, bad: int = 0) -> str:
    """The phase table (phase, seconds, mm:ss, result; then "other" and the
    total) and the slowest tests, as plain text.

    Lanes (devcluster.lanes) ran at the same time: they are shown together
    under one row that counts the longest of them, each with what was
    recorded inside it indented below (not added up again)."""
    rows: list[list[str]] = []
    summed = 0.0
    timed = [r for r in records if r.get("kind", "phase") in ("phase", "tier")]
    for record in timed:
        if not record.get("lane"):
            summed += _number(record.get("seconds")) or 0.0
            rows.append(_row(record))
    lanes = [r for r in records if r.get("kind") == "lane"]
    if lanes:
        longest = max(_number(r.get("seconds")) or 0.0 for r in lanes)
        summed += longest
        rows.append(
            ["lanes, side by side (the longest counts)", _seconds(longest), mmss(longest), ""]
        )
        for lane in lanes:
            rows.append(_row(lane, "  "))
            rows += [_row(r, "    ") for r in timed if r.get("lane") == lane.get("name")]
    if wall is not None:
        # Negative only when rows overlap, which is a bug of the recording: show it.
        other = wall - summed
        rows.append(["other (outside these phases)", _seconds(other), mmss(other), ""])
        total, total_name = wall, "total (wall time of the run)"
    else:
        total, total_name = summed, "total (sum of the phases)"
    lines = ["CI phases"]
    if rows:
        rows.append([total_name, _seconds(total), mmss(total), ""])
        table = _table(["phase", "seconds", "mm:ss", "result"], rows, right={1, 2})
        lines += table[:-1]
        lines.append("-" * max(len(line) for line in table))
        lines.append(table[-1])
    else:
        lines.append("(no phases recorded)")
    if bad:
        lines.append(f"({bad} line(s) of the record file were not records and are left out)")

    tests = [r for r in records if r.get("kind") == "test"]
    tests.sort(key=lambda r: _number(r.get("seconds")) or 0.0, reverse=True)
    tests = tests[:SLOWEST]
    lines.append("")
    count = f"{len(tests)} " if tests else ""
    lines.append(f"{count}slowest tests (setup + call + teardown)")
    if tests:
        test_rows = []
        for record in tests:
            seconds = _number(record.get("seconds")) or 0.0
            outcome = str(record.get("outcome", ""))
            name = str(record.get("name", "?"))
            if outcome not in ("passed", ""):
                name += f"  ({outcome})"
            test_rows.append([_seconds(seconds), mmss(seconds), name])
        lines += _table(["seconds", "mm:ss", "test"], test_rows, right={0, 1})
    else:
        lines.append("(no tests recorded)")
    tiers = [r for r in records if r.get("kind") == "tier"]
    if tiers:
        # The run's last line, plain, for whoever reads only that.
        tally = {
            k: sum(int(r.get(k, 0) or 0) for r in tiers) for k in ("passed", "failed", "skipped")
        }
        closing = f"{tally['passed']} passed, {tally['failed']} failed"
        if tally["skipped"]:
            closing += f", {tally['skipped']} skipped"
        lines += ["", closing]
    return "\n".join(lines) + "\n"


def _run(name: str, command: Sequence[str]) -> int:
    """Run `command` as the phase `name`; its exit status is ours (128 + N
    when signal N killed it, as a shell says)."""
    if not command:
        print("devcluster.phases run: no command after --", file=sys.stderr)
        return 2
    began = time.monotonic()
    status = subprocess.call(list(command))
    _record_phase(name, time.monotonic() - began, status == 0, None)
    return status if status >= 0 else 128 - status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devcluster.phases",
        description=f"Record and report the phases of a CI run (file: ${ENV}).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="print the phase table of a record file")
    report.add_argument("file", type=Path)
    report.add_argument(
        "--wall", type=float, default=None, help="the run's wall time: adds the 'other' row"
    )
    run = commands.add_parser("run", help="run a command as a phase: run NAME -- COMMAND ...")
    run.add_argument("name")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "report":
        records, bad = read(args.file)
        sys.stdout.write(render(records, args.wall, bad))
        return 0
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    return _run(args.name, command)


if __name__ == "__main__":
    sys.exit(main())
