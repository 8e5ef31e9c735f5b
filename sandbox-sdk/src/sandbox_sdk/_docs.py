"""Write (or, with --check, verify) sandbox-sdk/docs/reference.md from the docstrings.

    python -m sandbox_sdk._docs [--check]

The reference is the public surface as the code declares it: each class of the
sync client with its methods' signatures and docstrings (the async client has
the same methods, awaited; `aclose` for `close`), the result types and the
errors. Checked in, and a test fails when it is stale.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

import sandbox_sdk
from sandbox_sdk import config, errors, types
from sandbox_sdk._async import gateway
from sandbox_sdk._sync import client, executions, files, sandbox, terminals

TARGET = Path(__file__).resolve().parents[2] / "docs" / "reference.md"
CLASSES = [
    client.SandboxClient,
    sandbox.Sandbox,
    files.Files,
    executions.Job,
    files.Watch,
    terminals.Terminals,
    terminals.Terminal,
    terminals.TerminalSession,
]
RESULTS = [types.CommandResult, types.OutputEvent, types.Runtime, types.Event]
ERRORS = [
    errors.SandboxError,
    errors.NotFound,
    errors.NotReady,
    errors.Paused,
    errors.Unauthorized,
    errors.Forbidden,
    errors.Conflict,
    errors.Invalid,
    errors.Timeout,
    errors.CommandTimeout,
    errors.CommandFailed,
    errors.ServerError,
    errors.ConfigError,
]


def _doc(obj: object) -> str:
    return inspect.cleandoc(inspect.getdoc(obj) or "")


def _signature(func: object) -> str:
    # Annotations are strings here (PEP 563): shown without their quotes.
    text = str(inspect.signature(func)).replace("'", "")  # type: ignore[arg-type]
    # `self`, also annotated (a module's function assigned as a method).
    text = re.sub(r"^\(self(?:: \w+)?(, |\))", lambda m: "(" if m[1] == ", " else "()", text)
    # Qualified names read worse than the names users import.
    return re.sub(r"\bsandbox_sdk\.(?:[a-z_]+\.)+", "", text)


def render() -> str:
    out = [
        "# sandbox-sdk reference",
        "",
        "Generated from the docstrings by `python -m sandbox_sdk._docs`; do not edit.",
        "`AsyncSandboxClient`, `AsyncSandbox`, `AsyncFiles`, `AsyncJob` and `AsyncWatch`",
        "have the same methods as the classes below, as coroutines (`aclose()` for",
        "`close()`; `stream()` and `execution_output()` are async iterators, and so is",
        "`AsyncWatch`, with `async with` for `with`; `files.watch()` itself is not awaited).",
        "",
        "## Package",
        "",
        _doc(sandbox_sdk),
        "",
    ]
    for cls in CLASSES:
        out += [f"## `{cls.__name__}`", "", _doc(cls), ""]
        for name, member in inspect.getmembers(cls):
            if name.startswith("_") or not callable(member):
                continue
            out += [f"### `{cls.__name__}.{name}{_signature(member)}`", "", _doc(member), ""]
        for name, prop in inspect.getmembers(cls, lambda m: isinstance(m, property)):
            out += [f"### `{cls.__name__}.{name}` (property)", "", _doc(prop), ""]
    out += ["## Results", ""]
    for cls in RESULTS:
        fields = ", ".join(f"`{f}`" for f in cls.__dataclass_fields__)  # type: ignore[attr-defined]
        out += [f"### `{cls.__name__}`", "", _doc(cls), "", f"Fields: {fields}.", ""]
    out += ["## Errors", "", _doc(errors), ""]
    for cls in ERRORS:
        base = cls.__mro__[1].__name__
        out += [f"### `{cls.__name__}({base})`", "", _doc(cls), ""]
    out += [
        "## Connection",
        "",
        _doc(config),
        "",
        "### The gateway",
        "",
        _doc(gateway),
        "",
    ]
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"stale {TARGET} (run `make sdk-generate`)", file=sys.stderr)
            return 1
        return 0
    TARGET.parent.mkdir(exist_ok=True)
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
