"""Run the test tiers in lanes at the same time, and say how each ended.

`make test` has two kinds of tiers: those of the node (a kubelet, containerd,
images: `tests/devcluster`, `tests/e2e`) and those of plain processes (a
control plane, agents on loopback: the unit, integration, agent and SDK
tiers). They share nothing but the machine, and neither keeps both cores
busy for long: the node tier waits on image builds, pod starts and the
kubelet, the process tiers on watches and timers. So they run in lanes side
by side (the Makefile's `test` has four), each its own pytest session (own
clusters, own temporary directory), and the wall time is the longest lane's
rather than the sum.

    python -m devcluster.lanes NAME=COMMAND [NAME=COMMAND ...] [+JOB=COMMAND ...]

A `+JOB=COMMAND` is a job no lane owns: tiers that need no cluster of their
own. Whichever lane ends its COMMAND first takes the next one (in the order
given), and so on until none is left, so the lanes end close together on a
cold cache (where the node's builds hold its lanes back) as on a warm one
(where they do not). A lane runs every job it takes even after a failure.

Each COMMAND runs through the shell. Its output is written to the terminal
line by line with a `[NAME]` prefix as it comes, and kept whole in a log
file. At the end the runner prints each lane's exit status and the
summary line of each pytest session it ran, then one plain closing line summing
them (`N passed, N failed, N skipped`). Its exit status is 0 only when every
lane's is. With `SANDBOX_CI_PHASES` set, each lane is a record of its own,
and everything recorded inside it carries the lane's name
(`SANDBOX_CI_LANE`), so the phase table shows the lanes side by side.

Standard library only, like devcluster.phases.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from devcluster import phases

LANE_ENV = phases.LANE_ENV
# pytest's last summary line: "==== 3 failed, 120 passed, 2 skipped in 9.1s ====".
_SUMMARY = re.compile(r"^=+ (.*\d+ (?:passed|failed|errors?|skipped|deselected).*) in [\d.]+s")
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")


@dataclass
class Lane:
    name: str
    command: str
    log: Path
    status: int | None = None
    seconds: float = 0.0
    ended: float = 0.0  # monotonic time its output closed: when it finished
    summary: str = ""
    counts: dict[str, int] = field(default_factory=dict)
    jobs: list[str] = field(default_factory=list)  # the shared jobs it took, in order


@dataclass(frozen=True)
class Job:
    """A `+JOB=COMMAND`: run by whichever lane is free first."""

    name: str
    command: str


def parse_lanes(specs: Sequence[str], logs: Path) -> list[Lane]:
    return parse(specs, logs)[0]


def parse(specs: Sequence[str], logs: Path) -> tuple[list[Lane], list[Job]]:
    """The lanes (NAME=COMMAND) and the shared jobs (+JOB=COMMAND) of `specs`."""
    lanes: list[Lane] = []
    jobs: list[Job] = []
    for spec in specs:
        shared = spec.startswith("+")
        name, sep, command = spec.removeprefix("+").partition("=")
        if not sep or not name or not command.strip():
            raise ValueError(f"a lane is NAME=COMMAND (a shared job +NAME=COMMAND), not {spec!r}")
        if any(name == other for other in [lane.name for lane in lanes] + [j.name for j in jobs]):
            raise ValueError(f"two lanes or jobs named {name!r}")
        if shared:
            jobs.append(Job(name, command))
        else:
            lanes.append(Lane(name, command, logs / f"{name}.log"))
    if jobs and not lanes:
        raise ValueError("shared jobs need a lane to run them")
    return lanes, jobs


def counts_of(summary: str) -> dict[str, int]:
    """{"passed": N, "failed": N, ...} of a pytest summary line (errors count as failed)."""
    out: dict[str, int] = {}
    for number, word in _COUNT.findall(summary):
        key = "failed" if word.startswith("error") else word
        out[key] = out.get(key, 0) + int(number)
    return out


def closing_line(lanes: Sequence[Lane]) -> str:
    """One plain line for all lanes: `N passed, N failed` (`, N skipped`)."""
    total: dict[str, int] = {}
    for lane in lanes:
        for key, value in lane.counts.items():
            total[key] = total.get(key, 0) + value
    failed = total.get("failed", 0) + sum(
        1 for lane in lanes if lane.status != 0 and not lane.counts.get("failed")
    )
    line = f"{total.get('passed', 0)} passed, {failed} failed"
    if total.get("skipped"):
        line += f", {total['skipped']} skipped"
    return line


def _pump(lane: Lane, stream: IO[bytes], out: IO[str], lock: threading.Lock) -> None:
    with lane.log.open("a", encoding="utf-8") as log:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            log.write(line + "\n")
            found = _SUMMARY.match(line)
            if found:
                # A lane may run more than one pytest session: each adds its counts.
                lane.summary = "; ".join(filter(None, (lane.summary, line.strip("= "))))
                for key, value in counts_of(found.group(1)).items():
                    lane.counts[key] = lane.counts.get(key, 0) + value
            with lock:
                out.write(f"[{lane.name}] {line}\n")
                out.flush()


class _Runner:
    """The lanes' processes: each lane's command, then the shared jobs it takes."""

    def __init__(self, jobs: Sequence[Job], out: IO[str]) -> None:
        self.out = out
        self.lock = threading.Lock()  # output lines, the queue, the running set
        self.queue = list(jobs)
        self.running: set[subprocess.Popen[bytes]] = set()
        self.stopped: list[int] = []

    def stop(self, signum: int, _frame: object) -> None:
        # Each command is a process group of its own: pass the signal on to all
        # of it (pytest stops its clusters on SIGTERM); no more jobs are taken.
        self.stopped.append(signum)
        with self.lock:
            running = list(self.running)
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)

    def _command(self, lane: Lane, command: str) -> int:
        env = {**os.environ, LANE_ENV: lane.name, "PYTHONUNBUFFERED": "1"}
        with self.lock:
            if self.stopped:
                return 128 + self.stopped[0]
            proc = subprocess.Popen(
                ["bash", "-o", "pipefail", "-c", command],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
            self.running.add(proc)
        assert proc.stdout is not None
        _pump(lane, proc.stdout, self.out, self.lock)
        status = proc.wait()
        with self.lock:
            self.running.discard(proc)
        return status

    def _next(self) -> Job | None:
        with self.lock:
            return None if self.stopped or not self.queue else self.queue.pop(0)

    def lane(self, lane: Lane) -> None:
        began = time.monotonic()
        lane.status = self._command(lane, lane.command)
        while (job := self._next()) is not None:
            lane.jobs.append(job.name)
            with self.lock:
                self.out.write(f"[{lane.name}] -- taking the shared job {job.name}\n")
            status = self._command(lane, job.command)
            lane.status = lane.status or status
        lane.ended = time.monotonic()
        lane.seconds = lane.ended - began


def run(lanes: Sequence[Lane], out: IO[str] = sys.stdout, jobs: Sequence[Job] = ()) -> int:
    runner = _Runner(jobs, out)
    previous = {sig: signal.signal(sig, runner.stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    threads = [threading.Thread(target=runner.lane, args=(lane,)) for lane in lanes]
    for thread in threads:
        thread.start()
    for lane, thread in zip(lanes, threads, strict=True):
        # In short slices: the main thread must stay free to take a signal.
        while thread.is_alive():
            thread.join(0.2)
        phases.append(
            {
                "kind": "lane",
                "name": lane.name,
                "seconds": round(lane.seconds, 3),
                "ok": lane.status == 0,
            }
        )
    out.write("\n")
    for lane in lanes:
        state = "ok" if lane.status == 0 else f"exit status {lane.status}"
        took = f", then {', '.join(lane.jobs)}" if lane.jobs else ""
        out.write(
            f"lane {lane.name}: {state} after {phases.mmss(lane.seconds)}"
            f" ({lane.summary or 'no pytest summary'}{took}; log: {lane.log})\n"
        )
    out.write(closing_line(lanes) + "\n")
    out.flush()
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    if runner.stopped:
        return 128 + runner.stopped[0]
    return 0 if all(lane.status == 0 for lane in lanes) else 1


def main(argv: Sequence[str] | None = None) -> int:
    specs = list(sys.argv[1:] if argv is None else argv)
    if not specs:
        print(
            "usage: python -m devcluster.lanes NAME=COMMAND [NAME=COMMAND ...] [+JOB=COMMAND ...]",
            file=sys.stderr,
        )
        return 2
    logs = Path(tempfile.mkdtemp(prefix="lanes-"))
    try:
        lanes, jobs = parse(specs, logs)
    except ValueError as error:
        print(f"devcluster.lanes: {error}", file=sys.stderr)
        return 2
    return run(lanes, jobs=jobs)


if __name__ == "__main__":
    sys.exit(main())
