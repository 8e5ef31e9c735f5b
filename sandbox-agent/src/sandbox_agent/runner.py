#!/usr/bin/env python3
"""Sandbox runner: the entrypoint of the sandbox container.

It listens on a Unix socket in a directory shared with the agent sidecar and
spawns the commands the agent relays, each in its own session (so a whole
process group can be signalled), streams their stdout/stderr back, feeds
stdin, reports exit status with resource usage, and reaps orphans (it is
PID 1 of its container).

Constraints that shape this file:
- stdlib only, Python >= 3.9 syntax: it runs in the user's image, with
  whatever python3 that image ships. The agent copies this very file into
  the shared runtime directory at start-up.
- one thread, one selector loop: no locks, and os.chdir() before
  posix_spawn is safe because nothing else runs concurrently.

Wire format (both directions): a 9-byte header ``>IBI`` = payload length,
frame type, channel (the agent's execution number on this connection),
followed by the payload. Control payloads are JSON objects; output, stdin and
script payloads are raw bytes.

A shell script does not travel in argv (Linux caps one argument at 128 KiB):
the agent sends it in T_SCRIPT frames before the T_SPAWN that asks for it
(``"scriptFd": 3``), and the command gets it as an in-memory file on that
descriptor (``sh -c '. /dev/fd/3' sh``).

Optional fields, ignored by older peers: ``"executable"`` in T_HELLO_ACK
(this interpreter's path), ``"mark"`` in T_SPAWN (else the
runner makes one up), ``"sweepSeconds"`` in T_SIGNAL (the sweep's bound),
``"survivors"`` in T_EXIT (present and > 0 only when a kill was not complete).

A terminal is a T_SPAWN with ``"pty": {"cols", "rows"}``: the command gets a
new pseudo-terminal as stdin, stdout, stderr and controlling terminal (it is
the leader of its own session), its output comes as T_STDOUT, T_STDIN goes to
the terminal, T_RESIZE changes the window size (the kernel tells the
foreground job, SIGWINCH) and T_SIGNAL with ``"foreground": true`` signals
the terminal's foreground process group (what Ctrl-C would reach).
``"everywhere": true`` in T_SIGNAL reaches every process that carries the
command's mark, also those outside its process group (a shell's jobs, daemons):
how a quiesce stops (SIGSTOP) and continues (SIGCONT) all of a command.

Every command carries a mark in its environment, ``SANDBOX_EXECUTION=<id>``
(the agent's execution id), which its descendants inherit. A kill (SIGKILL,
or SIGTERM followed by the command's end) does not stop at the process group:
the runner then sweeps its PID namespace (/proc) for processes that carry the
mark, also those that left the group (setsid, daemons), stops and kills them,
and reports the command's end only once none is left, or, past a bound, with
the number it could not end (``survivors``), so that the agent can have the
container restarted.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import json
import os
import selectors
import signal
import socket
import struct
import sys
import tempfile
import termios
import time
from collections.abc import Iterable
from typing import Any

__version__ = "0.1.0"
# 2: T_SCRIPT frames, scriptFd/combined/unset in T_SPAWN, instance in the hello.
# 3: T_STATS / T_STATS_ACK (the container's cgroup counters).
# 4: "pty" in T_SPAWN, T_RESIZE, "foreground" and "everywhere" in T_SIGNAL.
PROTOCOL = 4

HEADER = struct.Struct(">IBI")
# Largest payload either side may send. The agent enforces it on what it
# reads from us (it treats this process as untrusted); we enforce it on what
# the agent sends.
MAX_PAYLOAD = 1 << 20
READ_CHUNK = MAX_PAYLOAD
# A command's stdout pipe is grown (F_SETPIPE_SZ) so a burst of output costs a
# few large reads instead of a context switch per 64 KiB. Best effort: the
# kernel caps it (pipe-max-size, per-user pipe budget).
STDOUT_PIPE_SIZE = int(os.environ.get("SANDBOX_RUNNER_PIPE_BYTES", str(1 << 20)))
F_SETPIPE_SZ = 1031
SOCKET_BUFFER = 4 << 20
LINGER = float(os.environ.get("SANDBOX_RUNNER_LINGER_MS", "1")) / 1000.0
# stdin a command does not read is buffered up to this; past it, its stdin
# is closed (and the agent told) rather than letting the buffer grow.
STDIN_BUFFER = int(os.environ.get("SANDBOX_RUNNER_STDIN_BUFFER_BYTES", str(64 << 20)))
# A script is held whole until its command starts; the agent's body limit is
# far below this, which only stops a broken client from exhausting memory.
MAX_SCRIPT = 64 << 20

# agent -> runner
T_HELLO = 1
T_SPAWN = 2
T_STDIN = 3
T_STDIN_CLOSE = 4
T_SIGNAL = 5
T_PING = 6
T_SCRIPT = 7  # a piece of the script of the next T_SPAWN on this channel
T_STATS = 8  # the container's cgroup counters, please (payload: a token to echo)
T_RESIZE = 9  # a terminal's window size: {"cols", "rows"}
# runner -> agent
T_HELLO_ACK = 65
T_STARTED = 66
T_STDOUT = 67
T_STDERR = 68
T_EXIT = 69
T_SPAWN_FAILED = 70
T_PONG = 71
T_STDIN_CLOSED = 72  # the command's stdin is gone (EPIPE or buffer overflow)
T_STATS_ACK = 73  # {"token": hex, "stats": cgroup_stats()}

# Output keeps flowing after the leader exits while a background grandchild
# holds the pipes; wait this long for EOF, then report the exit anyway
# rather than hang until the grandchild dies.
DRAIN_GRACE = float(os.environ.get("SANDBOX_RUNNER_DRAIN_SECONDS", "0.5"))
# Stop reading children's pipes while this much output is queued for a slow
# agent: the children then block on write, which is the backpressure we want.
WBUF_HIGH = 8 << 20
WBUF_LOW = 1 << 20
# A terminal's window size bounds (what TIOCSWINSZ takes is 16 bits each).
MAX_WINDOW = 1000
# What a terminal's programs assume when the request names no TERM.
DEFAULT_TERM = "xterm-256color"
# The mark of a command's processes: set by us in its environment (ours wins
# over the request's), inherited by whatever it starts.
MARK_NAME = "SANDBOX_EXECUTION"
_MARK_KEY = b"\0" + MARK_NAME.encode() + b"="
_MARK_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")
MAX_MARK = 128
# How much of a process's environment a sweep reads to find the mark (the
# environment is the process's own memory: it may be huge; bounded cost).
ENVIRON_SCAN_BYTES = 256 << 10
ENVIRON_CHUNK = 64 << 10
# How long a sweep may go on when the agent names no bound (older agents).
SWEEP_SECONDS = float(os.environ.get("SANDBOX_RUNNER_SWEEP_SECONDS", "2.5"))
# A pass that finds nothing is confirmed by another one this much later (a
# process forked between our listing of /proc and our reading of its parent
# is only seen by the next listing).
SWEEP_CONFIRM_DELAY = 0.02
# Python ignores SIGPIPE (and we install handlers for others); a spawned
# command must start with default dispositions like from a shell.
_RESET_SIGNALS = tuple(
    getattr(signal, name)
    for name in (
        "SIGPIPE",
        "SIGXFSZ",
        "SIGCHLD",
        "SIGTERM",
        "SIGINT",
        "SIGHUP",
        "SIGQUIT",
        "SIGUSR1",
        "SIGUSR2",
        "SIGALRM",
        "SIGTSTP",
        "SIGTTIN",
        "SIGTTOU",
    )
    if hasattr(signal, name)
)


def _reason(exc: BaseException) -> str:
    return str(getattr(exc, "strerror", None) or exc)


def _log(msg: str) -> None:
    sys.stderr.write("sandbox-runner: " + msg + "\n")
    sys.stderr.flush()


CGROUP_ROOT = os.environ.get("SANDBOX_RUNNER_CGROUP_ROOT", "/sys/fs/cgroup")


def _read_cgroup(*names: str) -> str | None:
    """The first of `names` (relative to the cgroup mount) that can be read."""
    for name in names:
        try:
            with open(os.path.join(CGROUP_ROOT, name)) as f:
                return f.read()
        except OSError:
            continue
    return None


def _keyed(text: str | None) -> dict[str, int]:
    """`key value` lines (cpu.stat, pids.events) as numbers."""
    found = {}
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            found[key] = int(value)
    return found


def _number(text: str | None) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None


def cgroup_stats() -> dict[str, Any]:
    """This container's PID and CPU counters from its own cgroup (v2, or v1's
    pids and cpu hierarchies), for the operator's status and Events. A value
    the mount does not show (gVisor, no pids controller) is None.

    `pidsRefused` counts forks this cgroup's tasks were refused by a PID limit
    (pids.events `max`; on v1 it is counted where the fork happened, so a
    limit on the pod's cgroup shows here too)."""
    cpu = _keyed(_read_cgroup("cpu.stat", "cpu,cpuacct/cpu.stat", "cpu/cpu.stat"))
    throttled = cpu.get("throttled_usec")
    seconds = throttled / 1e6 if throttled is not None else None
    if seconds is None and "throttled_time" in cpu:  # v1: nanoseconds
        seconds = cpu["throttled_time"] / 1e9
    return {
        "pidsCurrent": _number(_read_cgroup("pids.current", "pids/pids.current")),
        "pidsLimit": _number(_read_cgroup("pids.max", "pids/pids.max")),
        "pidsRefused": _keyed(_read_cgroup("pids.events", "pids/pids.events")).get("max"),
        "cpuPeriods": cpu.get("nr_periods"),
        "cpuThrottledPeriods": cpu.get("nr_throttled"),
        "cpuThrottledSeconds": seconds,
    }


def _set_nonblocking(fd: int) -> None:
    os.set_blocking(fd, False)


class Child:
    """One spawned command and the pipes we hold for it."""

    __slots__ = (
        "channel",
        "conn",
        "drain_deadline",
        "ending",
        "err_fd",
        "exit_time",
        "in_fd",
        "mark",
        "out_fd",
        "pid",
        "pty_fd",
        "rusage",
        "start_time",
        "status",
        "stdin_buf",
        "stdin_close",
        "survivors",
        "sweep",
        "sweep_seconds",
        "swept",
    )

    def __init__(self, conn: Conn, channel: int, pid: int, mark: bytes) -> None:
        self.conn: Conn | None = conn
        self.channel = channel
        self.pid = pid
        self.mark = mark
        # A kill was asked for (SIGKILL, or SIGTERM: then the command's end
        # takes its remaining processes with it, as a container's PID 1 does).
        self.ending = False
        self.sweep_seconds = SWEEP_SECONDS
        self.sweep: Sweep | None = None  # running
        self.swept = False  # a sweep ended (and found `survivors` it could not kill)
        self.survivors = 0
        self.out_fd = -1
        self.err_fd = -1
        self.in_fd = -1
        self.pty_fd = -1  # a terminal's master side (ours; closed with the child)
        self.stdin_buf = bytearray()
        self.stdin_close = False
        self.status: int | None = None
        self.rusage: Any = None
        self.start_time = time.time()
        self.exit_time = 0.0
        self.drain_deadline = 0.0


class Sweep:
    """Killing every process that carries one command's mark, pass after pass,
    until two passes in a row find none or the deadline passes."""

    __slots__ = ("children", "clean", "deadline", "left", "mark", "next_at", "started")

    def __init__(self, mark: bytes, seconds: float) -> None:
        now = time.monotonic()
        self.mark = mark
        self.children: list[Child] = []  # whose end waits for this sweep
        self.started = now
        self.deadline = now + seconds
        self.next_at = now
        self.clean = 0  # passes in a row that found nothing
        self.left = 0  # processes the last pass found (and signalled)


def _environ_mark(pid: str) -> bytes | None:
    """The value of the first mark entry in the first ENVIRON_SCAN_BYTES of a
    process's environment; None if there is none or it cannot be read (the
    process is gone, a zombie, a kernel thread, another user's or not
    dumpable). Bytes, never decoded: the environment is the process's own."""
    try:
        fd = os.open("/proc/" + pid + "/environ", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        buf = bytearray(b"\0")  # so that the first entry matches like the others
        key_at = -1
        eof = False
        while not eof and len(buf) <= ENVIRON_SCAN_BYTES:
            try:
                chunk = os.read(fd, ENVIRON_CHUNK)
            except OSError:
                return None
            eof = not chunk
            seen = len(buf)
            buf += chunk
            if key_at < 0:
                key_at = buf.find(_MARK_KEY, max(0, seen - len(_MARK_KEY) + 1))
            if key_at >= 0:
                start = key_at + len(_MARK_KEY)
                end = buf.find(b"\0", max(start, seen))
                if end >= 0:
                    return bytes(buf[start:end])
                if eof:
                    return bytes(buf[start:])
        return None
    finally:
        os.close(fd)


def _pgrp(pid: str) -> int:
    """A process's process group (0 if it cannot be read)."""
    try:
        fd = os.open("/proc/" + pid + "/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        # "pid (comm) state ppid pgrp ...": comm may hold anything but is
        # followed by the last ')'.
        fields = os.read(fd, 4096).rpartition(b")")[2].split()
        return int(fields[2])
    except (OSError, ValueError, IndexError):
        return 0
    finally:
        os.close(fd)


def _start_ticks(pid: str) -> int:
    """When a process started, in clock ticks since boot (0 if it cannot be read)."""
    try:
        fd = os.open("/proc/" + pid + "/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        fields = os.read(fd, 4096).rpartition(b")")[2].split()
        return int(fields[19])  # field 22 of stat(5); fields[0] is field 3
    except (OSError, ValueError, IndexError):
        return 0
    finally:
        os.close(fd)


def _now_ticks() -> int:
    try:
        with open("/proc/uptime", "rb") as f:
            return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0


class Windows:
    """When each command ran, in clock ticks, to attribute processes that
    carry no mark (it was removed, ``env -i``; or the environment cannot be
    read, a process made not dumpable) to a command by their start time.

    Used only where the runner is PID 1, i.e. owns its PID namespace (the
    sandbox container): everything in it was started through the runner, so
    a process that started while exactly one command was running is that
    command's. One that started while several ran, or none, is nobody's and
    is left alone (a conservative rule: no wrong kill of another command's
    processes; the mark remains the way to tell those apart)."""

    def __init__(self) -> None:
        self.running: dict[bytes, int] = {}
        self.ended: collections.deque[tuple[bytes, int, int]] = collections.deque(maxlen=4096)

    def opened(self, mark: bytes, start: int) -> None:
        self.running[mark] = start

    def closed(self, mark: bytes) -> None:
        start = self.running.pop(mark, None)
        if start is not None:
            self.ended.append((mark, start, _now_ticks()))

    def owner(self, start: int) -> bytes | None:
        if not start:
            return None
        owners = {m for m, s in self.running.items() if s <= start}
        # An ended command's window excludes its last tick (10 ms): the next
        # command often starts within it, and what starts then is far more
        # likely the new command's than a last-moment child of the old one.
        owners.update(m for m, s, e in self.ended if s <= start < e)
        return owners.pop() if len(owners) == 1 else None


def _signal_marked(
    marks: Iterable[bytes],
    sig: int,
    then: int = 0,
    skip_group: int = 0,
    windows: Windows | None = None,
) -> dict[bytes, int]:
    """Send ``sig`` to every process (but us) whose mark is one of ``marks``,
    then ``then`` (if given) to all of them; how many each mark had. Members
    of process group ``skip_group`` (already signalled with killpg) are left
    out, so that nobody gets a TERM twice. With ``windows``, a process without
    a readable mark counts as the command it started under (see Windows).

    /proc is read as found: processes come and go during the scan (a vanished
    one simply does not count), and a process we may not signal still counts.
    """
    wanted = set(marks)
    counts: dict[bytes, int] = {}
    if not wanted:
        return counts
    try:
        names = os.listdir("/proc")
    except OSError:
        return counts
    me = os.getpid()
    hits: list[int] = []
    for name in names:
        if not (name.isascii() and name.isdigit()):
            continue
        pid = int(name)
        if pid == me:
            continue
        mark = _environ_mark(name)
        if mark is None and windows is not None:
            mark = windows.owner(_start_ticks(name))
        if mark is None or mark not in wanted:
            continue
        if skip_group and _pgrp(name) == skip_group:
            continue
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
        except OSError:
            pass  # EPERM: it is there and ours, and it outlives us
        counts[mark] = counts.get(mark, 0) + 1
        hits.append(pid)
    if then:
        for pid in hits:
            with contextlib.suppress(OSError):
                os.kill(pid, then)
    return counts


def _valid_mark(value: object) -> bytes:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_MARK:
        raise ValueError("bad mark")
    if not set(value) <= _MARK_CHARS:
        raise ValueError("bad mark")
    return value.encode()


class Conn:
    """One agent connection; several may coexist (e.g. across agent restarts)."""

    __slots__ = ("children", "closed", "rbuf", "scripts", "sock", "wbuf")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rbuf = bytearray()
        self.wbuf = bytearray()
        self.children: dict[int, Child] = {}
        self.scripts: dict[int, bytearray] = {}  # channel -> script received so far
        self.closed = False


class Runner:
    def __init__(self, sock_path: str, workspace: str, socket_mode: int) -> None:
        self.sock_path = sock_path
        self.workspace = workspace
        self.sel = selectors.DefaultSelector()
        self.by_pid: dict[int, Child] = {}
        self.by_fd: dict[int, tuple[Child, int]] = {}
        self.lingering: dict[int, float] = {}  # pipe fd -> when to read it again
        self.conns: dict[int, Conn] = {}
        self.sweeps: dict[bytes, Sweep] = {}
        self.spawned = 0  # for marks of spawns that name none
        # As PID 1 we own the PID namespace: processes that shed their mark
        # are attributed by start time (see Windows).
        self.windows: Windows | None = Windows() if os.getpid() == 1 else None
        self.stopping = 0.0
        # Tells this runner from the one a restarted container starts (the pid
        # is 1 in both): the agent keys "restart the runtime" to an instance.
        self.instance = os.urandom(8).hex()
        self.base_env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("SANDBOX_RUNNER_") and k != MARK_NAME
        }

        self.wake_r, self.wake_w = os.pipe()
        _set_nonblocking(self.wake_r)
        _set_nonblocking(self.wake_w)
        signal.set_wakeup_fd(self.wake_w)
        # Handlers only exist so that the wakeup fd is written; the loop does
        # the work (reaping, shutdown) outside signal context.
        signal.signal(signal.SIGCHLD, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")

        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock_path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(sock_path)
        os.chmod(sock_path, socket_mode)
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT) and not self.stopping:
            self.stopping = time.monotonic()

    # -- main loop -------------------------------------------------------

    def serve(self) -> int:
        stop_sent = False
        stop_marks: set[bytes] = set()  # the commands running when we were told to stop
        while True:
            if self.stopping:
                if not stop_sent:
                    stop_sent = True
                    stop_marks = {c.mark for c in self.by_pid.values()}
                    self._signal_all(signal.SIGTERM)
                if not self.by_pid or time.monotonic() - self.stopping > 3.0:
                    self._signal_all(signal.SIGKILL)
                    self._sweep_now(stop_marks | set(self.sweeps), 1.0)
                    return 0
            timeout = self._next_timeout()
            for key, mask in self.sel.select(timeout):
                tag = key.data
                if tag == "wake":
                    self._drain_wakeup()
                elif tag == "listen":
                    self._accept()
                elif isinstance(tag, Conn):
                    if mask & selectors.EVENT_READ:
                        self._conn_readable(tag)
                    if not tag.closed and mask & selectors.EVENT_WRITE:
                        self._flush(tag)
                else:
                    self._pipe_event(key.fd)
            self._reap()
            self._check_lingering()
            self._check_drain_deadlines()
            self._run_sweeps()

    def _next_timeout(self) -> float | None:
        deadlines = [c.drain_deadline for c in self._pending_children() if c.drain_deadline]
        deadlines.extend(self.lingering.values())
        deadlines.extend(s.next_at for s in self.sweeps.values())
        if self.stopping:
            deadlines.append(time.monotonic() + 0.1)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    def _pending_children(self) -> list[Child]:
        out: list[Child] = []
        for conn in self.conns.values():
            out.extend(conn.children.values())
        return out

    def _drain_wakeup(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _signal_all(self, sig: int) -> None:
        for pid, child in list(self.by_pid.items()):
            with contextlib.suppress(OSError):
                os.killpg(pid, sig)
            _signal_marked((child.mark,), sig, skip_group=pid, windows=self.windows)

    # -- sweeps: a command's processes, wherever they went ------------------

    def _kill_child(self, child: Child, sig: int) -> None:
        """Signal a command's process group; SIGKILL and SIGTERM also reach
        the processes that left it, and end the command with all of them."""
        with contextlib.suppress(OSError):
            os.killpg(child.pid, sig)
        if sig == signal.SIGKILL:
            child.ending = True
            self._start_sweep(child)
        elif sig == signal.SIGTERM:
            child.ending = True
            if child.sweep is None:  # the request reaches them all, once
                _signal_marked((child.mark,), sig, skip_group=child.pid, windows=self.windows)
            self._maybe_finish(child)  # an exit already seen: sweep now

    def _start_sweep(self, child: Child) -> None:
        if child.sweep is not None:
            return  # one is under way (its deadline stands)
        sweep = self.sweeps.get(child.mark)
        if sweep is None:
            sweep = self.sweeps[child.mark] = Sweep(child.mark, child.sweep_seconds)
        sweep.children.append(child)
        child.sweep = sweep
        child.swept = False

    def _run_sweeps(self) -> None:
        """One pass for every sweep that is due (then back to the loop: other
        commands' output and the agent's pings are served between passes)."""
        if not self.sweeps:
            return
        now = time.monotonic()
        due = [s for s in self.sweeps.values() if s.next_at <= now]
        if not due:
            return
        # Stopped processes cannot fork (nor restart what we kill): stop each
        # as soon as it is found, kill them all once the pass is through.
        found = _signal_marked(
            [s.mark for s in due], signal.SIGSTOP, signal.SIGKILL, windows=self.windows
        )
        now = time.monotonic()
        for s in due:
            s.left = found.get(s.mark, 0)
            if s.left:
                s.clean = 0
                s.next_at = now
            else:
                s.clean += 1
                s.next_at = now + SWEEP_CONFIRM_DELAY
            if s.clean >= 2 or now >= s.deadline:
                self._end_sweep(s)

    def _end_sweep(self, sweep: Sweep) -> None:
        self.sweeps.pop(sweep.mark, None)
        if sweep.left:
            _log(
                f"{sweep.left} process(es) marked {sweep.mark.decode(errors='replace')} "
                f"still alive after {time.monotonic() - sweep.started:.1f}s of sweeping"
            )
        for child in sweep.children:
            if child.sweep is sweep:
                child.sweep = None
                child.swept = True
                child.survivors = sweep.left
                self._maybe_finish(child)

    def _sweep_now(self, marks: set[bytes], seconds: float) -> None:
        """Sweep ``marks`` to the end or for ``seconds``, blocking (shutdown)."""
        deadline = time.monotonic() + seconds
        clean = 0
        while marks and clean < 2 and time.monotonic() < deadline:
            if _signal_marked(marks, signal.SIGSTOP, signal.SIGKILL, windows=self.windows):
                clean = 0
            else:
                clean += 1
                time.sleep(SWEEP_CONFIRM_DELAY)

    # -- connections -----------------------------------------------------

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        conn = Conn(sock)
        self.conns[sock.fileno()] = conn
        self.sel.register(sock, selectors.EVENT_READ, conn)

    def _close_conn(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn.sock)
        self.conns.pop(conn.sock.fileno(), None)
        conn.sock.close()
        # Nobody can observe these commands any more (the agent reports them
        # as lost), so do not leave them running invisibly, nor what they
        # started outside their process group.
        for child in list(conn.children.values()):
            self._close_child_fds(child)
            child.conn = None
            if child.status is None or child.ending:
                self._kill_child(child, signal.SIGKILL)
        conn.children.clear()

    def _conn_readable(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close_conn(conn)
            return
        if not data:
            self._close_conn(conn)
            return
        conn.rbuf += data
        buf = conn.rbuf
        pos = 0
        while len(buf) - pos >= HEADER.size:
            length, ftype, channel = HEADER.unpack_from(buf, pos)
            if length > MAX_PAYLOAD:
                _log("frame too large from client; closing connection")
                self._close_conn(conn)
                return
            end = pos + HEADER.size + length
            if len(buf) < end:
                break
            payload = bytes(buf[pos + HEADER.size : end])
            pos = end
            try:
                self._dispatch(conn, ftype, channel, payload)
            except (ValueError, TypeError, KeyError) as exc:
                _log(f"bad frame from client ({exc}); closing connection")
                self._close_conn(conn)
                return
            if conn.closed:
                return
        if pos:
            del buf[:pos]

    def _send(self, conn: Conn | None, ftype: int, channel: int, payload: bytes) -> None:
        if conn is None or conn.closed:
            return
        head = HEADER.pack(len(payload), ftype, channel)
        if conn.wbuf:
            conn.wbuf += head
            conn.wbuf += payload
            return
        try:
            # scatter/gather: no concatenated copy of a 1 MiB payload
            sent = conn.sock.sendmsg([head, payload])
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close_conn(conn)
            return
        if sent < len(head) + len(payload):
            if sent < len(head):
                conn.wbuf += head[sent:]
                conn.wbuf += payload
            else:
                conn.wbuf += memoryview(payload)[sent - len(head) :]
            self.sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
            if len(conn.wbuf) > WBUF_HIGH:
                self._set_output_paused(conn, True)

    def _send_json(self, conn: Conn | None, ftype: int, channel: int, obj: Any) -> None:
        self._send(conn, ftype, channel, json.dumps(obj, separators=(",", ":")).encode())

    def _flush(self, conn: Conn) -> None:
        try:
            sent = conn.sock.send(conn.wbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close_conn(conn)
            return
        del conn.wbuf[:sent]
        if not conn.wbuf:
            self.sel.modify(conn.sock, selectors.EVENT_READ, conn)
        if len(conn.wbuf) < WBUF_LOW:
            self._set_output_paused(conn, False)

    def _set_output_paused(self, conn: Conn, paused: bool) -> None:
        for child in conn.children.values():
            for fd in (child.out_fd, child.err_fd):
                if fd < 0:
                    continue
                if paused:
                    self._unwatch(fd)
                elif fd not in self.lingering:
                    self._watch(fd)

    # -- frames ----------------------------------------------------------

    def _dispatch(self, conn: Conn, ftype: int, channel: int, payload: bytes) -> None:
        if ftype == T_HELLO:
            self._send_json(
                conn,
                T_HELLO_ACK,
                0,
                {
                    "protocol": PROTOCOL,
                    "version": __version__,
                    "pid": os.getpid(),
                    "uid": os.getuid(),
                    "gid": os.getgid(),
                    "python": ".".join(str(v) for v in sys.version_info[:3]),
                    # The interpreter the agent's Python helpers (code contexts) run on.
                    "executable": sys.executable,
                    "instance": self.instance,
                },
            )
        elif ftype == T_PING:
            self._send(conn, T_PONG, channel, payload)
        elif ftype == T_STATS:
            self._send_json(
                conn, T_STATS_ACK, channel, {"token": payload.hex(), "stats": cgroup_stats()}
            )
        elif ftype == T_SCRIPT:
            script = conn.scripts.setdefault(channel, bytearray())
            if len(script) + len(payload) > MAX_SCRIPT:
                raise ValueError(f"script for channel {channel} exceeds {MAX_SCRIPT} bytes")
            script += payload
        elif ftype == T_SPAWN:
            if channel in conn.children:
                raise ValueError(f"channel {channel} already in use")
            self._spawn(conn, channel, json.loads(payload), conn.scripts.pop(channel, None))
        elif ftype == T_STDIN:
            child = conn.children.get(channel)
            if child is not None and child.in_fd >= 0 and not child.stdin_close:
                if len(child.stdin_buf) + len(payload) > STDIN_BUFFER:
                    self._stdin_gone(child)
                else:
                    child.stdin_buf += payload
                    self._write_stdin(child)
        elif ftype == T_STDIN_CLOSE:
            child = conn.children.get(channel)
            if child is not None and child.in_fd >= 0:
                child.stdin_close = True
                self._write_stdin(child)
        elif ftype == T_SIGNAL:
            child = conn.children.get(channel)
            req = json.loads(payload)
            sig = int(req["signal"])
            bound = req.get("sweepSeconds")
            if bound is not None:
                bound = float(bound)
                if not 0.0 <= bound <= 600.0:  # (NaN too)
                    raise ValueError("sweepSeconds must be 0..600")
            if child is not None and req.get("foreground") is True:
                self._signal_foreground(child, sig)
            elif child is not None and req.get("everywhere") is True:
                with contextlib.suppress(OSError):
                    os.killpg(child.pid, sig)
                _signal_marked((child.mark,), sig, skip_group=child.pid, windows=self.windows)
            elif child is not None:
                if bound is not None:
                    child.sweep_seconds = bound
                self._kill_child(child, sig)
        elif ftype == T_RESIZE:
            child = conn.children.get(channel)
            if child is not None and child.pty_fd >= 0:
                cols, rows = _window(json.loads(payload))
                with contextlib.suppress(OSError):  # the terminal is going away
                    _set_window(child.pty_fd, cols, rows)
        else:
            raise ValueError(f"unknown frame type {ftype}")

    def _spawn(
        self, conn: Conn, channel: int, req: dict[str, Any], script: bytearray | None
    ) -> None:
        argv = [str(a) for a in req["argv"]]
        if not argv or any("\0" in a for a in argv):
            raise ValueError("bad argv")
        if req.get("mark") is not None:
            mark = _valid_mark(req["mark"])
        else:
            self.spawned += 1
            mark = f"{self.instance}.{self.spawned}".encode()
        env = dict(self.base_env)
        for k in req.get("unset") or ():
            env.pop(str(k), None)
        for k, v in dict(req.get("env") or {}).items():
            env[str(k)] = str(v)
        env.pop(MARK_NAME, None)
        env = {MARK_NAME: mark.decode(), **env}  # first: a known place in the command itself
        cwd = os.path.join(self.workspace, str(req.get("cwd") or "."))
        want_stdin = bool(req.get("stdin"))
        # One pipe for both streams keeps their true relative order.
        combined = bool(req.get("combined"))
        script_fd = req.get("scriptFd")
        if script_fd is not None and (type(script_fd) is not int or not 3 <= script_fd <= 9):
            raise ValueError("scriptFd must be 3..9")
        window = _window(req["pty"]) if req.get("pty") is not None else None
        if window is not None:
            env.setdefault("TERM", DEFAULT_TERM)

        fds: list[int] = []  # ours to close once the child has its copies
        pty_fd = -1
        try:
            if window is not None:
                pty_fd, tty = os.openpty()
                fds += [pty_fd, tty]
                _set_window(pty_fd, *window)
                # Opened by the child after setsid (posix_spawn's order), without
                # O_NOCTTY: the terminal becomes its controlling terminal.
                actions: list[tuple[Any, ...]] = [
                    (os.POSIX_SPAWN_OPEN, 0, os.ttyname(tty), os.O_RDWR, 0),
                    (os.POSIX_SPAWN_DUP2, 0, 1),
                    (os.POSIX_SPAWN_DUP2, 0, 2),
                ]
                # The master is read for output and written for input; the
                # input side is a second descriptor so that each closes alone.
                out_r, err_r, in_w = pty_fd, -1, os.dup(pty_fd)
                fds.append(in_w)
            else:
                out_r, err_r, in_w, actions = self._pipes(fds, want_stdin, combined)
            if script_fd is not None:
                sfd = _script_file(bytes(script or b""))
                fds.append(sfd)
                # Last, so that no pipe dup above can overwrite it.
                actions.append((os.POSIX_SPAWN_DUP2, sfd, script_fd))
            # Single-threaded, so changing our own cwd around the spawn is the
            # portable way to give the child a cwd (posix_spawn has no chdir).
            os.chdir(cwd)
            try:
                pid = os.posix_spawnp(
                    argv[0],
                    argv,
                    env,
                    file_actions=actions,
                    setsid=True,
                    setsigdef=_RESET_SIGNALS,
                    setsigmask=(),
                )
            finally:
                os.chdir(self.workspace)
        except (OSError, ValueError, TypeError) as exc:  # ValueError: NUL in argv/env
            for fd in fds:
                os.close(fd)
            self._send_json(
                conn,
                T_SPAWN_FAILED,
                channel,
                {"errno": getattr(exc, "errno", 0) or 0, "message": f"{_reason(exc)}: {argv[0]}"},
            )
            return
        for fd in fds:
            if fd not in (out_r, err_r, in_w):
                os.close(fd)  # the child's ends (and the script: the child holds it now)
        child = Child(conn, channel, pid, mark)
        child.pty_fd = pty_fd
        if self.windows is not None:
            self.windows.opened(mark, _start_ticks(str(pid)) or _now_ticks())
        child.out_fd = out_r
        child.err_fd = err_r
        for fd, ftype in ((out_r, T_STDOUT), (err_r, T_STDERR)):
            if fd >= 0:
                _set_nonblocking(fd)
                self.by_fd[fd] = (child, ftype)
                self.sel.register(fd, selectors.EVENT_READ, "pipe")
        if in_w >= 0:
            _set_nonblocking(in_w)
            child.in_fd = in_w
        conn.children[channel] = child
        self.by_pid[pid] = child
        self._send_json(conn, T_STARTED, channel, {"pid": pid, "startedAt": child.start_time})

    @staticmethod
    def _pipes(
        fds: list[int], want_stdin: bool, combined: bool
    ) -> tuple[int, int, int, list[tuple[Any, ...]]]:
        """A command's pipes: our ends (stdout, stderr, stdin; -1 when there is
        none) and the file actions that give the child its ends. Every
        descriptor made goes into `fds` (the caller closes the child's ends)."""
        out_r, out_w = os.pipe()
        fds += [out_r, out_w]
        err_r, err_w = (-1, out_w) if combined else os.pipe()
        if not combined:
            fds += [err_r, err_w]
        if STDOUT_PIPE_SIZE > 65536:
            with contextlib.suppress(OSError):  # else keep the default size
                fcntl.fcntl(out_r, F_SETPIPE_SZ, STDOUT_PIPE_SIZE)
        in_r = in_w = -1
        if want_stdin:
            in_r, in_w = os.pipe()
            fds += [in_r, in_w]
            actions: list[tuple[Any, ...]] = [(os.POSIX_SPAWN_DUP2, in_r, 0)]
        else:
            actions = [(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0)]
        actions += [(os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)]
        return out_r, err_r, in_w, actions

    def _signal_foreground(self, child: Child, sig: int) -> None:
        """What a key (Ctrl-C, Ctrl-Z, Ctrl-\\) would do: signal the terminal's
        foreground process group, not the shell that owns the terminal."""
        if child.pty_fd < 0 or child.status is not None:
            return
        with contextlib.suppress(OSError):
            os.killpg(os.tcgetpgrp(child.pty_fd), sig)

    def _write_stdin(self, child: Child) -> None:
        fd = child.in_fd
        if fd < 0:
            return
        while child.stdin_buf:
            try:
                n = os.write(fd, child.stdin_buf)
            except BlockingIOError:
                break
            except OSError:
                # EPIPE: the command closed its stdin; drop what is left.
                self._stdin_gone(child)
                return
            del child.stdin_buf[:n]
        want_write = bool(child.stdin_buf)
        registered = fd in self.by_fd
        if want_write and not registered:
            self.by_fd[fd] = (child, 0)
            self.sel.register(fd, selectors.EVENT_WRITE, "pipe")
        elif not want_write and registered:
            self.sel.unregister(fd)
            del self.by_fd[fd]
        if not want_write and child.stdin_close:
            os.close(fd)
            child.in_fd = -1

    def _stdin_gone(self, child: Child) -> None:
        child.stdin_buf.clear()
        child.stdin_close = True
        fd = child.in_fd
        if fd >= 0:
            if self.by_fd.pop(fd, None) is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self.sel.unregister(fd)
            os.close(fd)
            child.in_fd = -1
        self._send(child.conn, T_STDIN_CLOSED, child.channel, b"")

    # -- children ----------------------------------------------------------

    def _pipe_event(self, fd: int) -> bool:
        """Handle a ready pipe; True if output was read (and more may follow)."""
        entry = self.by_fd.get(fd)
        if entry is None:
            return False
        child, ftype = entry
        if ftype == 0:
            self._write_stdin(child)
            return False
        try:
            data = os.read(fd, READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if data:
            self._send(child.conn, ftype, child.channel, data)
            # Not for a terminal: its output is an echo someone is waiting for.
            if LINGER and len(data) < READ_CHUNK and child.status is None and child.pty_fd < 0:
                # Let a busy writer fill the (large) pipe for a moment before we
                # wake for it again: a burst becomes a few big frames instead of
                # dozens of small ones, at the cost of <= LINGER of latency.
                self._unwatch(fd)
                self.lingering[fd] = time.monotonic() + LINGER
            return True
        self._close_fd(fd)
        if ftype == T_STDOUT:
            child.out_fd = -1
            child.pty_fd = -1  # the same descriptor, for a terminal
        else:
            child.err_fd = -1
        self._maybe_finish(child)
        return False

    def _drain(self, fd: int) -> None:
        """Read everything a pipe holds right now (the command has exited)."""
        self.lingering.pop(fd, None)
        while fd in self.by_fd and self._pipe_event(fd):
            pass
        if fd in self.by_fd:
            self._watch(fd)

    def _watch(self, fd: int) -> None:
        if fd not in self.sel.get_map():
            self.sel.register(fd, selectors.EVENT_READ, "pipe")

    def _unwatch(self, fd: int) -> None:
        if fd in self.sel.get_map():
            self.sel.unregister(fd)

    def _check_lingering(self) -> None:
        if not self.lingering:
            return
        now = time.monotonic()
        for fd, deadline in list(self.lingering.items()):
            if deadline <= now:
                del self.lingering[fd]
                entry = self.by_fd.get(fd)
                if entry is None:
                    continue
                conn = entry[0].conn
                if conn is not None and len(conn.wbuf) > WBUF_HIGH:
                    continue  # backpressure: _set_output_paused re-arms it later
                self._watch(fd)
                self._pipe_event(fd)

    def _close_fd(self, fd: int) -> None:
        if fd < 0:
            return
        self.lingering.pop(fd, None)
        if self.by_fd.pop(fd, None) is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(fd)
        os.close(fd)

    def _close_child_fds(self, child: Child) -> None:
        for fd in (child.out_fd, child.err_fd, child.in_fd):
            self._close_fd(fd)
        child.out_fd = child.err_fd = child.in_fd = child.pty_fd = -1

    def _reap(self) -> None:
        while True:
            try:
                pid, status, rusage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            child = self.by_pid.pop(pid, None)
            if child is None:
                continue  # an orphan re-parented to us: reaping it is all we owe it
            child.status = status
            child.rusage = rusage
            child.exit_time = time.time()
            if child.in_fd >= 0:
                self._close_fd(child.in_fd)
                child.in_fd = -1
            for fd in (child.out_fd, child.err_fd):
                if fd >= 0:
                    self._drain(fd)
            self._maybe_finish(child)

    def _maybe_finish(self, child: Child) -> None:
        if child.status is None:
            return
        if child.ending and not child.swept:
            self._start_sweep(child)  # the command's end takes its processes along
        if child.sweep is not None:
            return  # reported once none of its processes is left (or the bound passed)
        if child.out_fd >= 0 or child.err_fd >= 0:
            if not child.drain_deadline:
                child.drain_deadline = time.monotonic() + DRAIN_GRACE
            return
        if self.windows is not None:
            self.windows.closed(child.mark)
        self._finish(child)

    def _check_drain_deadlines(self) -> None:
        now = time.monotonic()
        for child in self._pending_children():
            if child.drain_deadline and child.drain_deadline <= now:
                # Drain what is already buffered, then give up on the holders.
                for fd in (child.out_fd, child.err_fd):
                    if fd >= 0:
                        self._drain(fd)
                self._close_child_fds(child)
                child.drain_deadline = 0.0
                self._maybe_finish(child)

    def _finish(self, child: Child) -> None:
        conn = child.conn
        status = child.status
        if conn is None or status is None:
            return
        child.conn = None  # report exactly once
        child.drain_deadline = 0.0
        conn.children.pop(child.channel, None)
        ru = child.rusage
        msg: dict[str, Any] = {
            "pid": child.pid,
            "exitedAt": child.exit_time,
            "userSeconds": ru.ru_utime if ru else 0.0,
            "systemSeconds": ru.ru_stime if ru else 0.0,
            "maxRssKiB": ru.ru_maxrss if ru else 0,
        }
        if child.survivors:
            msg["survivors"] = child.survivors  # the kill is not confirmed
        if os.WIFSIGNALED(status):
            msg["signal"] = os.WTERMSIG(status)
            msg["coreDumped"] = os.WCOREDUMP(status)
        else:
            msg["exitCode"] = os.WEXITSTATUS(status)
        self._send_json(conn, T_EXIT, child.channel, msg)


def _window(req: Any) -> tuple[int, int]:
    """(cols, rows) of a terminal's window, checked."""
    cols, rows = req.get("cols"), req.get("rows")
    for v in (cols, rows):
        if type(v) is not int or not 1 <= v <= MAX_WINDOW:
            raise ValueError(f"a terminal's cols and rows must be 1..{MAX_WINDOW}")
    return cols, rows


def _set_window(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _script_file(script: bytes) -> int:
    """An unnamed file holding ``script``, read from the start, close-on-exec.

    A memfd lives in memory and vanishes with its last descriptor; where there
    is none (old kernels, other systems) an unlinked temporary file serves.
    The shell opens it again as /dev/fd/N, which starts at offset 0 either way.
    """
    try:
        fd = os.memfd_create("sandbox-script", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        fd, path = tempfile.mkstemp(prefix="sandbox-script-")  # not inheritable
        os.unlink(path)
    try:
        view = memoryview(script)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


def _tune_malloc() -> None:
    """Reuse freed output buffers instead of page-faulting fresh ones (see the agent)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def _set_subreaper() -> None:
    """Adopt orphans even when we are not PID 1 (tests, debug shells)."""
    if os.getpid() == 1 or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    sock_path = os.environ.get("SANDBOX_RUNNER_SOCKET") or os.path.join(here, "runner.sock")
    workspace = os.path.abspath(os.environ.get("SANDBOX_RUNNER_WORKSPACE") or os.getcwd())
    try:
        mode = int(os.environ.get("SANDBOX_RUNNER_SOCKET_MODE", "0660"), 8)
        umask = int(os.environ.get("SANDBOX_RUNNER_UMASK", "0002"), 8)
    except ValueError:
        _log("SANDBOX_RUNNER_SOCKET_MODE and SANDBOX_RUNNER_UMASK must be octal")
        return 2
    # Group-writable files by default: the agent (another UID in the same
    # group) edits what user commands create.
    os.umask(umask)
    _set_subreaper()
    _tune_malloc()
    try:
        os.chdir(workspace)
        runner = Runner(sock_path, workspace, mode)
    except OSError as exc:
        _log(f"cannot start: {exc}")
        return 1
    _log(f"{__version__} listening on {sock_path} (workspace {workspace})")
    try:
        return runner.serve()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(sock_path)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # pragma: no cover - SIGINT before handlers exist
        sys.exit(130)
    except OSError as exc:  # pragma: no cover
        if exc.errno == errno.EADDRINUSE:
            _log("socket in use")
        raise
