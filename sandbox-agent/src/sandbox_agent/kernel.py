#!/usr/bin/env python3
"""Code-context bridge: one Jupyter kernel, driven for the agent over stdin/stdout.

The agent starts this file through the runner, inside the sandbox container
(with the image's own python3), once per code context. It starts an
IPython kernel with ``jupyter_client`` and turns the agent's requests into
Jupyter messages and the kernel's messages into one JSON object per line.

Constraints that shape this file:
- it runs in the user's image: stdlib plus ``jupyter_client`` and
  ``ipykernel`` (an image without them gets ``unavailable`` and exit 3),
  Python >= 3.9 syntax, jupyter_client 7 and 8.
- the agent reads what comes out of here as untrusted input; this file only
  has to be useful to an honest agent.
- the kernel's own stdout and stderr never reach this process's stdout (the
  protocol channel): the kernel forwards its output as messages, and what
  bypasses that goes to a log file.

In (one JSON object per line on stdin):
  {"op": "execute", "id": str, "code": str, "env"?: {str: str}}
                                              one at a time; env: for that run only
  {"op": "interrupt", "id": str}              SIGINT to the kernel, once it runs that
Out (one JSON object per line on stdout):
  {"type": "ready", "language": "python", "languageVersion": ...}
  {"type": "unavailable", "message": str}     then exit 3
  {"id", "type": "stdout"|"stderr", "text"}
  {"id", "type": "result", "data": {mime: value}, "metadata": {}, "isMain": bool,
   "executionCount": int|null}
  {"id", "type": "error", "name", "value", "traceback": [str]}
  {"id", "type": "finished", "status": "ok"|"error"|"aborted", "executionCount"}
  {"type": "died", "message": str}            the kernel ended; then exit 4
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from typing import Any

# How long the kernel may take to start (an import of IPython under gVisor on a
# busy node takes seconds).
START_TIMEOUT = 120.0
# How often a wait for the kernel's messages looks whether the kernel still lives.
POLL = 0.5
# Output (stream text and display data) is held while the kernel keeps
# producing it and sent on, in one write, when the kernel pauses this long,
# when COALESCE bytes are pending, or with the run's end: the value of a short
# cell and its `finished` leave together, one pass through the agent instead
# of two. Text goes in lines of at most CHUNK characters (the agent bounds a line).
PAUSE = 0.02
COALESCE = 64 << 10
CHUNK = 1 << 20
# The kernel sends a run's reply before it says it is idle; a reply that has
# not come this long after is lost: an interrupt that reached the kernel
# between two cells is caught there ("KeyboardInterrupt caught in kernel"),
# and the request it was starting has no reply. The run ends then, and the
# kernel with its state stays (the agent would start it again after its own
# grace).
REPLY_AFTER_IDLE = 1.0
# SIGINT can also land where the kernel says neither reply nor idle. So once
# an interrupt had this long to act, the bridge sends a later request: the
# kernel answers requests in order, so its answer means the run is over. (A
# cell deaf to SIGINT still runs: the answer waits, and the agent decides.)
PROBE_AFTER = 0.5
# Where Jupyter's wire format puts the identities' end.
DELIM = b"<IDS|MSG>"

STDIN = 0


def emit(obj: dict[str, Any]) -> None:
    _write([obj])


def _write(objs: list[dict[str, Any]]) -> None:
    out = b"".join(
        (json.dumps(o, separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8", "replace")
        for o in objs
    )
    view = memoryview(out)
    while view:  # stdout is a blocking pipe: a full one waits for the agent
        view = view[os.write(1, view) :]


def _scratch() -> str:
    """Kernel connection files, IPython's history and matplotlib's cache live
    outside the workspace (the user's data, which snapshots carry)."""
    return tempfile.mkdtemp(prefix="sandbox-context-")  # private: 0700, a new name


class Wire:
    """The kernel's shell and IOPub sockets, spoken to directly with pyzmq.

    Not jupyter_client's blocking client: in jupyter_client 7 (Debian 12's)
    each of its calls runs an asyncio loop, which cost more CPU per run than
    the agent, the runner and the gateway together. Here one thread polls the
    two sockets and the agent's pipe.
    """

    def __init__(self, km: Any) -> None:
        import zmq

        self.zmq = zmq
        self.session = km.session
        self.shell = km.connect_shell()
        self.iopub = km.connect_iopub()
        self.poller = zmq.Poller()
        self.poller.register(self.shell, zmq.POLLIN)
        self.poller.register(self.iopub, zmq.POLLIN)
        self.poller.register(STDIN, zmq.POLLIN)
        self.stdin_open = True

    def send(self, msg_type: str, content: dict[str, Any]) -> str:
        return str(self.session.send(self.shell, msg_type, content)["header"]["msg_id"])

    def poll(self, seconds: float) -> tuple[bool, bool, bool]:
        """Which of shell, IOPub and stdin have something, within `seconds`."""
        ready = dict(self.poller.poll(int(max(seconds, 0.0) * 1000)))
        return self.shell in ready, self.iopub in ready, STDIN in ready

    def recv(self, sock: Any) -> tuple[str, str, dict[str, Any]] | None:
        """(msg_type, parent msg_id, content) of one waiting message,
        None for one that is not well-formed or not signed with the session's key."""
        frames = sock.recv_multipart(self.zmq.NOBLOCK)
        try:
            at = frames.index(DELIM)
            sig, parts = frames[at + 1], frames[at + 2 : at + 6]
        except ValueError:
            return None
        if len(parts) != 4:
            return None
        if self.session.auth is not None and not hmac.compare_digest(sig, self.session.sign(parts)):
            return None
        try:
            header, parent, content = (json.loads(parts[i]) for i in (0, 1, 3))
        except ValueError:
            return None
        if not all(isinstance(x, dict) for x in (header, parent, content)):
            return None
        return str(header.get("msg_type", "")), str(parent.get("msg_id", "")), content

    def drain(self, sock: Any) -> None:
        while sock.poll(0):
            sock.recv_multipart()

    def close(self) -> None:
        self.shell.close(linger=0)
        self.iopub.close(linger=0)


def wait_ready(km: Any, wire: Wire, timeout: float) -> None:
    """The kernel answers on its shell socket and our IOPub subscription is in
    place (a SUB socket drops what is published before it joins)."""
    deadline = time.monotonic() + timeout
    asked = wire.send("kernel_info_request", {})
    while True:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no answer in {timeout:g}s")
        # The sockets alone: nothing the agent says matters before `ready`.
        if wire.shell.poll(int(POLL * 1000)):
            msg = wire.recv(wire.shell)
            if msg is not None and msg[0] == "kernel_info_reply" and msg[1] == asked:
                break
        elif not km.is_alive():
            raise RuntimeError(_died(km))
    while True:
        if time.monotonic() > deadline:
            raise RuntimeError(f"IOPub said nothing in {timeout:g}s")
        wire.send("kernel_info_request", {})  # its busy/idle come on IOPub
        if wire.iopub.poll(200):
            break
    time.sleep(0.05)  # the status messages of the last request
    wire.drain(wire.iopub)
    wire.drain(wire.shell)


class Bridge:
    def __init__(self, km: Any, wire: Wire) -> None:
        self.km = km
        self.wire = wire
        self.inbuf = b""
        self.ops: deque[dict[str, Any]] = deque()
        # An interrupt names its run. The kernel only turns SIGINT into
        # KeyboardInterrupt while it executes, so one that comes before the
        # kernel said it is busy with that run waits until it does, and one
        # for a run the kernel already finished is not sent.
        self.busy = False
        self.interrupts = set()  # type: set[str]
        self.interrupted_at: float | None = None  # when the current run got SIGINT

    # -- the agent's side ---------------------------------------------------------

    def read_stdin(self) -> None:
        """Requests from the agent: runs queued, interrupts noted."""
        data = os.read(STDIN, 1 << 20)
        if not data:  # the agent went away
            self.wire.poller.unregister(STDIN)
            self.wire.stdin_open = False
            return
        *lines, self.inbuf = (self.inbuf + data).split(b"\n")
        for raw in lines:
            try:
                op = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(op, dict):
                continue
            if op.get("op") == "interrupt":
                self.interrupts.add(str(op.get("id", "")))  # acted on in execute()
            else:
                self.ops.append(op)

    def interrupt(self) -> None:
        self.interrupted_at = time.monotonic()
        try:
            self.km.interrupt_kernel()
        except Exception as exc:  # a dead kernel: the execute loop says so
            sys.stderr.write(f"interrupt failed: {exc}\n")

    def run(self) -> int:
        while True:
            while not self.ops:
                if not self.wire.stdin_open:
                    return 0
                shell, iopub, stdin = self.wire.poll(POLL)
                if stdin:
                    self.read_stdin()
                # What a background thread of an earlier run prints goes nowhere.
                if iopub:
                    self.wire.drain(self.wire.iopub)
                if shell:
                    self.wire.drain(self.wire.shell)
            op = self.ops.popleft()
            if op.get("op") == "execute" and isinstance(op.get("code"), str):
                rid = str(op.get("id", ""))
                env = _env(op.get("env"))
                self.busy = False
                if env:
                    self.silent(ENV_SET % (env,))
                alive = self.execute(rid, op["code"])
                self.busy = False
                self.interrupts.discard(rid)
                if alive and env:
                    alive = self.silent(ENV_RESTORE)
                if not alive:
                    return 4

    # -- the kernel's side --------------------------------------------------------

    def alive(self) -> bool:
        try:
            return bool(self.km.is_alive())
        except Exception:
            return False

    def silent(self, code: str) -> bool:
        """Run code the user does not see (no output, no history, no execution
        count) and wait for its end; False when the kernel died."""
        msg_id = self.wire.send("execute_request", _execute(code, silent=True, store_history=False))
        while True:
            shell, iopub, stdin = self.wire.poll(POLL)
            if stdin:
                self.read_stdin()
            if iopub:
                self.wire.drain(self.wire.iopub)
            if shell:
                msg = self.wire.recv(self.wire.shell)
                if msg is not None and msg[1] == msg_id:
                    return True
            elif not (iopub or stdin) and not self.alive():
                return False

    def execute(self, rid: str, code: str) -> bool:
        """Run one cell and report it; False when the kernel died under it."""
        msg_id = self.wire.send("execute_request", _execute(code, silent=False, store_history=True))
        cell = Cell(rid, msg_id)
        self.interrupted_at = None
        probe = None  # a later request, sent once an interrupt had time to act
        while True:
            now = time.monotonic()
            if cell.over_at is not None and (
                cell.status is not None or now - cell.over_at > REPLY_AFTER_IDLE
            ):
                break
            interrupted = self.interrupted_at
            if probe is None and interrupted is not None and now - interrupted > PROBE_AFTER:
                probe = self.wire.send("kernel_info_request", {})
            shell, iopub, stdin = self.wire.poll(
                cell.wait(now, None if probe else self.interrupted_at)
            )
            if stdin:
                self.read_stdin()
            if shell:
                msg = self.wire.recv(self.wire.shell)
                if msg is not None and msg[1] == msg_id and msg[0] == "execute_reply":
                    cell.status = str(msg[2].get("status", "ok"))
                    cell.count = msg[2].get("execution_count", cell.count)
                elif msg is not None and probe is not None and msg[1] == probe:
                    # The kernel answered a request sent after this one: this
                    # one is over, idle said or not (see REPLY_AFTER_IDLE).
                    while self.wire.iopub.poll(0):
                        self.take(cell, self.wire.recv(self.wire.iopub))
                    cell.over_at = cell.over_at or now
                    cell.status = cell.status or "error"
            if iopub:
                self.take(cell, self.wire.recv(self.wire.iopub))
            if rid in self.interrupts and self.busy and self.interrupted_at is None:
                # SIGINT outside a cell can end the kernel (its loop does not
                # catch it): not when what it already said shows the run over.
                while self.wire.iopub.poll(0):
                    self.take(cell, self.wire.recv(self.wire.iopub))
                if cell.over_at is None and cell.status is None:
                    self.interrupt()
            if not (shell or iopub or stdin):
                cell.out.flush()
                if cell.over_at is None and not self.alive():
                    # First: the agent ends the run with the reason.
                    emit({"type": "died", "message": _died(self.km)})
                    emit({"id": rid, "type": "finished", "status": "error", "executionCount": None})
                    return False
        if cell.status is None:  # see REPLY_AFTER_IDLE
            cell.status = "error" if rid in self.interrupts else "ok"
        cell.out.add(
            {"id": rid, "type": "finished", "status": cell.status, "executionCount": cell.count}, 0
        )
        cell.out.flush()
        return True

    def take(self, cell: Cell, msg: tuple[str, str, dict[str, Any]] | None) -> None:
        """One IOPub message: the cell's output, its count, its start and end."""
        if msg is None or msg[1] != cell.msg_id:
            return
        kind, _, content = msg
        out = cell.out
        if kind == "stream":
            name = "stderr" if content.get("name") == "stderr" else "stdout"
            out.text(name, str(content.get("text", "")))
        elif kind in ("execute_result", "display_data", "update_display_data"):
            main = kind == "execute_result"
            if main:
                cell.count = content.get("execution_count")
            data = content.get("data")
            out.add(
                {
                    "id": cell.rid,
                    "type": "result",
                    "data": data if isinstance(data, dict) else {},
                    "metadata": content.get("metadata") or {},
                    "isMain": main,
                    "executionCount": cell.count if main else None,
                },
                sum(len(str(v)) for v in data.values()) if isinstance(data, dict) else 0,
            )
        elif kind == "error":
            out.add(
                {
                    "id": cell.rid,
                    "type": "error",
                    "name": str(content.get("ename", "")),
                    "value": str(content.get("evalue", "")),
                    "traceback": [str(t) for t in content.get("traceback") or []],
                },
                0,
            )
        elif kind == "execute_input":
            cell.count = content.get("execution_count")
        elif kind == "status" and content.get("execution_state") == "busy":
            self.busy = True
        elif kind == "status" and content.get("execution_state") == "idle":
            cell.over_at = time.monotonic()


class Cell:
    """A run's state while the kernel executes it."""

    def __init__(self, rid: str, msg_id: str) -> None:
        self.rid = rid
        self.msg_id = msg_id
        self.out = Output(rid)
        self.count: Any = None
        self.status: str | None = None  # from the execute reply
        self.over_at: float | None = None  # idle said, or a later request answered

    def wait(self, now: float, interrupted_at: float | None) -> float:
        """How long the next poll may wait: until output is due, the reply is
        given up on, or the interrupt is probed."""
        wait = PAUSE if self.out.events else POLL
        if self.over_at is not None:
            wait = min(wait, self.over_at + REPLY_AFTER_IDLE - now)
        if interrupted_at is not None:
            wait = min(wait, interrupted_at + PROBE_AFTER - now)
        return max(wait, 0.0)


class Output:
    """A run's events not yet written, in order; a stream's consecutive pieces
    of text are joined."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.events: list[dict[str, Any]] = []
        self.size = 0

    def text(self, stream: str, text: str) -> None:
        last = self.events[-1] if self.events else None
        if last is not None and last["type"] == stream and len(last["text"]) + len(text) <= CHUNK:
            last["text"] += text
        else:
            for at in range(0, len(text), CHUNK):  # the kernel's may be huge
                self.events.append({"id": self.rid, "type": stream, "text": text[at : at + CHUNK]})
        self.size += len(text)
        if self.size >= COALESCE:
            self.flush()

    def add(self, event: dict[str, Any], size: int) -> None:
        self.events.append(event)
        self.size += size
        if self.size >= COALESCE:
            self.flush()

    def flush(self) -> None:
        if self.events:
            _write(self.events)
            self.events, self.size = [], 0


def _execute(code: str, silent: bool, store_history: bool) -> dict[str, Any]:
    return {
        "code": code,
        "silent": silent,
        "store_history": store_history,
        "user_expressions": {},
        "allow_stdin": False,
        "stop_on_error": False,
    }


# A run's variables (op "env"): set in the kernel's os.environ before the run,
# keeping the values they had on the os module, and put back after it. Both run
# silently, so the run's execution count is the kernel's own.
ENV_SET = (
    "(lambda os, env: (setattr(os, '_sandbox_saved_env', "
    "{k: os.environ.get(k) for k in env}), os.environ.update(env)))(__import__('os'), %r)"
)
ENV_RESTORE = (
    "(lambda os: [os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v) "
    "for k, v in os.__dict__.pop('_sandbox_saved_env', {}).items()])(__import__('os'))"
)


def _env(value: Any) -> dict[str, str]:
    """A run's variables, if they are a mapping of strings (the agent checked them)."""
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}


def _died(km: Any) -> str:
    code = None
    with contextlib.suppress(Exception):
        code = km.provisioner.process.returncode  # jupyter_client 7.1+
    if code is not None and code < 0:
        return f"the kernel was killed by signal {-code} (out of memory?)"
    return f"the kernel ended (exit status {code})"


def main() -> int:
    scratch = _scratch()
    for name, sub in (
        ("JUPYTER_RUNTIME_DIR", "runtime"),
        ("IPYTHONDIR", "ipython"),
        ("MPLCONFIGDIR", "matplotlib"),
        ("JUPYTER_DATA_DIR", "data"),
    ):
        os.environ.setdefault(name, os.path.join(scratch, sub))
    try:
        from jupyter_client.manager import KernelManager
    except ImportError as exc:
        emit(
            {
                "type": "unavailable",
                "message": f"this image's python3 ({sys.version.split()[0]}) cannot start a "
                f"Jupyter kernel: {exc}; install jupyter_client and ipykernel in the image",
            }
        )
        return 3
    log = open(os.path.join(scratch, "kernel.log"), "ab")  # noqa: SIM115 (the kernel's life)
    # Unix sockets in the private scratch directory, not TCP ports that any
    # process of the sandbox could reach.
    km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(scratch, "kernel"))
    wire = None
    try:
        km.start_kernel(cwd=os.getcwd(), stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        wire = Wire(km)
        wait_ready(km, wire, START_TIMEOUT)
    except Exception as exc:
        emit({"type": "unavailable", "message": f"the Python kernel did not start: {exc}"})
        with contextlib.suppress(Exception):
            km.shutdown_kernel(now=True)
        return 3
    emit(
        {
            "type": "ready",
            "language": "python",
            "languageVersion": ".".join(str(v) for v in sys.version_info[:3]),
        }
    )
    try:
        return Bridge(km, wire).run()
    finally:
        with contextlib.suppress(Exception):
            wire.close()
            km.shutdown_kernel(now=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
