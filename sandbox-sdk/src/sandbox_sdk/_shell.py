"""`kubectl sandbox shell`: this terminal joined to a terminal in the sandbox.

The local terminal goes into raw mode (every key, Ctrl-C included, goes to
the sandbox as typed) and is put back as it was on every way out: the
program's exit, a lost connection, an error, a signal. Window size changes
follow (SIGWINCH). The program's exit code is ours (128 + N for a signal).
A lost connection leaves the terminal running in the sandbox; the message
says how to attach to it again.

The terminal is attached over a WebSocket (`Terminal.attach()`): each key
goes out as one message as it is typed, and output is written here as it
arrives (where nothing on the way carries a WebSocket, the session falls
back to a request per key and long-polled output). Two threads: this one
reads the keys, the other the output; the session lets one send while the
other waits to receive.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import sys
import termios
import threading
import tty
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from sandbox_sdk.errors import SandboxError
from sandbox_sdk.models.agent_codes import AgentErrorCode

if TYPE_CHECKING:
    from sandbox_sdk._sync.sandbox import Sandbox
    from sandbox_sdk._sync.terminals import TerminalSession

# How long one read of the terminal's output waits for some (then asks again).
READ_WAIT = 20.0
# How often the key loop looks at whether the output side ended.
TICK = 0.2
# The agent's refusals of one key or control message on an attachment: said,
# and the session goes on (anything else read raises ends it).
REFUSALS = {
    AgentErrorCode.TERMINAL_BACKLOGGED,
    AgentErrorCode.RUNNER_UNAVAILABLE,
    AgentErrorCode.INVALID_REQUEST,
    AgentErrorCode.INVALID_SIGNAL,
    AgentErrorCode.TERMINAL_ENDED,
}


@contextlib.contextmanager
def raw_mode(fd: int) -> Iterator[None]:
    """The terminal on `fd` in raw mode, restored as it was on the way out."""
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSADRAIN)  # not TCSAFLUSH: keys typed ahead are kept
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        size = shutil.get_terminal_size()
    return max(1, min(1000, size.columns)), max(1, min(1000, size.lines))


class _Output(threading.Thread):
    """Copies the terminal's output to ours until it ends or the connection fails."""

    def __init__(self, session: TerminalSession, out_fd: int) -> None:
        super().__init__(daemon=True)
        self.session = session
        self.out_fd = out_fd
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            while True:
                try:
                    data = self.session.read(wait=READ_WAIT)
                except SandboxError as exc:
                    if self.session.transport != "websocket" or exc.code not in REFUSALS:
                        raise
                    # The agent refused a key or a resize (input sent faster than
                    # the terminal takes it): said, and the session goes on.
                    if exc.code != AgentErrorCode.TERMINAL_ENDED:  # its exit follows
                        os.write(self.out_fd, f"\r\n[sandbox: {exc}]\r\n".encode())
                    continue
                view = memoryview(data)
                while view:
                    view = view[os.write(self.out_fd, view) :]
                if not data and self.session.ended:
                    return
        except BaseException as exc:  # reported by the key loop, which owns the exit
            self.error = exc
        finally:
            self.done.set()


def shell(
    sandbox: Sandbox,
    command: Sequence[str],
    *,
    attach: str | None = None,
    in_fd: int = 0,
    out_fd: int = 1,
) -> int:
    """Run `command` (a shell line as one word, else argv; none: the login
    shell) on a new terminal, or `attach` to an existing one, joined to ours."""
    cols, rows = _size(out_fd if os.isatty(out_fd) else in_fd)
    if attach is not None:
        term = sandbox.terminals.get(attach)
        # What is on the screen from now on, not the past.
        session = term.attach(cursor=term.info().output_cursor)
        try:
            session.resize(cols, rows)
        except BaseException:
            session.close()
            raise
    else:
        if len(command) == 1:
            term = sandbox.terminals.create(command[0], cols=cols, rows=rows)
        else:
            term = sandbox.terminals.create(argv=list(command) or None, cols=cols, rows=rows)
        session = term.attach()  # from its first byte
    resized = threading.Event()
    handlers: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        handlers[signal.SIGWINCH] = signal.signal(signal.SIGWINCH, lambda *_: resized.set())
        # Told to stop (the window closed, kill): through the finally clauses,
        # so that the local terminal is put back.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            handlers[sig] = signal.signal(sig, _stop)
    output = _Output(session, out_fd)
    try:
        with raw_mode(in_fd):
            output.start()
            try:
                _keys(session, output, in_fd, resized, out_fd)
            except Stopped:
                raise
            except Exception as exc:  # a lost connection, as the output side reports it
                output.error = output.error or exc
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        session.close()  # detached; the output thread, waiting on it, ends
    if output.error is not None:
        name = sandbox.name
        why = output.error
        if isinstance(why, SandboxError) and why.code == "attachment_lost":
            why = why.details.get("reason", why)  # its own advice is the SDK's, not ours
        print(
            f"\r\nconnection lost ({why}); the terminal goes on in the sandbox:"
            f" kubectl sandbox shell {name} --attach {term.id}",
            file=sys.stderr,
        )
        return 1
    ended = session.wait()  # as the end said it (the WebSocket's last message)
    with contextlib.suppress(SandboxError):
        term.kill()  # its output was shown: free its place
    if ended.signal:
        return 128 + ended.signal
    return ended.exit_code if ended.exit_code is not None else 1


class Stopped(Exception):
    """This process was told to stop (SIGTERM, SIGHUP)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(signum)


def _keys(
    session: TerminalSession, output: _Output, in_fd: int, resized: threading.Event, out_fd: int
) -> None:
    """Send what is typed until the output side ends (the program exited or the
    connection failed). Input that ends (a pipe) stops only the typing."""
    typing = True
    while not output.done.is_set():
        if resized.is_set():
            resized.clear()
            session.resize(*_size(out_fd))
        if not typing:
            output.done.wait(TICK)
            continue
        try:
            ready, _, _ = select.select([in_fd], [], [], TICK)
        except InterruptedError:
            continue  # SIGWINCH
        if not ready:
            continue
        data = os.read(in_fd, 4096)
        if not data:
            typing = False
            continue
        try:
            session.send(data)
        except SandboxError:
            if output.done.is_set():
                return  # it ended while we typed
            raise
