"""sandbox-mcp's tool schemas state the agent's and the gateway's own limits:
read here from the agent's OpenAPI document (generated from its code, kept
current by tests/unit/test_gateway.py), the agent's and the gateway's settings,
and the Snapshot model. A limit that moves there fails here until the schema
follows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args

from sandbox_mcp import tools

from sandbox_agent.config import Settings as AgentSettings
from sandbox_agent.models import ExecutionStatus
from sandbox_operator.api.snapshot import SnapshotSpec
from sandbox_operator.gateway.config import GatewaySettings

REPO = Path(__file__).resolve().parents[2]
OPENAPI = json.loads((REPO / "sandbox-agent/openapi.json").read_text())


def _agent(schema: str, field: str) -> dict[str, Any]:
    """A request body field's schema (the non-null branch of an optional one)."""
    prop: dict[str, Any] = OPENAPI["components"]["schemas"][schema]["properties"][field]
    return next((s for s in prop.get("anyOf", []) if s.get("type") != "null"), prop)


def _parameter(path: str, name: str) -> dict[str, Any]:
    [param] = [p for p in OPENAPI["paths"][path]["get"]["parameters"] if p["name"] == name]
    schema: dict[str, Any] = param["schema"]
    return schema


def _mcp(tool: str, argument: str) -> dict[str, Any]:
    schema: dict[str, Any] = tools.BY_NAME[tool].schema["properties"][argument]
    return schema


def test_the_tool_schemas_state_the_agents_limits() -> None:
    depth = _parameter("/v1/files/list", "depth")
    assert _mcp("sandbox_list_directory", "depth")["maximum"] == depth["maximum"] == 64
    assert _mcp("sandbox_list_directory", "depth")["minimum"] == depth["minimum"]
    # The agent cuts search and find results at its setting, whatever is asked.
    cap = AgentSettings().search_max_results
    assert _mcp("sandbox_grep_files", "max_results")["maximum"] == cap
    assert _mcp("sandbox_find_files", "max_results")["maximum"] == cap
    assert (
        _mcp("sandbox_grep_files", "pattern")["maxLength"]
        == (_agent("SearchRequest", "pattern")["maxLength"])
    )
    assert (
        _mcp("sandbox_grep_files", "glob")["maxLength"]
        == (_agent("SearchRequest", "glob")["maxLength"])
    )
    # The longest fuzzy query's glob fits the agent's find pattern.
    longest = "m" * _mcp("sandbox_find_files", "query")["maxLength"]
    assert len(tools.fuzzy_glob(longest)) <= _agent("FindRequest", "pattern")["maxLength"]
    assert len(tools.fuzzy_glob(longest + "m")) > _agent("FindRequest", "pattern")["maxLength"]
    assert (
        _mcp("sandbox_apply_patch", "strip")["maximum"]
        == (_agent("PatchRequest", "strip")["maximum"])
    )
    [put_mode] = [
        p for p in OPENAPI["paths"]["/v1/files/content"]["put"]["parameters"] if p["name"] == "mode"
    ]
    assert _mcp("sandbox_write_file", "mode")["pattern"] == put_mode["schema"]["pattern"]
    for tool in tools.TOOLS:
        for name, prop in tool.schema["properties"].items():
            if name in ("path", "cwd"):
                assert prop["maxLength"] == _agent("SearchRequest", "path")["maxLength"], tool
    # Timeouts are the SDK's (at most 1,800 s), within the agent's default maximum.
    assert _mcp("sandbox_run_command", "timeout_seconds")["maximum"] <= AgentSettings().max_timeout


def test_the_code_tool_states_the_agents_limits() -> None:
    assert (
        _mcp("sandbox_run_code", "code")["maxLength"] == _agent("CodeRequest", "code")["maxLength"]
    )
    assert (
        _mcp("sandbox_run_code", "context_id")["pattern"]
        == (_agent("CodeRequest", "contextId")["pattern"])
    )
    assert (
        _mcp("sandbox_run_code", "timeout_seconds")["maximum"]
        == (_agent("CodeRequest", "timeoutSeconds")["maximum"])
    )


def test_the_tool_schemas_state_the_gateways_and_the_snapshots_limits() -> None:
    assert _mcp("sandbox_download_url", "ttl_seconds")["maximum"] == (
        GatewaySettings().max_token_seconds
    )
    tag = SnapshotSpec.model_json_schema()["properties"]["tag"]
    tag = next((s for s in tag.get("anyOf", []) if s.get("type") == "string"), tag)
    assert _mcp("sandbox_snapshot", "tag")["pattern"] == tag["pattern"]
    assert _mcp("sandbox_snapshot", "tag")["maxLength"] == tag["maxLength"]


def test_the_listed_statuses_are_the_agents() -> None:
    assert set(tools.STATUSES) == set(get_args(ExecutionStatus))
    assert _mcp("sandbox_list_commands", "status")["enum"] == list(tools.STATUSES)
