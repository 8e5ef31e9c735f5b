"""Stateful code, as a code-interpreter agent uses it: data loaded in one turn
is there in the next, a figure comes back as a PNG, a table as HTML and text,
an exception as name, value and traceback (and the kernel lives on), a
runaway loop ends at its timeout with the state kept, and two contexts do not
share variables.

    python examples/sdk/code_interpreter.py
"""

from __future__ import annotations

import base64

from sandbox_sdk import SandboxClient


def main() -> None:
    with SandboxClient() as client, client.create("python") as sandbox:
        # Turn 1: load data. Nothing is printed; the variables stay.
        first = sandbox.run_code(
            "import pandas as pd\n"
            "df = pd.DataFrame({'city': ['Oslo', 'Lima', 'Pune'], 'temp': [4.5, 19.0, 31.2]})\n"
        )
        assert first.status == "ok", first
        print(f"turn 1: loaded a table in {first.context_id}")

        # Turn 2: the table from turn 1, as the kernel shows it.
        table = sandbox.run_code("df.sort_values('temp')")
        [shown] = table.results
        assert "<table" in (shown.html or ""), shown.formats()
        assert "Pune" in (shown.text or ""), shown.text
        print(f"turn 2: the table as {', '.join(shown.formats())}")

        # Turn 3: a figure comes back as a PNG (matplotlib's inline backend).
        figure = sandbox.run_code(
            "import matplotlib.pyplot as plt\n"
            "plt.bar(df['city'], df['temp'])\n"
            "plt.title('temperature')\n"
            "plt.show()"
        )
        pngs = [r.png for r in figure.results if r.png]
        assert len(pngs) == 1, figure
        png = base64.b64decode(pngs[0])
        assert png.startswith(b"\x89PNG"), png[:8]
        print(f"turn 3: a figure, {len(png)} bytes of PNG")

        # Turn 4: an exception, reported; the kernel and its state live on.
        failed = sandbox.run_code("df['missing']")
        assert failed.error is not None
        print(f"turn 4: {failed.error.name}: {failed.error.value}")
        assert sandbox.run_code("len(df)").text == "3"

        # Turn 5: a runaway loop ends at its timeout; the table is still there.
        stopped = sandbox.run_code("while True:\n    pass", timeout=2)
        assert stopped.status == "timed_out", stopped
        assert sandbox.run_code("df['temp'].max()").text == "31.2"
        print("turn 5: the loop was interrupted at 2s; the table is kept")

        # A second context is a kernel of its own.
        scratch = sandbox.contexts.create()
        alone = sandbox.run_code("'df' in dir()", context=scratch)
        assert alone.text == "False", alone
        sandbox.contexts.restart(sandbox.contexts.get("default-python"))
        assert sandbox.run_code("'df' in dir()").text == "False"
        print("contexts are separate, and a restart clears one; done")


if __name__ == "__main__":
    main()
