"""The E2B control plane through E2B's own Python SDK (`e2b`, pinned), unchanged:
create, info, list with metadata filters, the lease (set_timeout, its end),
pause and connect, kill; API keys (a ServiceAccount token, an `e2b_` key
minted on the gateway, a wrong key, another namespace's key, a revoked key);
a template that does not exist.

Which gateway it talks to: the `e2b_target` fixture (tests/e2e/e2b.py).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import e2b
import httpx
import pytest
from e2b import Sandbox, SandboxQuery, SandboxState

from tests.e2e.e2b_support import E2BTarget
from tests.integration.harness import wait_for
from tests.kube import core_path

pytestmark = pytest.mark.timeout(900)


@dataclass
class Team:
    """A namespace with a user (the chart's user role) and a key of it."""

    ns: str
    key: str
    opts: dict[str, Any]


def _team(target: E2BTarget) -> Team:
    ns = target.namespace()
    target.account(ns, "worker")
    target.account(ns, "keymaster", "edit")  # may create serviceaccounts/token
    minted = target.mint(ns, "worker", target.token(ns, "keymaster"))
    assert minted["key"].startswith("e2b_")
    assert len(minted["key"]) == 44
    return Team(ns, minted["key"], target.opts(minted["key"]))


def test_create_info_list_lease_kill(e2b_target: E2BTarget) -> None:
    team = _team(e2b_target)
    tag = uuid.uuid4().hex
    started = time.monotonic()
    sbx = Sandbox.create(
        e2b_target.template,
        timeout=300,
        metadata={"suite": tag, "odd key": "a/b c"},
        envs={"GREETING": "hello"},
        **team.opts,
    )
    print(f"Sandbox.create: {time.monotonic() - started:.2f} s")
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert info.state == SandboxState.RUNNING
    assert info.metadata == {"suite": tag, "odd key": "a/b c"}
    # The timeout from when it could first be used; a warm claim keeps its first
    # lease, which allows up to 2 s for the claim.
    assert timedelta(seconds=250) < info.end_at - datetime.now(UTC) <= timedelta(seconds=302)
    # The ID is the Sandbox's name, in the key's namespace; the lease is on it.
    body = e2b_target.sandbox(team.ns, sbx.sandbox_id)
    assert body is not None
    assert body["metadata"]["labels"]["sandbox.dev/e2b"] == "true"
    assert body["spec"]["lifecycle"]["onExpiry"] == "Delete"
    assert body["spec"]["env"] == [{"name": "GREETING", "value": "hello"}]

    for metadata in ({"suite": tag}, {"odd key": "a/b c"}, {"suite": tag, "odd key": "a/b c"}):
        found = Sandbox.list(query=SandboxQuery(metadata=metadata), **team.opts).next_items()
        assert [s.sandbox_id for s in found] == [sbx.sandbox_id], metadata
    none = Sandbox.list(query=SandboxQuery(metadata={"suite": "other"}), **team.opts)
    assert none.next_items() == []
    paused = SandboxQuery(metadata={"suite": tag}, state=[SandboxState.PAUSED])
    assert Sandbox.list(query=paused, **team.opts).next_items() == []

    # set_timeout moves the end either way: here, sooner.
    sbx.set_timeout(120)
    shorter = sbx.get_info().end_at
    assert shorter < info.end_at
    body = e2b_target.sandbox(team.ns, sbx.sandbox_id)
    assert body is not None
    assert body["spec"]["lifecycle"]["expiresAt"] == shorter.strftime("%Y-%m-%dT%H:%M:%SZ")

    metrics = sbx.get_metrics()
    assert len(metrics) == 1
    assert metrics[0].cpu_count >= 1
    assert metrics[0].mem_total > 0

    assert sbx.kill() is True
    assert Sandbox.kill(sbx.sandbox_id, **team.opts) is False
    with pytest.raises(e2b.NotFoundException):
        Sandbox.get_info(sbx.sandbox_id, **team.opts)
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": tag}), **team.opts).next_items() == []


def test_pages_of_the_list(e2b_target: E2BTarget) -> None:
    team = _team(e2b_target)
    tag = uuid.uuid4().hex
    first = Sandbox.create(e2b_target.template, timeout=300, metadata={"suite": tag}, **team.opts)
    second = Sandbox.create(e2b_target.template, timeout=300, metadata={"suite": tag}, **team.opts)
    paginator = Sandbox.list(query=SandboxQuery(metadata={"suite": tag}), limit=1, **team.opts)
    page = paginator.next_items()
    assert [s.sandbox_id for s in page] == [second.sandbox_id]  # newest first
    assert paginator.has_next
    page = paginator.next_items()
    assert [s.sandbox_id for s in page] == [first.sandbox_id]
    assert not paginator.has_next
    for sbx in (first, second):
        sbx.kill()


def test_pause_then_connect(e2b_target: E2BTarget) -> None:
    team = _team(e2b_target)
    sbx = Sandbox.create(e2b_target.template, timeout=120, **team.opts)
    assert sbx.is_running()
    assert sbx.pause() is True
    assert sbx.get_info().state == SandboxState.PAUSED
    assert Sandbox.pause(sbx.sandbox_id, **team.opts) is False  # 409: paused already
    listed = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED]), **team.opts)
    assert [s.sandbox_id for s in listed.next_items()] == [sbx.sandbox_id]
    assert not sbx.is_running()

    resumed = Sandbox.connect(sbx.sandbox_id, timeout=600, **team.opts)
    assert resumed.sandbox_id == sbx.sandbox_id
    info = resumed.get_info()
    assert info.state == SandboxState.RUNNING
    assert info.end_at - datetime.now(UTC) > timedelta(seconds=500)
    assert resumed.is_running()
    # Connecting to a running one never shortens its lease.
    Sandbox.connect(sbx.sandbox_id, timeout=10, **team.opts)
    assert resumed.get_info().end_at == info.end_at
    resumed.kill()


def test_the_lease_ends_with_a_pause_then_connect_resumes(e2b_target: E2BTarget) -> None:
    team = _team(e2b_target)
    sbx = Sandbox.create(
        e2b_target.template, timeout=5, lifecycle={"on_timeout": "pause"}, **team.opts
    )
    assert sbx.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
    wait_for(lambda: sbx.get_info().state == SandboxState.PAUSED, 30, "paused at the lease's end")
    assert not sbx.is_running()
    # The operator pauses it by itself (idlePausedAt), gateway or not.
    wait_for(
        lambda: ((e2b_target.sandbox(team.ns, sbx.sandbox_id) or {}).get("status") or {}).get(
            "idlePausedAt"
        ),
        120,
        "the operator's pause at the lease end",
    )
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=300, **team.opts)
    assert resumed.get_info().state == SandboxState.RUNNING
    assert resumed.is_running()
    resumed.kill()


def test_the_lease_ends_with_a_delete(e2b_target: E2BTarget) -> None:
    team = _team(e2b_target)
    sbx = Sandbox.create(e2b_target.template, timeout=30, **team.opts)
    sbx.set_timeout(1)
    time.sleep(2)
    # Over for E2B at once; deleted by the operator on its next pass.
    with pytest.raises(e2b.NotFoundException):
        sbx.get_info()
    assert not sbx.is_running()
    wait_for(lambda: sbx.sandbox_id not in e2b_target.sandboxes(team.ns), 120, "deleted")


def test_keys_and_namespaces(e2b_target: E2BTarget) -> None:
    team, other = _team(e2b_target), _team(e2b_target)
    sbx = Sandbox.create(e2b_target.template, timeout=300, **team.opts)

    # A wrong key: 401, whatever it names.
    for wrong in ("e2b_" + "0" * 40, "not-a-token"):
        with pytest.raises(e2b.AuthenticationException):
            Sandbox.list(**e2b_target.opts(wrong)).next_items()
        with pytest.raises(e2b.AuthenticationException):
            Sandbox.get_info(sbx.sandbox_id, **e2b_target.opts(wrong))

    # Another namespace's key: the sandbox does not exist there.
    with pytest.raises(e2b.NotFoundException):
        Sandbox.get_info(sbx.sandbox_id, **other.opts)
    assert Sandbox.kill(sbx.sandbox_id, **other.opts) is False
    with pytest.raises(e2b.NotFoundException):
        Sandbox.connect(sbx.sandbox_id, **other.opts)
    assert Sandbox.list(**other.opts).next_items() == []
    assert sbx.get_info().sandbox_id == sbx.sandbox_id

    # A ServiceAccount's own token is a key too, in its own namespace.
    token = e2b_target.token(team.ns, "worker")
    assert [s.sandbox_id for s in Sandbox.list(**e2b_target.opts(token)).next_items()] == [
        sbx.sandbox_id
    ]
    # RBAC decides: a ServiceAccount without the user role may not create.
    e2b_target.account(team.ns, "bystander", None)
    bystander = e2b_target.opts(e2b_target.token(team.ns, "bystander"))
    with pytest.raises(e2b.SandboxException, match="403"):
        Sandbox.create(e2b_target.template, **bystander)

    # Revoked: the key stops working (at once on the replica that revoked it,
    # within the gateway's e2b_key_seconds on the others).
    minter = e2b_target.token(team.ns, "keymaster")
    listed = httpx.get(
        f"{e2b_target.gateway}/v1/namespaces/{team.ns}/e2bkeys",
        headers={"Authorization": f"Bearer {minter}"},
    ).json()["items"]
    assert [k["serviceAccount"] for k in listed] == ["worker"]
    revoked = httpx.delete(
        f"{e2b_target.gateway}/v1/namespaces/{team.ns}/e2bkeys/{listed[0]['id']}",
        headers={"Authorization": f"Bearer {minter}"},
    )
    assert revoked.status_code == 204, revoked.text

    def refused() -> bool:
        try:
            Sandbox.list(**team.opts).next_items()
        except e2b.AuthenticationException:
            return True
        return False

    wait_for(refused, 30, "the revoked key refused")
    Sandbox.kill(sbx.sandbox_id, **e2b_target.opts(token))

    # A key whose ServiceAccount is deleted never works again: the list says so.
    e2b_target.account(team.ns, "fleeting", None)
    e2b_target.mint(team.ns, "fleeting", minter)
    e2b_target.kube.delete(core_path("serviceaccounts", team.ns, "fleeting"))
    listed = httpx.get(
        f"{e2b_target.gateway}/v1/namespaces/{team.ns}/e2bkeys",
        headers={"Authorization": f"Bearer {minter}"},
    ).json()["items"]
    assert [(k["serviceAccount"], k["state"]) for k in listed] == [("fleeting", "Orphaned")]
    assert "no longer exists" in listed[0]["reason"], listed


def test_a_template_that_does_not_exist(e2b_target: E2BTarget) -> None:
    team = _team(e2b_target)
    with pytest.raises(e2b.SandboxException, match="not found") as caught:
        Sandbox.create("no-such-template", **team.opts)
    assert "404" in str(caught.value)
    with pytest.raises(e2b.SandboxException, match="400"):
        Sandbox.create(e2b_target.template, timeout=10**7, **team.opts)
    assert e2b_target.sandboxes(team.ns) == []
