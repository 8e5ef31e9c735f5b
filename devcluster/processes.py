"""Start, find and kill the processes of a local cluster, safely across runs.

Every component runs in its own session (so its process group id is its PID),
and its PID is recorded on disk together with the kernel's start time of that
process. The start time is what makes it safe to kill "the process from the
PID file" of a run that died long ago: a recycled PID has another start time.
Linux only (reads /proc), like the rest of the local cluster.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from devcluster import records

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ProcessRecord:
    """What is written to `<run dir>/<component>.json` for one started process."""

    name: str
    pid: int
    start_ticks: int
    argv: list[str]
    ports: list[int]

    def save(self, path: Path) -> None:
        records.save(self, path)

    @classmethod
    def load(cls, path: Path) -> ProcessRecord:
        """FileNotFoundError, or a ValueError for a record that is not one."""
        return records.load(cls, path)

    def is_running(self) -> bool:
        """True while the very process we started (not a PID reuse) is alive."""
        return process_start_ticks(self.pid) == self.start_ticks and not is_zombie(self.pid)


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (which may contain spaces)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw[raw.rindex(")") + 2 :].split()


def process_start_ticks(pid: int) -> int | None:
    fields = _stat_fields(pid)
    # Field 22 of stat(5), "starttime"; index 19 once pid and comm are cut off.
    return int(fields[19]) if fields else None


def is_zombie(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        # fields[2] is the process group (stat field 5).
        if fields and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def listening_ports() -> set[int]:
    """TCP ports anything on this machine listens on (any address)."""
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _die_with_parent_preexec() -> Callable[[], None]:
    """A preexec_fn that makes the child get SIGKILL when its parent dies.

    That is the last line of defence for test runs: a pytest that is killed
    with SIGKILL runs no cleanup, and without this its control plane would
    outlive it. libc is loaded here, before the fork, not in the child.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The parent may have died between fork and prctl: then nobody would
        # ever signal us, so leave now.
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def launch(
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log_path: Path,
    cwd: Path,
    ports: Sequence[int],
    die_with_parent: bool,
) -> tuple[subprocess.Popen[bytes], ProcessRecord]:
    """Start one component in its own session, output appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        log.write(f"\n=== {stamp} devcluster starts {name}: {' '.join(argv)}\n".encode())
        log.flush()
        popen = subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Own session: one killpg reaches the component and anything it
            # forks, and a CLI that started it can exit without taking it along.
            start_new_session=True,
            preexec_fn=_die_with_parent_preexec() if die_with_parent else None,
        )
    ticks = process_start_ticks(popen.pid)
    if ticks is None:
        # Gone already (e.g. exec failed late): record it as dead, the
        # caller's readiness wait will report the log.
        ticks = -1
    record = ProcessRecord(name, popen.pid, ticks, list(argv), list(ports))
    return popen, record


def terminate(
    record: ProcessRecord,
    *,
    grace: float,
    popen: subprocess.Popen[bytes] | None = None,
) -> None:
    """SIGTERM the component's process group, SIGKILL after `grace` seconds.

    Raises RuntimeError if anything of the group is still alive afterwards.
    """
    pgid = record.pid
    leader_ours = record.is_running()
    leader_pid_taken = process_start_ticks(pgid) is not None and not leader_ours
    if leader_pid_taken and not is_zombie(pgid):
        # The PID now belongs to someone else, so our group is long gone:
        # the kernel reuses no PID while a process group still carries it.
        _reap(popen)
        return
    if not leader_ours and not group_members(pgid):
        _reap(popen)
        return
    _signal_group(pgid, signal.SIGTERM)
    if not _wait_group_gone(pgid, grace, popen):
        _signal_group(pgid, signal.SIGKILL)
        if not _wait_group_gone(pgid, 10.0, popen):
            raise RuntimeError(
                f"{record.name}: processes {group_members(pgid)} of group {pgid} survived SIGKILL"
            )
    # The group can be empty while our child is still an unreaped zombie.
    _reap(popen)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _reap(popen: subprocess.Popen[bytes] | None) -> None:
    if popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=1.0)


def _wait_group_gone(pgid: int, timeout: float, popen: subprocess.Popen[bytes] | None) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if popen is not None:
            # Reap our own child, or it lingers as a zombie.
            popen.poll()
        if not group_members(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
