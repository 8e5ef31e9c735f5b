"""sandbox-mcp's pure parts: tool schemas, fuzzy file names, session labels,
settings. Its behaviour against a cluster is in tests/integration/test_mcp.py."""

from __future__ import annotations

import fnmatch

import jsonschema  # type: ignore[import-untyped]  # the MCP SDK's own dependency
import pytest
from sandbox_mcp import settings, tools
from sandbox_mcp.sessions import session_label

from sandbox_sdk.errors import CommandLost


def test_every_tool_has_a_valid_schema_and_a_description() -> None:
    assert len({t.name for t in tools.TOOLS}) == len(tools.TOOLS) == 14
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
