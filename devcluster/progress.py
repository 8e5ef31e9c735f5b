"""Progress of long runs (`make up`) as plain lines: what is being done, how far
the run is, and the time since it began. No terminal control, so CI logs read
the same as a terminal.

    [ 0:00] [2/7] Go binaries ...
    [ 0:01]   go build kubernetes: kube-apiserver, kube-controller-manager, kubectl
    [ 4:12]   built kube-apiserver, kube-controller-manager, kubectl in 251s
    [ 9:40] [2/7] Go binaries: done (9:39)

The steps of devcluster (Go builds, image builds, imports) say what they do
at INFO on the `devcluster` loggers; `Progress.attach()` turns those records
into indented lines of the current step.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO


def clock_text(seconds: float) -> str:
    """m:ss, the width of a column up to 99 minutes."""
    whole = int(seconds)
    return f"{whole // 60:2d}:{whole % 60:02d}"


class Progress:
    """Writes progress lines to `out` (stdout by default), each flushed at once."""

    def __init__(self, out: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.out = out
        self.clock = clock
        self.began = clock()

    def _stream(self) -> TextIO:
        return self.out if self.out is not None else sys.stdout

    def elapsed(self) -> float:
        return self.clock() - self.began

    def line(self, text: str) -> None:
        print(f"[{clock_text(self.elapsed())}] {text}", file=self._stream(), flush=True)

    def text(self, text: str) -> None:
        """Output that is not progress (tables, a command's result), as it is."""
        print(text, file=self._stream(), flush=True)

    @contextmanager
    def step(self, title: str) -> Iterator[list[str]]:
        """A line when `title` starts and one when it ends, with its duration. The
        list it yields collects words for the end line ("cached", "built")."""
        began = self.clock()
        self.line(f"{title} ...")
        outcome: list[str] = []
        try:
            yield outcome
        except BaseException:
            self.line(f"{title}: FAILED after {clock_text(self.clock() - began).strip()}")
            raise
        said = ", ".join(outcome) or "done"
        self.line(f"{title}: {said} ({clock_text(self.clock() - began).strip()})")

    @contextmanager
    def attach(self, logger: str = "devcluster") -> Iterator[None]:
        """Show INFO records of `logger` (and its children) as indented progress lines."""
        handler = _LineHandler(self)
        target = logging.getLogger(logger)
        level = target.level
        target.addHandler(handler)
        target.setLevel(logging.INFO)
        try:
            yield
        finally:
            target.removeHandler(handler)
            target.setLevel(level)


class _LineHandler(logging.Handler):
    def __init__(self, progress: Progress) -> None:
        super().__init__(logging.INFO)
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.progress.line(f"  {record.getMessage()}")
        except Exception:  # a log line must never break the run
            self.handleError(record)
