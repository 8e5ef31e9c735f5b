"""sandbox-mcp's pure parts: tool schemas, fuzzy file names, session labels,
settings. Its behaviour against a cluster is in tests/integration/test_mcp.py."""

from __future__ import annotations

import fnmatch

import jsonschema  # type: ignore[import-untyped]  # the MCP SDK's own dependency
import pytest
from sandbox_mcp import settings, tools
from sandbox_mcp.sessions import session_label

from sandbox_sdk.errors import CommandLost, Forbidden


def test_every_tool_has_a_valid_schema_and_a_description() -> None:
    assert len({t.name for t in tools.TOOLS}) == len(tools.TOOLS) == 17
    for tool in tools.TOOLS:
        jsonschema.Draft202012Validator.check_schema(tool.schema)
        assert tool.schema["additionalProperties"] is False
        assert len(tool.description) > 40, tool.name
    run = tools.BY_NAME["sandbox_run_command"].schema["properties"]["timeout_seconds"]
    assert (run["default"], run["maximum"]) == (180.0, 1800.0)


@pytest.mark.parametrize(
    ("query", "matches", "misses"),
    [
        ("mdl", ["models.py", "MoDeL.txt"], ["dml.py", "md.py"]),
        ("main", ["main.py", "domain_map.c"], ["mian.py"]),
        ("a]b", ["a]b", "xa]yb"], ["ab"]),
        ("*.py", ["x.py"], ["x.pyc"]),
    ],
)
def test_a_fuzzy_query_is_a_glob_of_its_characters_in_order(
    query: str, matches: list[str], misses: list[str]
) -> None:
    glob = tools.fuzzy_glob(query)
    for name in matches:
        assert fnmatch.fnmatchcase(name, glob), (glob, name)
    for name in misses:
        assert not fnmatch.fnmatchcase(name, glob), (glob, name)


def test_contiguous_and_short_names_rank_first() -> None:
    paths = ["src/my_awesome_main_loop.py", "lib/deep/main.py", "main.py", "m_a_i_n.txt"]
    assert tools.fuzzy_rank("main", paths) == [
        "main.py",
        "lib/deep/main.py",
        "src/my_awesome_main_loop.py",
        "m_a_i_n.txt",
    ]


def test_a_session_label_depends_on_the_caller_and_the_key() -> None:
    alice = session_label("system:serviceaccount:ns:alice", "chat-1")
    assert alice == session_label("system:serviceaccount:ns:alice", "chat-1")
    assert alice != session_label("system:serviceaccount:ns:bob", "chat-1")
    assert alice != session_label("system:serviceaccount:ns:alice", "chat-2")
    assert len(alice) <= 63  # a label value


def test_settings_come_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOX_MCP_ON_END", "destroy")
    monkeypatch.setenv("SANDBOX_MCP_SESSION", "chat-9")
    parsed = settings.parse(["--runtime", "node", "--upload", "a.txt", "--upload", "b.txt"])
    assert (parsed.on_end, parsed.session, parsed.runtime) == ("destroy", "chat-9", "node")
    assert parsed.uploads == ("a.txt", "b.txt")
    assert settings.parse(["--on-end", "pause"]).on_end == "pause"
    with pytest.raises(SystemExit):
        settings.parse(["--on-end", "delete"])


def test_a_command_cut_by_a_restart_reads_as_interrupted() -> None:
    lost = CommandLost(
        "the command did not run to its end: the agent restarted", code="agent_restarted"
    )
    text = tools.failure(lost).text()
    assert text.startswith("interrupted: ")
    assert "agent_restarted" in text
    assert "may have partly run" in text


def test_a_command_that_could_not_start_does_not_read_as_partly_run() -> None:
    lost = CommandLost("the command did not run to its end: no such file", code="spawn_failed")
    text = tools.failure(lost).text()
    assert text.startswith("error: the command could not be started")
    assert "partly run" not in text


def test_arguments_are_checked_against_the_tools_schema() -> None:
    for tool in tools.TOOLS:
        # Each default is a value the schema itself accepts.
        defaults = {k: p["default"] for k, p in tool.schema["properties"].items() if "default" in p}
        required = {k: "x" for k in tool.schema["required"]}
        assert tools.check(tool.name, {**required, **defaults}) is tool
    with pytest.raises(tools.ToolFailure) as refused:
        tools.check("sandbox_write_file", {"path": "a", "contents": "b", "mode": "999"})
    assert refused.value.kind == "invalid"
    assert refused.value.message.startswith(
        "missing argument 'content'; unknown argument 'contents'; argument 'mode' does not match"
    )
    with pytest.raises(tools.ToolFailure, match="characters long; it takes at most 131071"):
        tools.check("sandbox_run_command", {"command": "x" * 200_000})


def test_binary_is_a_nul_or_bytes_that_are_no_utf8() -> None:
    assert tools.is_binary(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    assert tools.is_binary(b"\xff\xfe latin-1 \xe9t\xe9")
    assert not tools.is_binary("café \ufffd\n".encode())
    # A character cut at the probe's end is no sign of binary.
    assert not tools.is_binary(("a" * (tools.BINARY_PROBE - 1) + "é").encode())


def test_only_kubernetes_refusals_mention_rbac() -> None:
    escape = Forbidden("path resolves outside the workspace", status=403, code="path_escape")
    assert "RBAC" not in tools.failure(escape).text()
    assert "outside the workspace" in tools.failure(escape).text()
    denied = Forbidden("sandboxes/exec is not allowed", status=403, code="forbidden")
    assert "RBAC" in tools.failure(denied).text()


def test_a_call_waits_for_its_sandbox_as_long_as_documented() -> None:
    # docs/mcp.md: "a call's wait for the session's sandbox ... 60 s" (the SDK's is 180 s).
    assert settings.parse([]).ready_timeout == 60.0
    assert settings.parse(["--ready-timeout", "5"]).ready_timeout == 5.0
