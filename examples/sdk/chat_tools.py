"""A chat product's sandbox tool set, on one sandbox per chat.

    python examples/sdk/chat_tools.py

The tools a model calls (read a file or a line range, write, grep, find,
apply a multi-file patch, find-replace, run a command with a timeout, a
download) map one to one onto the SDK. Here a scripted "model" writes a small
project, searches it, patches it, runs its tests, downloads it as a tar, and
runs a command past its timeout: that command is stopped, the tool reports
the error, and the sandbox stays usable.
"""

from __future__ import annotations

import io
import tarfile
from typing import Any

from sandbox_sdk import CommandTimeout, Sandbox, SandboxClient, SandboxError

FILE_TIMEOUT = 60.0


class SandboxTools:
    """What a chat's model may call; every result is JSON-ready, errors included."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    def call(self, tool: str, **args: Any) -> dict[str, Any]:
        try:
            return {"ok": True, "result": getattr(self, tool)(**args)}
        except SandboxError as error:  # the model sees the reason and decides
            return {"ok": False, "error": type(error).__name__, "message": str(error)}

    def sandbox_write_file(self, path: str, content: str) -> int:
        return self.sandbox.files.write(path, content).size

    def sandbox_read_file(
        self, path: str, start: int | None = None, count: int | None = None
    ) -> str:
        return self.sandbox.files.read(path, start_line=start, line_count=count)

    def sandbox_grep_files(self, pattern: str, path: str = ".") -> list[str]:
        found = self.sandbox.files.grep(pattern, path)
        return [f"{m.path}:{m.line}: {m.text}" for m in found.matches]

    def sandbox_find_files(self, pattern: str) -> list[str]:
        return sorted(self.sandbox.files.find(pattern))

    def sandbox_apply_patch(self, patch: str) -> list[str]:
        return [f"{f.status} {f.path}" for f in self.sandbox.files.apply_patch(patch).files]

    def sandbox_find_replace(self, path: str, find: str, replace: str) -> int:
        return self.sandbox.files.replace(path, find, replace)

    def sandbox_run_command(self, command: str, timeout: float = 180) -> dict[str, Any]:
        try:
            result = self.sandbox.execute(command, timeout=timeout)
        except CommandTimeout as stopped:
            return {"timedOut": True, "stdout": stopped.result.stdout}
        return {"exitCode": result.exit_code, "stdout": result.stdout, "stderr": result.stderr}

    def sandbox_download_url(self, path: str) -> str:
        return self.sandbox.files.download_url(path, ttl=600)


PATCH = "\n".join(
    [
        "--- a/calc/ops.py",
        "+++ b/calc/ops.py",
        "@@ -1,2 +1,5 @@",
        " def add(a, b):",
        "     return a + b",
        "+",
        "+def mul(a, b):",
        "+    return a * b",
        "--- a/tests/test_ops.py",
        "+++ b/tests/test_ops.py",
        "@@ -1,4 +1,8 @@",
        "-from calc.ops import add",
        "+from calc.ops import add, mul",
        " ",
        " def test_add():",
        "     assert add(2, 3) == 5",
        "+",
        "+",
        "+def test_mul():",
        "+    assert mul(2, 3) == 6",
        "",
    ]
)

client = SandboxClient()
with client.create("python") as sandbox:
    tools = SandboxTools(sandbox)
    for path, content in {
        "calc/__init__.py": "",
        "calc/ops.py": "def add(a, b):\n    return a + b\n",
        "tests/test_ops.py": (
            "from calc.ops import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"
        ),
        "run_tests.py": (
            "import sys, unittest, importlib\n"
            "sys.path.insert(0, '.')\n"
            "mod = importlib.import_module('tests.test_ops')\n"
            "fns = [getattr(mod, n) for n in dir(mod) if n.startswith('test_')]\n"
            "for fn in fns: fn(); print('passed', fn.__name__)\n"
        ),
        "tests/__init__.py": "",
    }.items():
        assert tools.call("sandbox_write_file", path=path, content=content)["ok"]

    print(tools.call("sandbox_grep_files", pattern=r"def \w+")["result"])
    assert tools.call("sandbox_find_files", pattern="*.py")["result"] == [
        "calc/__init__.py",
        "calc/ops.py",
        "run_tests.py",
        "tests/__init__.py",
        "tests/test_ops.py",
    ]
    print(tools.call("sandbox_apply_patch", patch=PATCH)["result"])
    assert (
        tools.call("sandbox_find_replace", path="calc/ops.py", find="a * b", replace="b * a")[
            "result"
        ]
        == 1
    )
    ran = tools.call("sandbox_run_command", command="python3 run_tests.py", timeout=60)["result"]
    assert ran["exitCode"] == 0, ran
    assert "passed test_mul" in ran["stdout"], ran
    print(ran["stdout"], end="")

    # A second patch that does not apply: all or nothing, and the model hears why.
    refused = tools.call("sandbox_apply_patch", patch=PATCH)
    assert not refused["ok"], refused
    assert refused["error"] == "Conflict", refused

    # Lines 4-5 of a file, as the read tool shows them.
    assert tools.call("sandbox_read_file", path="calc/ops.py", start=4, count=2)["result"] == (
        "def mul(a, b):\n    return b * a\n"
    )

    # The project as a tar (what a download link serves).
    archive = io.BytesIO()
    sandbox.files.download_tar(".", archive)
    archive.seek(0)
    with tarfile.open(fileobj=archive) as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
    assert {"calc/ops.py", "tests/test_ops.py"} <= names, names
    # A link without credentials needs the gateway's own address (SANDBOX_GATEWAY_URL);
    # through the API server's proxy the tool says so instead.
    link = tools.call("sandbox_download_url", path="calc")
    print("download link:", link["result"].split("?")[0] if link["ok"] else link["message"])

    # Past its timeout a command is stopped; the sandbox goes on serving.
    slow = tools.call("sandbox_run_command", command="echo begun; sleep 120", timeout=2)["result"]
    assert slow == {"timedOut": True, "stdout": "begun\n"}, slow
    after = tools.call("sandbox_run_command", command="echo still usable")["result"]
    assert after["stdout"] == "still usable\n", after
    print("timed-out command stopped; sandbox still usable")
print("done")
