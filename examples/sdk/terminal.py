"""A terminal in a sandbox, driven turn by turn as an AI agent (or a person) would:
the login shell on a pty, a REPL that keeps its state between sends, Ctrl-C,
a resize, a second handle that finds the terminal again by id and reads
what it missed, and a watch of the workspace that sees what the terminal
changes.

    python examples/sdk/terminal.py
"""

from __future__ import annotations

import re

from sandbox_sdk import SandboxClient, Terminal

# Printed after a command line's output: "--42--" is in the output only (the
# terminal echoes the line as typed, "--$((6*7))--"), so reading up to it
# returns that command's output, whatever prompts or redraws come between.
DONE = "; echo --$((6*7))--\r"


def run(term: Terminal, line: str) -> str:
    """Type a command line into the shell; what it printed."""
    term.send(line + DONE)
    return term.read_until("--42--").decode(errors="replace")


def main() -> None:
    with SandboxClient() as client, client.create("python") as sandbox:
        term = sandbox.terminals.create(cols=100, rows=30)  # the user's login shell
        shown = run(term, "tty; stty size; echo shell=$0")
        tty = re.search(r"/dev/pts/\d+", shown)
        shell = re.search(r"shell=(/\S+)", shown)  # the output's, not the echo's "$0"
        assert tty is not None, shown
        assert shell is not None, shown
        assert "30 100" in shown, shown
        print(f"a login shell ({shell.group(1)}) on {tty.group(0)}, 100x30")

        # A REPL keeps its state between sends.
        term.send("python3 -q\r")
        term.read_until(">>> ")
        term.send("total = 41\r")
        term.read_until(">>> ")
        term.send("print(total + 1)\r")
        assert b"42" in term.read_until(">>> ")
        term.send("exit()\r")
        print("the REPL kept total between sends")

        # Ctrl-C stops the foreground job; the shell lives on.
        # (The job says when it runs: "sle%sing" in the echo, "sleeping" once it is
        # the terminal's foreground job, the one Ctrl-C reaches.)
        term.send("sh -c 'printf \"sle%sing\\n\" ep; exec sleep 600'\r")
        term.read_until("sleeping")
        term.send("\x03")
        term.resize(120, 40)
        assert "40 120" in run(term, "stty size")
        print("Ctrl-C stopped sleep; resized to 120x40")

        # Another handle (another process, a reconnect) finds it by id and reads
        # what this one did, from the oldest output kept.
        run(term, "echo written-while-away")
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
