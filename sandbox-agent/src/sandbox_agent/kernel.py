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
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any

# How long the kernel may take to start (an import of IPython under gVisor on a
# busy node takes seconds).
START_TIMEOUT = 120.0
# How often a wait for the kernel's messages looks whether the kernel still lives.
POLL = 0.5
# Stream text is sent on when this much is pending or the kernel pauses, in
# lines of at most CHUNK characters (the agent bounds a line).
COALESCE = 64 << 10
CHUNK = 1 << 20

_out_lock = threading.Lock()


def emit(obj: dict[str, Any]) -> None:
    line = json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n"
    with _out_lock:
        sys.stdout.buffer.write(line.encode("utf-8", "replace"))
        sys.stdout.buffer.flush()


def _scratch() -> str:
    """Kernel connection files, IPython's history and matplotlib's cache live
    outside the workspace (the user's data, which snapshots carry)."""
    return tempfile.mkdtemp(prefix="sandbox-context-")  # private: 0700, a new name


class Bridge:
    def __init__(self, km: Any, kc: Any) -> None:
        self.km = km
        self.kc = kc
        self.ops: queue.Queue[dict[str, Any] | None] = queue.Queue()
        # An interrupt names its run. The kernel only turns SIGINT into
        # KeyboardInterrupt while it executes, so one that comes before the
        # kernel said it is busy with that run waits until it does.
        self.lock = threading.Lock()
        self.current = ""
        self.busy = False
        self.interrupts = set()  # type: set[str]

    def read_stdin(self) -> None:
        """Requests from the agent; an interrupt acts at once on its run."""
        for raw in sys.stdin.buffer:
            try:
                op = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(op, dict):
                continue
            if op.get("op") == "interrupt":
                with self.lock:
                    rid = str(op.get("id", ""))
                    self.interrupts.add(rid)
                    if rid == self.current and self.busy:
                        self.interrupt()
            else:
                self.ops.put(op)
        self.ops.put(None)  # the agent went away

    def interrupt(self) -> None:
        try:
            self.km.interrupt_kernel()
        except Exception as exc:  # a dead kernel: the execute loop says so
            sys.stderr.write(f"interrupt failed: {exc}\n")

    def began(self, rid: str) -> None:
        with self.lock:
            self.busy = True
            if rid in self.interrupts:
                self.interrupt()

    def run(self) -> int:
        threading.Thread(target=self.read_stdin, daemon=True).start()
        while True:
            op = self.ops.get()
            if op is None:
                return 0
            if op.get("op") == "execute" and isinstance(op.get("code"), str):
                rid = str(op.get("id", ""))
                env = _env(op.get("env"))
                with self.lock:
                    self.current, self.busy = rid, False
                if env:
                    self.silent(ENV_SET % (env,))
                alive = self.execute(rid, op["code"])
                with self.lock:
                    self.current, self.busy = "", False
                    self.interrupts.discard(rid)
                if alive and env:
                    alive = self.silent(ENV_RESTORE)
                if not alive:
                    return 4

    def silent(self, code: str) -> bool:
        """Run code the user does not see (no output, no history, no execution
        count) and wait for its end; False when the kernel died."""
        msg_id = self.kc.execute(code, silent=True, store_history=False, allow_stdin=False)
        while True:
            try:
                reply = self.kc.get_shell_msg(timeout=POLL)
            except queue.Empty:
                if not self.alive():
                    return False
                continue
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                return True

    def alive(self) -> bool:
        try:
            return bool(self.km.is_alive())
        except Exception:
            return False

    def execute(self, rid: str, code: str) -> bool:
        """Run one cell and report it; False when the kernel died under it."""
        msg_id = self.kc.execute(code, store_history=True, allow_stdin=False, stop_on_error=False)
        pending = {"stdout": [], "stderr": []}  # type: dict[str, list[str]]
        sizes = {"stdout": 0, "stderr": 0}

        def flush(name: str | None = None) -> None:
            for stream in (name,) if name else ("stdout", "stderr"):
                if pending[stream]:
                    text = "".join(pending[stream])
                    for at in range(0, len(text), CHUNK):  # the kernel's may be huge
                        emit({"id": rid, "type": stream, "text": text[at : at + CHUNK]})
                    pending[stream], sizes[stream] = [], 0

        count = None
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=POLL)
            except queue.Empty:
                flush()
                if not self.alive():
                    # First: the agent ends the run with the reason.
                    emit({"type": "died", "message": _died(self.km)})
                    emit({"id": rid, "type": "finished", "status": "error", "executionCount": None})
                    return False
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = msg.get("msg_type")
            content = msg.get("content") or {}
            if kind == "stream":
                stream = "stderr" if content.get("name") == "stderr" else "stdout"
                other = "stdout" if stream == "stderr" else "stderr"
                flush(other)  # keep the order between the two streams
                text = str(content.get("text", ""))
                pending[stream].append(text)
                sizes[stream] += len(text)
                if sizes[stream] >= COALESCE:
                    flush(stream)
                continue
            flush()
            if kind in ("execute_result", "display_data", "update_display_data"):
                main = kind == "execute_result"
                if main:
                    count = content.get("execution_count")
                emit(
                    {
                        "id": rid,
                        "type": "result",
                        "data": content.get("data") or {},
                        "metadata": content.get("metadata") or {},
                        "isMain": main,
                        "executionCount": count if main else None,
                    }
                )
            elif kind == "error":
                emit(
                    {
                        "id": rid,
                        "type": "error",
                        "name": str(content.get("ename", "")),
                        "value": str(content.get("evalue", "")),
                        "traceback": [str(t) for t in content.get("traceback") or []],
                    }
                )
            elif kind == "execute_input":
                count = content.get("execution_count")
            elif kind == "status" and content.get("execution_state") == "busy":
                self.began(rid)
            elif kind == "status" and content.get("execution_state") == "idle":
                break
        status = "ok"
        try:
            while True:  # replies to earlier requests (kernel_info) come first
                reply = self.kc.get_shell_msg(timeout=5)
                if reply.get("parent_header", {}).get("msg_id") == msg_id:
                    status = str(reply.get("content", {}).get("status", "ok"))
                    count = reply.get("content", {}).get("execution_count", count)
                    break
        except queue.Empty:
            pass
        emit({"id": rid, "type": "finished", "status": status, "executionCount": count})
        return True


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
    try:
        km.start_kernel(cwd=os.getcwd(), stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=START_TIMEOUT)
    except Exception as exc:
        emit({"type": "unavailable", "message": f"the Python kernel did not start: {exc}"})
        return 3
    emit(
        {
            "type": "ready",
            "language": "python",
            "languageVersion": ".".join(str(v) for v in sys.version_info[:3]),
        }
    )
    try:
        return Bridge(km, kc).run()
    finally:
        try:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
        except Exception:
            pass
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
