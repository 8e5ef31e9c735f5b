"""E2B's code interpreter through the E2B adapter, driven by the real
`e2b-code-interpreter` SDK (pinned, from PyPI) against a running sandbox.

The fixture `e2b_interpreter` (from conftest.py) yields an
`e2b_code_interpreter.Sandbox` connected through the gateway's E2B listener
(`E2B_SANDBOX_URL`, or the SDK's hosts) to one running Sandbox whose image
carries a Jupyter kernel (ipykernel, jupyter_client, matplotlib, pandas)
and `node`: the `code-interpreter-v1` template. The tests share that sandbox
and do not depend on each other's order: each names its own variables, and
counts executions relative to its own first run.

What is checked: state kept across runs, a figure as PNG and a DataFrame as
HTML, an exception as `execution.error`, output and results streamed to the
callbacks while the code still runs, code contexts (create with a cwd, run,
list, restart, remove), JavaScript, `envs` for one run, the SDK's `timeout`
(the run is interrupted, the state stays), and the refusals the SDK raises.
"""

from __future__ import annotations

import base64
import re
import time
import uuid
from typing import Any

import pytest
from e2b import InvalidArgumentException, NotFoundException, SandboxException, TimeoutException
from e2b_code_interpreter import Sandbox  # type: ignore[import-untyped]

pytestmark = pytest.mark.timeout(600)


def _name() -> str:
    return "v" + uuid.uuid4().hex[:8]


def test_state_stays_between_runs(e2b_interpreter: Sandbox) -> None:
    name = _name()
    first = e2b_interpreter.run_code(f"{name} = 1")
    assert first.error is None
    assert first.results == []
    second = e2b_interpreter.run_code(f"{name} + 1")
    assert second.text == "2"
    assert second.results[0].is_main_result
    assert first.execution_count is not None
    assert second.execution_count == first.execution_count + 1
    assert e2b_interpreter.run_code("'a string'").text == "a string"  # as E2B shows it


def test_a_figure_comes_back_as_png_and_a_dataframe_as_html(e2b_interpreter: Sandbox) -> None:
    figure = e2b_interpreter.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()"
    )
    assert figure.error is None
    (image,) = figure.results
    assert image.png
    assert base64.b64decode(image.png).startswith(b"\x89PNG")
    assert not image.is_main_result
    assert not image.extra
    table = e2b_interpreter.run_code(
        "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})"
    )
    (frame,) = table.results
    assert frame.is_main_result
    assert frame.html
    assert "<table" in frame.html
    assert frame.text
    assert "a  b" in frame.text


def test_an_exception_is_the_executions_error(e2b_interpreter: Sandbox) -> None:
    failed = e2b_interpreter.run_code("def crash():\n    return 1 / 0\ncrash()")
    assert failed.error is not None
    assert failed.error.name == "ZeroDivisionError"
    assert failed.error.value == "division by zero"
    # IPython's traceback, in its terminal colours.
    assert "crash()" in re.sub(r"\x1b\[[0-9;]*m", "", failed.error.traceback)
    seen: list[Any] = []
    e2b_interpreter.run_code(f"{_name()}_undefined", on_error=seen.append)
    assert [e.name for e in seen] == ["NameError"]
    # The kernel lives on.
    assert e2b_interpreter.run_code("40 + 2").text == "42"


def test_output_and_results_stream_while_the_code_runs(e2b_interpreter: Sandbox) -> None:
    stdout: list[tuple[str, float]] = []
    stderr: list[str] = []
    results: list[float] = []
    code = (
        "import sys, time\nimport matplotlib.pyplot as plt\n"
        "print('first', flush=True)\nprint('warned', file=sys.stderr, flush=True)\n"
        "plt.plot([0, 1])\nplt.show()\ntime.sleep(3)\nprint('last')"
    )
    execution = e2b_interpreter.run_code(
        code,
        on_stdout=lambda m: stdout.append((m.line, time.monotonic())),
        on_stderr=lambda m: stderr.append(m.line),
        on_result=lambda r: results.append(time.monotonic()),
    )
    ended = time.monotonic()
    assert "".join(line for line, _ in stdout) == "first\nlast\n"
    assert execution.logs.stdout == [line for line, _ in stdout]
    assert stderr == ["warned\n"]
    assert execution.logs.stderr == stderr
    # The first line and the figure came while the code still slept.
    assert ended - stdout[0][1] > 1.5
    assert len(results) == 1
    assert ended - results[0] > 1.5
    assert execution.results[0].png


def test_code_contexts(e2b_interpreter: Sandbox) -> None:
    home = e2b_interpreter.run_code("import os\nos.getcwd()").text
    assert home
    assert home.startswith("/")
    sub = _name()
    e2b_interpreter.run_code(f"os.makedirs({sub!r}, exist_ok=True)")
    name = _name()
    e2b_interpreter.run_code(f"{name} = 'default'")

    context = e2b_interpreter.create_code_context(cwd=f"{home}/{sub}")
    assert context.language == "python"
    assert context.cwd == f"{home}/{sub}"
    assert e2b_interpreter.run_code("import os\nos.getcwd()", context=context).text == context.cwd
    alone = e2b_interpreter.run_code(name, context=context)
    assert alone.error is not None
    assert alone.error.name == "NameError"
    e2b_interpreter.run_code(f"{name} = 'mine'", context=context)
    assert e2b_interpreter.run_code(name, context=context).text == "mine"
    assert e2b_interpreter.run_code(name).text == "default"

    listed = e2b_interpreter.list_code_contexts()
    assert (listed[-1].id, listed[-1].language, listed[-1].cwd) == (
        context.id,
        context.language,
        context.cwd,
    )
    assert {"python", "javascript"} <= {c.language for c in listed}

    e2b_interpreter.restart_code_context(context)
    gone = e2b_interpreter.run_code(name, context=context)
    assert gone.error is not None
    assert gone.error.value == f"name '{name}' is not defined"

    e2b_interpreter.remove_code_context(context.id)
    assert context.id not in [c.id for c in e2b_interpreter.list_code_contexts()]
    with pytest.raises(NotFoundException):
        e2b_interpreter.run_code("1", context=context)
    with pytest.raises(NotFoundException):
        e2b_interpreter.restart_code_context("ctx-does-not-exist")

    plain = e2b_interpreter.create_code_context()
    assert plain.cwd == home
    e2b_interpreter.remove_code_context(plain)


def test_javascript(e2b_interpreter: Sandbox) -> None:
    hello = e2b_interpreter.run_code("console.log('Hello, World!')", language="js")
    assert hello.logs.stdout == ["Hello, World!\n"]
    assert hello.error is None
    name = _name()
    e2b_interpreter.run_code(f"let {name} = 41", language="javascript")
    assert e2b_interpreter.run_code(f"{name} + 1", language="js").text == "42"
    assert e2b_interpreter.run_code("'text'", language="js").text == "text"
    failed = e2b_interpreter.run_code("null.field", language="js")
    assert failed.error is not None
    assert failed.error.name == "TypeError"
    context = e2b_interpreter.create_code_context(language="js")
    assert context.language == "javascript"
    assert e2b_interpreter.run_code(f"typeof {name}", context=context).text == "undefined"
    e2b_interpreter.remove_code_context(context)


def test_envs_hold_for_one_run(e2b_interpreter: Sandbox) -> None:
    key = _name().upper()
    during = e2b_interpreter.run_code(f"import os; os.getenv({key!r})", envs={key: "bar"})
    assert during.text == "bar"
    after = e2b_interpreter.run_code(f"import os; os.getenv({key!r}, 'default')")
    assert after.text == "default"
    # Setting them costs no execution of the user's.
    assert after.execution_count == (during.execution_count or 0) + 1
    js = e2b_interpreter.run_code(f"process.env.{key}", envs={key: "js"}, language="js")
    assert js.text == "js"


def test_the_sdks_timeout_interrupts_the_run_and_the_state_stays(
    e2b_interpreter: Sandbox,
) -> None:
    name = _name()
    e2b_interpreter.run_code(f"{name} = 'kept'")
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        e2b_interpreter.run_code("import time\ntime.sleep(300)", timeout=3)
    assert time.monotonic() - started < 60
    # The gateway closed the agent's stream, and the agent interrupted the run:
    # the next run does not wait behind the sleep.
    after = e2b_interpreter.run_code(name, timeout=30)
    assert after.text == "kept"


def test_refusals(e2b_interpreter: Sandbox) -> None:
    context = e2b_interpreter.create_code_context()
    with pytest.raises(InvalidArgumentException):
        e2b_interpreter.run_code("1", language="js", context=context)
    e2b_interpreter.remove_code_context(context)
    with pytest.raises(SandboxException, match="400"):
        e2b_interpreter.run_code("1", language="cobol")
    with pytest.raises(SandboxException, match="outside the sandbox's workspace"):
        e2b_interpreter.create_code_context(cwd="/proc")
