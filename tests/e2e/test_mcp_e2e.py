"""sandbox-mcp as the chart deploys it (`mcp.enabled=true`) on the real node:
the MCP client reaches its pod with a user's ServiceAccount token, and a
session's sandbox runs on the node; without the token the server answers 401."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import TextContent

from devcluster import deploy
from tests.e2e.conftest import E2E, E2E_RECONCILE
from tests.integration.harness import service_account_token, wait_for
from tests.kube import api_path, core_path

pytestmark = pytest.mark.timeout(900)
SELECTOR = "app.kubernetes.io/name=sandbox-mcp"


def _user(e2e: E2E, ns: str) -> str:
    """A ServiceAccount bound to the chart's user role in `ns`, and its token."""
    rbac = "rbac.authorization.k8s.io/v1"
    e2e.kube.create(core_path("serviceaccounts", ns), {"metadata": {"name": "agent"}})
    e2e.kube.create(
        api_path(rbac, "rolebindings", ns),
        {
            "metadata": {"name": "agent-user"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": f"{deploy.RELEASE}-user",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "agent", "namespace": ns}],
        },
    )
    return service_account_token(e2e.kube, ns, "agent", seconds=3600)


def _pod_url(e2e: E2E) -> str | None:
    pods = e2e.kube.list(core_path("pods", deploy.NAMESPACE), label_selector=SELECTOR)
    for pod in pods:
        status = pod.get("status") or {}
        ready = any(
            c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or []
        )
        if ready and status.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
            return f"http://{status['podIP']}:8080/mcp"
    return None


@pytest.fixture
def mcp_url(e2e: E2E) -> Iterator[tuple[str, str]]:
    ns = e2e.namespace()
    mcp = ["mcp.enabled=true", f"mcp.namespace={ns}", "mcp.onEnd=destroy"]
    deploy.install_operator(e2e.cluster, extra_values=[E2E_RECONCILE, *mcp])
    try:
        yield wait_for(lambda: _pod_url(e2e), 180, "the mcp pod Ready"), ns
    finally:
        deploy.install_operator(e2e.cluster, extra_values=[E2E_RECONCILE])


def test_the_charts_mcp_server_runs_a_session_on_the_node(
    e2e: E2E, mcp_url: tuple[str, str]
) -> None:
    url, ns = mcp_url
    bare = httpx.post(url, json={}, headers={"Accept": "application/json"}, timeout=30)
    assert bare.status_code == 401
    token = _user(e2e, ns)

    async def main() -> list[str]:
        http = httpx2.AsyncClient(
            headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(60, read=600)
        )
        async with Client(streamable_http_client(url, http_client=http), mode="legacy") as client:
            out = []
            for tool, args in (
                ("sandbox_write_file", {"path": "hello.py", "content": "print(6 * 7)\n"}),
                ("sandbox_run_command", {"command": "python3 hello.py; whoami"}),
                ("sandbox_read_file", {"path": "hello.py"}),
            ):
                for _ in range(5):
                    result = await client.call_tool(tool, args)
                    text = "".join(c.text for c in result.content if isinstance(c, TextContent))
                    # A call waits 60 s for its sandbox, then says so; as a model
                    # would, call again (a busy node can take longer to start it).
                    if not (result.is_error and "not_ready" in text):
                        break
                assert not result.is_error, f"{tool}: {text}"
                out.append(text)
            # A snapshot, a change, and the rollback to it.
            snapped = await client.call_tool("sandbox_snapshot", {"tag": "v1"})
            assert not snapped.is_error, snapped.content
            name = "".join(c.text for c in snapped.content if isinstance(c, TextContent)).split()[1]
            changed = await client.call_tool(
                "sandbox_write_file", {"path": "hello.py", "content": "print(0)\n"}
            )
            assert not changed.is_error, changed.content
            restored = await client.call_tool("sandbox_restore", {"snapshot": name})
            assert not restored.is_error, restored.content
            again = await client.call_tool("sandbox_read_file", {"path": "hello.py"})
            out.append("".join(c.text for c in again.content if isinstance(c, TextContent)))
            return out

    wrote, ran, read, after_restore = asyncio.run(main())
    assert wrote == "wrote 13 bytes to hello.py"
    assert ran.startswith("exit code: 0\nstdout:\n42\n")
    assert read == "1\tprint(6 * 7)"
    assert after_restore == "1\tprint(6 * 7)"
    # The session ended (the client's DELETE): --on-end=destroy removed its sandbox.
    wait_for(
        lambda: e2e.kube.list(api_path("sandbox.dev/v1alpha1", "sandboxes", ns)) == [],
        120,
        "the session's sandbox destroyed",
    )
