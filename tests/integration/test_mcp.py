"""sandbox-mcp through the official MCP client, over stdio and streamable HTTP,
against the real API server, operator and gateway of this tier, with real
agents on loopback. A node player thread starts an agent for every pod of the
test's namespace (again after a pause, on the same workspace directory)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, ImageContent, TextContent
from sandbox_mcp.sessions import SESSION_LABEL

from devcluster.controlplane import ControlPlane
from tests.integration.harness import (
    VENV_BIN,
    AgentProcess,
    GatewayProcess,
    Node,
    free_port,
    next_pod_ip,
    secret_token,
    wait_for,
)
from tests.integration.test_gateway import caller
from tests.integration.test_sdk import alice as alice
from tests.kube import ApiError, KubeJSON, core_path

SANDBOXES = "/apis/sandbox.dev/v1alpha1/namespaces/{ns}/sandboxes"

# A 1x1 PNG, as a kernel would send a figure (base64).
PIXEL = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJ"
    "AAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)


class NodePlayer:
    """The kubelet's part for every pod of a namespace: a real agent per pod,
    whose workspace directory belongs to the sandbox (so it survives a pause,
    as the workspace claim does)."""

    def __init__(self, control_plane: ControlPlane, ns: str, root: Path) -> None:
        self.kube = KubeJSON(control_plane.kubeconfig)
        self.ns = ns
        self.root = root
        self.agents: dict[str, AgentProcess] = {}
        self.played: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.lock = threading.Lock()
        self.errors: list[str] = []

    def _loop(self) -> None:
        while not self.stop.is_set():
            for pod in self.kube.list(core_path("pods", self.ns)):
                uid = pod["metadata"]["uid"]
                if uid not in self.played and not pod["metadata"].get("deletionTimestamp"):
                    self.played.add(uid)
                    threading.Thread(target=self._play, args=(pod["metadata"]["name"],)).start()
            self.stop.wait(0.2)

    def _play(self, name: str) -> None:
        try:
            token = wait_for(lambda: _token(self.kube, self.ns, name), 20, f"{name}'s token")
            with self.lock:
                old = self.agents.pop(name, None)
            if old is not None:
                old.stop()
            agent = AgentProcess(self.root / name, next_pod_ip(), 8080, token)
            agent.start()
            with self.lock:
                self.agents[name] = agent
            Node(self.kube).run_pod(self.ns, name, agent.ip)
        except Exception as exc:  # reported by the fixture
            self.errors.append(f"{name}: {exc}")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        for agent in self.agents.values():
            agent.stop()
        self.kube.close()


def _token(kube: KubeJSON, ns: str, name: str) -> str | None:
    try:
        return secret_token(kube, ns, name)
    except ApiError:
        return None


@pytest.fixture
def node_player(control_plane: ControlPlane, ns: str, tmp_path: Path) -> Iterator[NodePlayer]:
    player = NodePlayer(control_plane, ns, tmp_path / "pods")
    player.thread.start()
    yield player
    player.close()
    assert player.errors == []


@pytest.fixture
def kubeconfig(control_plane: ControlPlane, alice: str, tmp_path: Path) -> Path:
    """alice's kubeconfig: what a user of the stdio server has."""
    path = tmp_path / "alice.kubeconfig"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "local",
                "cluster": {
                    "server": control_plane.server,
                    "certificate-authority": str(control_plane.ca_cert),
                },
            }
        ],
        "users": [{"name": "alice", "user": {"token": alice}}],
        "contexts": [{"name": "alice", "context": {"cluster": "local", "user": "alice"}}],
        "current-context": "alice",
    }
    path.write_text(json.dumps(config))
    return path


def _stdio(kubeconfig: Path, gateway: GatewayProcess, ns: str, *extra: str) -> Client:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/root"),
        "SANDBOX_GATEWAY_URL": gateway.url,
    }
    params = StdioServerParameters(
        command=str(VENV_BIN / "sandbox-mcp"),
        args=["--kubeconfig", str(kubeconfig), "-n", ns, "--runtime", "python", *extra],
        env=env,
    )
    return Client(params)


class HttpServer:
    def __init__(
        self, control_plane: ControlPlane, gateway: GatewayProcess, ns: str, log: Path
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    str(VENV_BIN / "sandbox-mcp"),
                    "--transport=http",
                    f"--port={self.port}",
                    f"--api-server={control_plane.server}",
                    f"--ca-file={control_plane.ca_cert}",
                    f"--gateway-url={gateway.url}",
                    f"--namespace={ns}",
                    "--runtime=python",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={"PATH": os.environ["PATH"]},
            )
        wait_for(self._up, 30, "sandbox-mcp http to serve /healthz")

    def _up(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def client(self, token: str, session: str | None = None, **kwargs: Any) -> Client:
        headers = {"Authorization": f"Bearer {token}"}
        if session:
            headers["X-Sandbox-Session"] = session
        http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(60, read=600))
        return Client(streamable_http_client(self.url, http_client=http, **kwargs), mode="legacy")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def http_server(
    control_plane: ControlPlane, gateway: GatewayProcess, ns: str, tmp_path: Path
) -> Iterator[HttpServer]:
    server = HttpServer(control_plane, gateway, ns, tmp_path / "mcp.log")
    yield server
    server.stop()


def text(result: CallToolResult) -> str:
    return "".join(c.text for c in result.content if isinstance(c, TextContent))


async def ok(client: Client, tool: str, **args: Any) -> str:
    result = await client.call_tool(tool, args)
    assert not result.is_error, f"{tool}: {text(result)}"
    return text(result)


async def fails(client: Client, tool: str, kind: str, **args: Any) -> str:
    result = await client.call_tool(tool, args)
    assert result.is_error, f"{tool} succeeded: {text(result)}"
    assert text(result).startswith(f"{kind}:"), text(result)
    return text(result)


def session_sandboxes(kube: KubeJSON, ns: str) -> list[str]:
    items = kube.list(SANDBOXES.format(ns=ns), label_selector=SESSION_LABEL)
    return sorted(
        s["metadata"]["name"] for s in items if not s["metadata"].get("deletionTimestamp")
    )


PATCH = """\
--- a/app/main.py
+++ b/app/main.py
@@ -1,2 +1,2 @@
 import sys
-print("hello")
+print("patched")
--- /dev/null
+++ b/app/extra.txt
@@ -0,0 +1 @@
+new file
"""


def test_every_tool_over_stdio(
    kubeconfig: Path, gateway: GatewayProcess, ns: str, node_player: NodePlayer, kube: KubeJSON
) -> None:
    async def main() -> None:
        async with _stdio(kubeconfig, gateway, ns, "--on-end=destroy") as client:
            listed = {t.name: t for t in (await client.list_tools()).tools}
            assert set(listed) == {
                "sandbox_read_file", "sandbox_write_file", "sandbox_delete_file",
                "sandbox_list_directory", "sandbox_run_command", "sandbox_grep_files",
                "sandbox_find_files", "sandbox_apply_patch", "sandbox_find_replace",
                "sandbox_download_url", "sandbox_create", "sandbox_snapshot",
                "sandbox_restore", "sandbox_destroy", "sandbox_list_commands",
                "sandbox_command_output", "sandbox_run_code",
            }  # fmt: skip
            assert listed["sandbox_run_command"].input_schema["required"] == ["command"]

            # The first call creates the session's sandbox.
            assert "wrote 26 bytes" in await ok(
                client,
                "sandbox_write_file",
                path="app/main.py",
                content='import sys\nprint("hello")\n',
            )
            [name] = session_sandboxes(kube, ns)
            # Read: line numbers, ranges; missing files.
            assert await ok(client, "sandbox_read_file", path="app/main.py") == (
                '1\timport sys\n2\tprint("hello")'
            )
            assert (
                await ok(
                    client, "sandbox_read_file", path="app/main.py", start_line=2, line_count=1
                )
                == '2\tprint("hello")'
            )
            assert (
                await ok(client, "sandbox_read_file", path="app/main.py", line_numbers=False)
                == 'import sys\nprint("hello")\n'  # exactly the file
            )
            await fails(client, "sandbox_read_file", "not_found", path="nope.txt")
            await fails(client, "sandbox_read_file", "invalid", path="../../etc/passwd")
            # List.
            listing = await ok(client, "sandbox_list_directory", path="app")
            assert "app/main.py  (26 bytes)" in listing
            await fails(client, "sandbox_list_directory", "not_found", path="missing")
            # Patch (two files at once), then a conflicting one changes nothing.
            assert await ok(client, "sandbox_apply_patch", patch=PATCH) == (
                "modified app/main.py (1 hunks)\ncreated app/extra.txt (1 hunks)"
            )
            await fails(client, "sandbox_apply_patch", "conflict", patch=PATCH)
            # Find-replace: unique, none, several.
            assert (
                await ok(
                    client,
                    "sandbox_find_replace",
                    path="app/main.py",
                    find="patched",
                    replace="edited",
                )
                == "1 replacement in app/main.py"
            )
            await fails(
                client,
                "sandbox_find_replace",
                "conflict",
                path="app/main.py",
                find="zzz",
                replace="y",
            )
            await ok(client, "sandbox_write_file", path="app/twice.txt", content="a a\n")
            await fails(
                client,
                "sandbox_find_replace",
                "conflict",
                path="app/twice.txt",
                find="a",
                replace="b",
            )
            # Code: state across calls, images as image content, errors, the timeout.
            assert await ok(client, "sandbox_run_code", code="n = 6") == "(no output)"
            assert await ok(client, "sandbox_run_code", code="print('hi'); n * 7") == (
                "stdout:\nhi\n\n\nOut[2]:\n42"
            )
            shown = await client.call_tool(
                "sandbox_run_code",
                {
                    "code": f"from IPython.display import Image\nImage(data=__import__('base64')"
                    f".b64decode('{PIXEL}'))"
                },
            )
            assert not shown.is_error, text(shown)
            assert [c.type for c in shown.content] == ["text", "image"]
            image = shown.content[1]
            assert isinstance(image, ImageContent)
            assert (image.mime_type, image.data) == ("image/png", PIXEL)
            raised = await fails(client, "sandbox_run_code", "code_failed", code="n / 0")
            assert "ZeroDivisionError: division by zero" in raised
            assert "\x1b[" not in raised  # the traceback without terminal colours
            timed = await fails(
                client, "sandbox_run_code", "timeout", code="while True: pass", timeout_seconds=1
            )
            assert "KeyboardInterrupt" in timed
            assert await ok(client, "sandbox_run_code", code="n") == "Out[6]:\n6"
            # Commands: output, exit codes, the timeout.
            out = await ok(client, "sandbox_run_command", command="python3 app/main.py")
            assert out == "exit code: 0\nstdout:\nedited\n"
            failed = await fails(
                client, "sandbox_run_command", "command_failed", command="echo oops >&2; exit 3"
            )
            assert "exit code: 3" in failed
            assert "stderr:\noops" in failed
            began = time.monotonic()
            timed = await fails(
                client,
                "sandbox_run_command",
                "timeout",
                command="echo started; sleep 60",
                timeout_seconds=1,
            )
            assert time.monotonic() - began < 30
            assert "started" in timed
            await fails(
                client, "sandbox_run_command", "invalid", command="true", timeout_seconds=1801
            )
            # Grep and fuzzy find.
            assert await ok(client, "sandbox_grep_files", pattern=r"ed.t+ed", path="app") == (
                'app/main.py:2:8: print("edited")'
            )
            assert await ok(client, "sandbox_grep_files", pattern="absent") == "no matches"
            await fails(client, "sandbox_grep_files", "invalid", pattern="(unclosed")
            found = (await ok(client, "sandbox_find_files", query="MAIN")).splitlines()
            assert found == ["app/main.py"]
            assert (await ok(client, "sandbox_find_files", query="xtr")).splitlines() == [
                "app/extra.txt"
            ]
            assert await ok(client, "sandbox_find_files", query="qqq") == "no files match"
            # A signed URL downloads without credentials.
            url = await ok(client, "sandbox_download_url", path="app/main.py")
            assert (
                await asyncio.to_thread(httpx.get, url, timeout=30)
            ).text == 'import sys\nprint("edited")\n'
            await fails(client, "sandbox_download_url", "not_found", path="missing.bin")
            # Delete a file, a directory; a missing one.
            assert await ok(client, "sandbox_delete_file", path="app/extra.txt") == (
                "deleted app/extra.txt"
            )
            await ok(client, "sandbox_delete_file", path="app")
            await fails(client, "sandbox_delete_file", "not_found", path="app")
            # Snapshots: this control plane has no VolumeSnapshot API (the
            # real node's are in tests/e2e/test_mcp_e2e.py).
            refused = await fails(client, "sandbox_snapshot", "error", tag="t1")
            assert "SnapshotsUnsupported" in refused
            await fails(client, "sandbox_restore", "not_found", snapshot="no-such-snapshot")
            # Lifecycle: one sandbox per session; destroy, create.
            await fails(client, "sandbox_create", "conflict", runtime="python")
            assert await ok(client, "sandbox_destroy") == f"destroyed {name}"
            assert session_sandboxes(kube, ns) == []
            await fails(client, "sandbox_create", "not_ready", runtime="no-such-runtime")
            await ok(client, "sandbox_destroy")
            assert "is ready" in await ok(client, "sandbox_create", runtime="python")
            assert await ok(client, "sandbox_list_directory") == "(. is empty)"
            unknown = await client.call_tool("sandbox_nothing", {})
            assert unknown.is_error
            assert text(unknown).startswith("invalid:")

    asyncio.run(main())
    # --on-end=destroy: the session's end deleted its sandbox.
    wait_for(lambda: session_sandboxes(kube, ns) == [], 60, "the sandbox deleted at session end")


def test_progress_notifications_carry_a_long_commands_output(
    kubeconfig: Path, gateway: GatewayProcess, ns: str, node_player: NodePlayer
) -> None:
    async def main() -> None:
        async with _stdio(kubeconfig, gateway, ns, "--on-end=destroy") as client:
            seen: list[tuple[float, str | None, float]] = []

            async def progress(progress: float, total: float | None, message: str | None) -> None:
                seen.append((progress, message, time.monotonic()))

            # The sandbox first (waiting for it is reported too: not this test's matter).
            await ok(client, "sandbox_list_directory")
            result = await client.call_tool(
                "sandbox_run_command",
                {"command": "for i in 1 2 3 4; do echo tick $i; sleep 0.5; done"},
                progress_callback=progress,
            )
            ended = time.monotonic()
            assert not result.is_error, text(result)
            assert "".join(m or "" for _, m, _ in seen) == "".join(
                f"tick {i}\n" for i in range(1, 5)
            )
            # They arrived while it ran, not with the result.
            assert seen[0][2] < ended - 1.0
            assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)

    asyncio.run(main())


def test_run_command_is_bash(
    kubeconfig: Path, gateway: GatewayProcess, ns: str, node_player: NodePlayer
) -> None:
    """The tool says bash: bash's own syntax works (the agent's `command` form
    would be /bin/sh, dash here, where both lines below are errors)."""

    async def main() -> None:
        async with _stdio(kubeconfig, gateway, ns, "--on-end=destroy") as client:
            out = await ok(
                client,
                "sandbox_run_command",
                command='set -o pipefail; [[ -n "$BASH_VERSION" ]] && echo bash;'
                " false | true; echo status $?",
            )
            assert out == "exit code: 0\nstdout:\nbash\nstatus 1\n", out
            # stdin still reaches the script, and an over-long script is refused
            # with what to do instead (Linux caps one argument at 128 KiB).
            assert "stdout:\nhi\n" in await ok(
                client, "sandbox_run_command", command="cat", stdin="hi\n"
            )
            refused = await fails(
                client, "sandbox_run_command", "invalid", command="#" + "é" * 70_000
            )
            assert "bash FILE" in refused
            listed = {t.name: t for t in (await client.list_tools()).tools}
            assert "bash" in (listed["sandbox_run_command"].description or "")

    asyncio.run(main())


def test_tool_arguments_are_checked_against_the_tools_schemas(
    kubeconfig: Path, gateway: GatewayProcess, ns: str, kube: KubeJSON
) -> None:
    """Every call is held to its tool's declared schema before anything is
    done (no sandbox is even created): the refusal names the argument."""

    async def main() -> None:
        async with _stdio(kubeconfig, gateway, ns, "--on-end=destroy") as client:
            listed = {t.name: t for t in (await client.list_tools()).tools}
            missing = await fails(client, "sandbox_run_command", "invalid")
            assert "missing argument 'command'" in missing, missing
            assert "sandbox_run_command takes: command (required)" in missing
            unknown = await fails(
                client, "sandbox_run_command", "invalid", command="true", shell="zsh"
            )
            assert "unknown argument 'shell'" in unknown, unknown
            typed = await fails(client, "sandbox_read_file", "invalid", path="a", start_line="2")
            assert "argument 'start_line'" in typed, typed
            # The schema's depth limit is the agent's (64), not one of its own.
            depth = listed["sandbox_list_directory"].input_schema["properties"]["depth"]
            assert depth["maximum"] == 64
            deep = await fails(client, "sandbox_list_directory", "invalid", depth=65)
            assert "argument 'depth': 65 is greater than the maximum of 64" in deep, deep
            await fails(client, "sandbox_destroy", "invalid", force=True)
        assert session_sandboxes(kube, ns) == []

    asyncio.run(main())


def test_refusals_and_binary_files_say_what_they_are(
    kubeconfig: Path, gateway: GatewayProcess, ns: str, node_player: NodePlayer
) -> None:
    async def main() -> None:
        async with _stdio(kubeconfig, gateway, ns, "--on-end=destroy") as client:
            await ok(
                client,
                "sandbox_run_command",
                command="ln -s /etc/hostname outside; printf '\\x89PNG\\r\\n\\x1a\\n\\0\\0\\0'"
                " > 'my image.png'; printf 'caf\\xc3\\xa9 \\xef\\xbf\\xbd\\n' > text.txt",
            )
            # The agent's own refusal (a symlink out of the workspace) is no
            # matter of Kubernetes permissions: no RBAC in what the model reads.
            escape = await fails(client, "sandbox_read_file", "forbidden", path="outside")
            assert "path_escape" in escape, escape
            assert "outside the workspace" in escape
            assert "RBAC" not in escape
            # A binary file is named as one, with its size and ways to get it.
            binary = await fails(client, "sandbox_read_file", "binary", path="my image.png")
            assert "my image.png is a binary file (11 bytes)" in binary, binary
            assert "sandbox_download_url" in binary
            assert "xxd 'my image.png'" in binary
            # UTF-8 text, even with a U+FFFD of its own, is text.
            assert await ok(client, "sandbox_read_file", path="text.txt") == "1\tcafé \ufffd"
            # The grep tool says what the agent's regexes are: RE2, no lookaround.
            listed = {t.name: t for t in (await client.list_tools()).tools}
            grep = listed["sandbox_grep_files"].description or ""
            assert "RE2" in grep
            assert "Python" not in grep
            refused = await fails(client, "sandbox_grep_files", "invalid", pattern="a(?=b)")
            assert "RE2" in refused, refused

    asyncio.run(main())


class Scheduler:
    """The scheduler's part for every pod of a namespace, on a full node:
    PodScheduled False, Unschedulable, for want of CPU."""

    MESSAGE = "0/1 nodes are available: 1 Insufficient cpu."

    def __init__(self, control_plane: ControlPlane, ns: str) -> None:
        self.kube = KubeJSON(control_plane.kubeconfig)
        self.ns = ns
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        done: set[str] = set()
        while not self.stop.is_set():
            for pod in self.kube.list(core_path("pods", self.ns)):
                if pod["metadata"]["uid"] not in done:
                    Node(self.kube).unschedulable(self.ns, pod["metadata"]["name"], self.MESSAGE)
                    done.add(pod["metadata"]["uid"])
            self.stop.wait(0.2)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.kube.close()


def test_a_sandbox_that_cannot_be_scheduled_is_reported_while_waiting(
    control_plane: ControlPlane, kubeconfig: Path, gateway: GatewayProcess, ns: str
) -> None:
    """The first call's wait for its sandbox is not silent: progress
    notifications carry the Ready condition's reason as it changes, and the
    wait ends at --ready-timeout (60 s by default, as documented) with it."""
    scheduler = Scheduler(control_plane, ns)
    scheduler.thread.start()
    seen: list[tuple[str, float]] = []

    async def progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((message or "", time.monotonic()))

    async def main() -> None:
        async with _stdio(
            kubeconfig, gateway, ns, "--on-end=destroy", "--ready-timeout=12"
        ) as client:
            began = time.monotonic()
            result = await client.call_tool(
                "sandbox_read_file", {"path": "x.txt"}, progress_callback=progress
            )
            ended = time.monotonic()
            assert result.is_error
            assert text(result).startswith("not_ready: "), text(result)
            assert "Insufficient cpu" in text(result)
            assert "call again" in text(result)
            assert 12 <= ended - began < 40
            told = [at for message, at in seen if "Insufficient cpu" in message]
            assert told, seen
            # Said while waiting, long before the end.
            assert told[0] < ended - 5, (told[0] - began, ended - began)

    try:
        asyncio.run(main())
    finally:
        scheduler.close()


def test_a_command_cut_off_by_a_server_restart_is_listed_and_reattached(
    kubeconfig: Path, gateway: GatewayProcess, ns: str, node_player: NodePlayer, kube: KubeJSON
) -> None:
    """The server goes away under a running command (the client restarts it):
    the command runs on, and the same session key finds it, reads it while it
    runs and re-attaches to its end, so a model need not run it twice."""
    # It runs until the second session lets it end (at most 5 minutes): however
    # long the restart takes on a busy machine, the command is still running.
    script = (
        "echo begun; for i in $(seq 1500); do [ -e release ] && break; sleep 0.2; done;"
        " echo finished; echo $RANDOM >> runs.txt"
    )

    async def first() -> None:
        async with _stdio(kubeconfig, gateway, ns, "--session=cut-1") as client:
            begun = asyncio.Event()

            async def progress(progress: float, total: float | None, message: str | None) -> None:
                if "begun" in (message or ""):
                    begun.set()

            call = asyncio.create_task(
                client.call_tool(
                    "sandbox_run_command", {"command": script}, progress_callback=progress
                )
            )
            await asyncio.wait_for(begun.wait(), 120)
            call.cancel()  # the client goes, and its server with it

    async def again() -> None:
        async with _stdio(kubeconfig, gateway, ns, "--session=cut-1") as client:
            listing = await ok(client, "sandbox_list_commands")
            [line] = [x for x in listing.splitlines() if "release" in x]
            assert "  running  " in line, listing
            command_id = line.split()[0]
            assert await ok(client, "sandbox_list_commands", status="completed") == (
                "no commands completed"
            )
            running = await ok(client, "sandbox_command_output", id=command_id, wait_seconds=0)
            assert running.startswith(f"command {command_id} is still running"), running
            assert running.endswith("output so far:\nbegun")
            await ok(client, "sandbox_write_file", path="release", content="")
            out = await ok(client, "sandbox_command_output", id=command_id, wait_seconds=60)
            assert out == "exit code: 0\nstdout:\nbegun\nfinished\n", out
            # It ran once, to its end.
            assert len((await ok(client, "sandbox_read_file", path="runs.txt")).splitlines()) == 1
            listing = await ok(client, "sandbox_list_commands")
            assert f"{command_id}  completed (exit code 0)" in listing, listing
            await fails(client, "sandbox_command_output", "not_found", id="no-such-command")

    asyncio.run(first())
    [name] = session_sandboxes(kube, ns)
    # Not paused under its command by the end of the first server's session.
    assert (kube.get(f"{SANDBOXES.format(ns=ns)}/{name}") or {})["spec"].get("paused") is not True
    asyncio.run(again())


def test_stdio_session_resumes_after_the_server_restarts(
    kubeconfig: Path, gateway: GatewayProcess, ns: str, node_player: NodePlayer, kube: KubeJSON
) -> None:
    upload = kubeconfig.parent / "data.csv"
    upload.write_text("a,b\n1,2\n")

    async def first() -> None:
        async with _stdio(
            kubeconfig, gateway, ns, "--session=chat-1", f"--upload={upload}"
        ) as client:
            # The host's file is in ./user-uploads/ from the first call on.
            assert await ok(client, "sandbox_read_file", path="user-uploads/data.csv") == (
                "1\ta,b\n2\t1,2"
            )
            await ok(client, "sandbox_write_file", path="notes.txt", content="kept\n")
            # "Installed" into $HOME, the workspace: a package manager's --user place.
            await ok(
                client,
                "sandbox_run_command",
                command="mkdir -p .local/bin && printf '#!/bin/sh\\necho tool ran\\n'"
                " > .local/bin/tool && chmod +x .local/bin/tool",
            )

    asyncio.run(first())
    [name] = session_sandboxes(kube, ns)
    # The default end of a session: paused, workspace kept.
    wait_for(
        lambda: (
            ((kube.get(f"{SANDBOXES.format(ns=ns)}/{name}") or {}).get("status") or {}).get("phase")
            == "Paused"
        ),
        60,
        "the sandbox paused at session end",
    )

    def pause(sandbox: str) -> None:
        path = f"{SANDBOXES.format(ns=ns)}/{sandbox}"
        kube.patch(path, {"spec": {"paused": True}})
        wait_for(
            lambda: ((kube.get(path) or {}).get("status") or {}).get("phase") == "Paused",
            60,
            "paused",
        )

    async def again() -> None:
        async with _stdio(kubeconfig, gateway, ns, "--session=chat-1") as client:
            assert await ok(client, "sandbox_read_file", path="notes.txt") == "1\tkept"
            out = await ok(client, "sandbox_run_command", command=".local/bin/tool")
            assert "tool ran" in out
            # Paused behind the session's back (as its idle policy does): the
            # next call finds it paused, resumes it and goes on.
            await asyncio.to_thread(pause, name)
            assert await ok(client, "sandbox_read_file", path="notes.txt") == "1\tkept"
        async with _stdio(kubeconfig, gateway, ns, "--session=chat-2") as client:
            await fails(client, "sandbox_read_file", "not_found", path="notes.txt")

    asyncio.run(again())
    assert len(session_sandboxes(kube, ns)) == 2
    assert name in session_sandboxes(kube, ns)


def test_http_refuses_callers_without_credentials(http_server: HttpServer) -> None:
    init = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "0"},
        },
    }
    accept = {"Accept": "application/json, text/event-stream"}
    bare = httpx.post(http_server.url, json=init, headers=accept, timeout=30)
    assert bare.status_code == 401
    assert bare.headers["www-authenticate"] == "Bearer"
    wrong = httpx.post(
        http_server.url,
        json=init,
        headers={**accept, "Authorization": "Bearer nonsense"},
        timeout=30,
    )
    assert wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "unauthorized"


def _raw_call(
    server: HttpServer, token: str, session_id: str, tool: str, args: dict[str, Any]
) -> Any:
    """A tools/call on an existing MCP session, as a client that reconnected sends it."""
    response = httpx.post(
        server.url,
        json={
            "jsonrpc": "2.0",
            "id": 7,
            "method": "tools/call",
            "params": {"name": tool, "arguments": args},
        },
        headers={
            "Authorization": f"Bearer {token}",
            "Mcp-Session-Id": session_id,
            "MCP-Protocol-Version": "2025-11-25",
            "Accept": "application/json, text/event-stream",
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    for line in response.text.splitlines():
        if line.startswith("data: ") and '"id":7' in line.replace(" ", ""):
            return json.loads(line[6:])["result"]
    return response.json()["result"]


def test_http_sessions_are_separate_and_resume(
    http_server: HttpServer,
    kube: KubeJSON,
    ns: str,
    alice: str,
    node_player: NodePlayer,
) -> None:
    bob = caller(kube, ns, "bob", "user")
    eve = caller(kube, ns, "eve", None)

    async def one(i: int) -> str:
        async with http_server.client(alice) as client:
            await ok(client, "sandbox_write_file", path="mine.txt", content=f"session {i}\n")
            listing = await ok(client, "sandbox_list_directory")
            assert listing == "mine.txt  (10 bytes)", listing
            return await ok(
                client, "sandbox_run_command", command="cat mine.txt; hostname -I || true"
            )

    async def main() -> None:
        # Five concurrent sessions: five sandboxes, each seeing only its own file.
        outs = await asyncio.gather(*(one(i) for i in range(5)))
        for i, out in enumerate(outs):
            assert f"session {i}\n" in out
        assert len(session_sandboxes(kube, ns)) == 5

        # A client that disconnects without ending its session and comes back
        # with the same Mcp-Session-Id finds its sandbox as it was.
        ids: list[str] = []

        async def keep(response: httpx2.Response) -> None:
            if "mcp-session-id" in response.headers:
                ids.append(response.headers["mcp-session-id"])

        headers = {"Authorization": f"Bearer {alice}"}
        http = httpx2.AsyncClient(headers=headers, event_hooks={"response": [keep]})
        client = Client(
            streamable_http_client(http_server.url, http_client=http, terminate_on_close=False),
            mode="legacy",
        )
        async with client:
            await ok(client, "sandbox_write_file", path="before.txt", content="still here\n")
        result = await asyncio.to_thread(
            _raw_call, http_server, alice, ids[0], "sandbox_read_file", {"path": "before.txt"}
        )
        assert result["content"][0]["text"] == "1\tstill here"

        # A session key the client keeps resumes across MCP sessions.
        async with http_server.client(alice, session="project-x") as client:
            await ok(client, "sandbox_write_file", path="x.txt", content="x\n")
        uploaded = await asyncio.to_thread(
            httpx.put,
            http_server.url.replace("/mcp", "/uploads"),
            params={"name": "../report.txt"},
            content=b"from the host\n",
            headers={"Authorization": f"Bearer {alice}", "X-Sandbox-Session": "project-x"},
            timeout=120,
        )
        assert uploaded.status_code == 200, uploaded.text
        assert uploaded.json() == {"path": "user-uploads/report.txt"}
        async with http_server.client(alice, session="project-x") as client:
            assert await ok(client, "sandbox_read_file", path="x.txt") == "1\tx"
            assert await ok(client, "sandbox_read_file", path="user-uploads/report.txt") == (
                "1\tfrom the host"
            )
        # Knowing alice's key does not give bob her sandbox: his own, empty one.
        async with http_server.client(bob, session="project-x") as client:
            await fails(client, "sandbox_read_file", "not_found", path="x.txt")
        # A caller without RBAC in the namespace is refused by Kubernetes itself.
        async with http_server.client(eve) as client:
            refused = await fails(client, "sandbox_list_directory", "forbidden")
            assert "RBAC" in refused

    asyncio.run(main())
