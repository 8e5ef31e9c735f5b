"""A terminal in a sandbox, driven turn by turn as an AI agent (or a person) would:
the login shell on a pty, attached over a WebSocket (keys out and output back
as they come), a REPL that keeps its state between sends, Ctrl-C, a resize,
a second handle that finds the terminal again by id and reads what it
missed, and a watch of the workspace that sees what the terminal changes.

    python examples/sdk/terminal.py
"""

from __future__ import annotations

import re

from sandbox_sdk import SandboxClient, TerminalSession

# Printed after a command line's output: "--42--" is in the output only (the
# terminal echoes the line as typed, "--$((6*7))--"), so reading up to it
# returns that command's output, whatever prompts or redraws come between.
DONE = "; echo --$((6*7))--\r"


def run(session: TerminalSession, line: str) -> str:
    """Type a command line into the shell; what it printed."""
    session.send(line + DONE)
    return session.read_until("--42--").decode(errors="replace")


def main() -> None:
    with SandboxClient() as client, client.create("python") as sandbox:
        term = sandbox.terminals.create(cols=100, rows=30)  # the user's login shell
        # Attached: one WebSocket carries the keys and the output (through the
        # gateway, and the API server's proxy from a kubeconfig). Leaving the
        # `with` detaches; the shell goes on.
        with term.attach() as session:
            print(f"attached over {session.transport}")
            shown = run(session, "tty; stty size; echo shell=$0")
            tty = re.search(r"/dev/pts/\d+", shown)
            shell = re.search(r"shell=(/\S+)", shown)  # the output's, not the echo's "$0"
            assert tty is not None, shown
            assert shell is not None, shown
            assert "30 100" in shown, shown
            print(f"a login shell ({shell.group(1)}) on {tty.group(0)}, 100x30")

            # A REPL keeps its state between sends.
            session.send("python3 -q\r")
            session.read_until(">>> ")
            session.send("total = 41\r")
            session.read_until(">>> ")
            session.send("print(total + 1)\r")
            assert b"42" in session.read_until(">>> ")
            session.send("exit()\r")
            print("the REPL kept total between sends")

            # Ctrl-C stops the foreground job; the shell lives on.
            # (The job says when it runs: "sle%sing" in the echo, "sleeping" once it
            # is the terminal's foreground job, the one Ctrl-C reaches.)
            session.send("sh -c 'printf \"sle%sing\\n\" ep; exec sleep 600'\r")
            session.read_until("sleeping")
            session.send("\x03")
            session.resize(120, 40)
            assert "40 120" in run(session, "stty size")
            print("Ctrl-C stopped sleep; resized to 120x40")
            run(session, "echo written-while-away")

        # Another handle (another process, a reconnect) finds it by id and reads
        # what the session did, from the oldest output kept, over plain HTTP
        # requests this time (`send`, `read`, `read_until` of the terminal itself).
        again = sandbox.terminals.get(term.id)
        assert b"written-while-away" in again.read_until("written-while-away")
        print(f"terminal {term.id} found again; it replayed what was missed")

        # What the terminal changes, a watch sees as it happens (an IDE's view).
        with sandbox.files.watch(".", recursive=True, timeout=60) as changes:
            term.send("mkdir -p notes && echo draft > notes/todo.txt\r")
            seen = []
            for event in changes:
                seen.append((event.type, event.path))
                # Made in a directory that is itself new: the watch may find it
                # by scanning that directory (create) or see it happen (create, write).
                if event.path == "notes/todo.txt":
                    break
        print("the watch saw", ", ".join(f"{kind} {path}" for kind, path in seen))

        term.send("exit 3\r")
        ended = term.wait(timeout=60)
        assert (ended.status, ended.exit_code) == ("exited", 3), ended
        print("the shell exited with 3; done")


if __name__ == "__main__":
    main()
