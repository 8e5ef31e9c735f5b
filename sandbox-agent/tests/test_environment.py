"""The environment overlay: new commands see it, running ones keep theirs."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import Sandbox, wait_until

SHOW = 'echo "FOO=${FOO-none} DROP=${DROP-none} KEEP=${KEEP-none}"'


def _hash(env: dict[str, str], unset: list[str]) -> str:
    canonical = json.dumps(
        {"env": env, "unset": sorted(unset)}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def _put(sb: Sandbox, body: dict[str, Any]) -> dict[str, Any]:
    r = sb.client.put("/v1/environment", json=body)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def test_overlay_applies_to_new_commands_only(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(runner=False)
    sb.start_runner(extra_env={"KEEP": "k", "DROP": "d"})
    empty = sb.client.get("/v1/environment").json()
    assert empty == {"env": {}, "unset": [], "hash": _hash({}, [])}
    assert empty["hash"] == hashlib.sha256(b'{"env":{},"unset":[]}').hexdigest()
    assert sb.client.get("/v1/info").json()["environmentHash"] == empty["hash"]

    before = sb.run(expect=202, command=f"sleep 1; {SHOW}", background=True)
    wait_until(lambda: sb.client.get(f"/v1/executions/{before['id']}").json()["pid"])
    activity = sb.client.get("/v1/info").json()["lastActivity"]
    time.sleep(0.05)
    env = {"FOO": "new value é", "PATH_EXTRA": "/opt/x"}
    put = _put(sb, {"env": env, "unset": ["DROP"]})
    assert put == {"env": env, "unset": ["DROP"], "hash": _hash(env, ["DROP"])}
    assert sb.client.get("/v1/environment").json() == put
    info = sb.client.get("/v1/info").json()
    assert info["environmentHash"] == put["hash"]
    assert info["lastActivity"] == activity  # the operator's PUT is not user activity

    assert sb.sh(SHOW)["stdout"] == "FOO=new value é DROP=none KEEP=k\n"
    assert sb.sh(SHOW, env={"FOO": "mine", "DROP": "back"})["stdout"] == (
        "FOO=mine DROP=back KEEP=k\n"  # the request's own env wins
    )
    assert sb.wait_finished(before["id"])["stdout"] == "FOO=none DROP=d KEEP=k\n"

    # an agent restart keeps the overlay (it lives in the log dir)
    assert sb.agent is not None
    sb.agent.terminate()
    sb.agent.wait(10)
    sb.start_agent()
    wait_until(lambda: sb.anon.get("/readyz").status_code == 200)
    assert sb.client.get("/v1/environment").json() == put
    assert sb.client.get("/v1/info").json()["environmentHash"] == put["hash"]
    assert sb.sh(SHOW)["stdout"] == "FOO=new value é DROP=none KEEP=k\n"

    # a PUT replaces the whole overlay: no merge
    again = _put(sb, {"env": {"KEEP": "changed"}})
    assert again == {
        "env": {"KEEP": "changed"},
        "unset": [],
        "hash": _hash({"KEEP": "changed"}, []),
    }
    assert sb.sh(SHOW)["stdout"] == "FOO=none DROP=d KEEP=changed\n"
    assert _put(sb, {})["hash"] == empty["hash"]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"env": {"1ABC": "x"}}, 400, "invalid_request"),
        ({"env": {"A=B": "x"}}, 400, "invalid_request"),
        ({"env": {"": "x"}}, 400, "invalid_request"),
        ({"env": {"A": "x\u0000y"}}, 400, "invalid_request"),
        ({"env": {"A": 1}}, 400, "invalid_request"),
        ({"unset": ["ok", "not ok"]}, 400, "invalid_request"),
        ({"unset": ["A", "A"]}, 400, "invalid_environment"),
        ({"env": {f"V{i}": "x" for i in range(1001)}}, 400, "invalid_request"),
        ({"env": {"A": "x" * ((128 << 10) + 1)}}, 400, "invalid_request"),
        ({"env": {f"V{i}": "x" * 60_000 for i in range(5)}}, 413, "environment_too_large"),
        ({"env": {}, "other": 1}, 400, "invalid_request"),
    ],
)
def test_bad_overlays_are_refused(
    sandbox: Sandbox, body: dict[str, Any], status: int, code: str
) -> None:
    before = sandbox.client.get("/v1/environment").json()
    r = sandbox.client.put("/v1/environment", json=body)
    assert sandbox.error(r, status) == code
    assert sandbox.client.get("/v1/environment").json() == before  # nothing changed


def test_environment_needs_the_token(sandbox: Sandbox) -> None:
    assert sandbox.anon.get("/v1/environment").status_code == 401
    assert sandbox.anon.put("/v1/environment", json={}).status_code == 401
