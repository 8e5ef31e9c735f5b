"""`make up`'s progress lines: the time since the start, a line as a step starts
and as it ends (with its duration and outcome), devcluster's build records
inside a step, and a failed step said as such."""

from __future__ import annotations

import io
import logging

import pytest

from devcluster.progress import Progress, clock_text


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_steps_say_when_they_start_and_end_with_the_elapsed_time() -> None:
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, clock)
    with progress.step("[2/7] Go binaries") as said, progress.attach():
        clock.now += 65
        logging.getLogger("devcluster.build").info("built kubelet in %ds", 64)
        logging.getLogger("devcluster.build").debug("go build -o ... (not shown)")
        clock.now += 600
        said.append("built")
    assert out.getvalue().splitlines() == [
        "[ 0:00] [2/7] Go binaries ...",
        "[ 1:05]   built kubelet in 64s",
        "[11:05] [2/7] Go binaries: built (11:05)",
    ]
    # The handler is gone after the step: later records are not progress lines.
    logging.getLogger("devcluster.build").info("after")
    assert "after" not in out.getvalue()


def test_a_failed_step_says_so() -> None:
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, clock)

    def fail() -> None:
        with progress.step("[4/7] cluster"):
            clock.now += 3
            raise RuntimeError("no pids cgroup")

    with pytest.raises(RuntimeError):
        fail()
    assert out.getvalue().splitlines()[-1] == "[ 0:03] [4/7] cluster: FAILED after 0:03"


def test_the_clock_column_keeps_its_width() -> None:
    assert [clock_text(s) for s in (0, 59.9, 61, 3599)] == [" 0:00", " 0:59", " 1:01", "59:59"]
