"""Append-only journal of execution records, so idempotency survives an agent restart.

Without it, a restarted agent (sidecar crash, OOM kill) would forget which
idempotency keys it has seen, and the operator's retry would run a command a
second time. The runner kills the commands of a dropped connection, so an
execution that was running when the agent died is reported as ``lost``
(``agent_restarted``), never started again.

One JSON object per line: ``new`` when a record is created, ``end`` when it
finishes, ``del`` when it is forgotten. One small append per event; the file
is rewritten from the live records when it grows past a few times their number.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any

import msgspec

log = logging.getLogger("sandbox_agent.journal")

NAME = "executions.journal"
_encode = msgspec.json.Encoder().encode  # hot path: two lines per execution


class Journal:
    def __init__(self, directory: str, max_records: int) -> None:
        self.path = os.path.join(directory, NAME)
        self.max_lines = 4 * max_records + 100
        self.lines = 0
        self.size = 0  # bytes in the file: they count against the log budget
        self.fd = -1

    def load(self) -> list[dict[str, Any]]:
        """Records in creation order, each merged from its new/end lines."""
        records: dict[str, dict[str, Any]] = {}
        try:
            with open(self.path, "rb") as f:
                for raw in f:
                    self.lines += 1
                    self.size += len(raw)
                    try:
                        entry = json.loads(raw)
                    except ValueError:
                        continue  # a torn last line after a crash
                    if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                        continue
                    op = entry.pop("op", None)
                    if op == "new":
                        records[entry["id"]] = entry
                    elif op == "end" and entry["id"] in records:
                        records[entry["id"]].update(entry)
                    elif op == "del":
                        records.pop(entry["id"], None)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot read %s: %s; starting without history", self.path, exc)
        return list(records.values())

    def open(self) -> None:
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)

    def append(self, op: str, data: dict[str, Any]) -> None:
        if self.fd < 0:
            return
        line = _encode({"op": op, **data}) + b"\n"
        try:
            os.write(self.fd, line)
            self.lines += 1
            self.size += len(line)
        except OSError as exc:  # a full disk must not break executions
            log.warning("journal write failed: %s", exc)

    def needs_compaction(self) -> bool:
        return self.lines > self.max_lines

    def rewrite(self, entries: list[tuple[str, dict[str, Any]]]) -> None:
        tmp = self.path + ".tmp"
        size = 0
        try:
            with open(tmp, "wb") as f:
                for op, data in entries:
                    line = _encode({"op": op, **data}) + b"\n"
                    f.write(line)
                    size += len(line)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("journal compaction failed: %s", exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return
        if self.fd >= 0:
            os.close(self.fd)
        self.open()
        self.lines = len(entries)
        self.size = size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
