"""Authentication (fail closed, constant time) and start-up refusal."""

from __future__ import annotations

import hmac
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import PY, Sandbox

from sandbox_agent import auth as agent_auth

PROTECTED = [
    ("GET", "/v1/info"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("POST", "/v1/executions"),
    ("POST", "/v1/executions/stream"),
    ("GET", "/v1/executions"),
    ("GET", "/v1/executions/x"),
    ("POST", "/v1/executions/x/cancel"),
    ("GET", "/v1/files/content?path=a"),
    ("PUT", "/v1/files/content?path=a"),
    ("GET", "/v1/files/list"),
    ("POST", "/v1/files/remove"),
    ("GET", "/v1/files/archive"),
    ("POST", "/v1/workspace/sync"),
    ("GET", "/no/such/route"),
]


@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_missing_token_refused(sandbox: Sandbox, method: str, path: str) -> None:
    r = sandbox.anon.request(method, path, content=b"{}")
    assert sandbox.error(r, 401) == "unauthorized"
    assert r.headers["www-authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "header",
    [
        "Bearer",
        "Bearer {token} {token}",
        "bearer",
        "Basic dXNlcjpwYXNz",
        "Token {token}",
        "Bearer {token}x",
        "Bearer x{token}",
        "Bearer {wrong_same_length}",
        "Bearer {prefix}",
        "Bearer a",
        "{token}",
    ],
)
def test_wrong_tokens_refused(sandbox: Sandbox, header: str) -> None:
    t = sandbox.token
    wrong_same_length = ("A" if t[0] != "A" else "B") + t[1:]
    value = header.format(token=t, wrong_same_length=wrong_same_length, prefix=t[:-1])
    assert len(wrong_same_length) == len(t)
    r = sandbox.anon.post(
        "/v1/executions",
        json={"command": "touch /tmp/should-not-run"},
        headers={"Authorization": value},
    )
    assert sandbox.error(r, 401) == "unauthorized"


def test_right_token_accepted_case_insensitive_scheme(sandbox: Sandbox) -> None:
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = sandbox.anon.get("/v1/info", headers={"Authorization": f"{scheme} {sandbox.token}"})
        assert r.status_code == 200


def test_health_endpoints_are_public(sandbox: Sandbox) -> None:
    assert sandbox.anon.get("/healthz").json() == {"status": "ok"}
    r = sandbox.anon.get("/readyz")
    assert r.status_code == 200 and r.json()["status"] == "ready"


def test_token_check_uses_compare_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, Any]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr("sandbox_agent.auth.hmac.compare_digest", spy)
    token = b"s3cr3t-token-value-0123456789"
    assert agent_auth.token_matches(b"Bearer " + token, token)
    assert not agent_auth.token_matches(b"Bearer " + token[:-1] + b"X", token)  # same length
    assert not agent_auth.token_matches(b"Bearer short", token)  # different length
    assert not agent_auth.token_matches(None, token)
    assert not agent_auth.token_matches(b"Basic " + token, token)
    assert calls == [(token, token), (token[:-1] + b"X", token), (b"short", token)]


def _start(env: dict[str, str], tmp: Path) -> subprocess.CompletedProcess[str]:
    base = {
        "PATH": os.environ["PATH"],
        "SANDBOX_AGENT_HOST": "127.0.0.1",
        "SANDBOX_AGENT_PORT": "1",
        "SANDBOX_AGENT_WORKSPACE": str(tmp),
        "SANDBOX_AGENT_RUNTIME_DIR": str(tmp / "run"),
        "SANDBOX_AGENT_LOG_DIR": str(tmp / "logs"),
    }
    return subprocess.run(
        [PY, "-m", "sandbox_agent"], env={**base, **env}, capture_output=True, text=True, timeout=30
    )


@pytest.mark.parametrize(
    ("token_content", "env_extra", "message"),
    [
        (None, {}, "SANDBOX_AGENT_TOKEN_FILE is not set"),
        (None, {"SANDBOX_AGENT_TOKEN_FILE": "/nonexistent/token"}, "cannot read token file"),
        ("", None, "is empty"),
        ("  \n", None, "is empty"),
        ("short", None, "shorter than 16"),
    ],
)
def test_refuses_to_start_without_a_token(
    tmp_path: Path, token_content: str | None, env_extra: dict[str, str] | None, message: str
) -> None:
    env: dict[str, str] = dict(env_extra or {})
    if token_content is not None:
        f = tmp_path / "token"
        f.write_text(token_content)
        env["SANDBOX_AGENT_TOKEN_FILE"] = str(f)
    p = _start(env, tmp_path)
    assert p.returncode == 2
    assert message in p.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SANDBOX_AGENT_PORT": "http"}, "SANDBOX_AGENT_PORT"),
        ({"SANDBOX_AGENT_PORT": "70000"}, "SANDBOX_AGENT_PORT"),
        ({"SANDBOX_AGENT_MAX_TIMEOUT": "1", "SANDBOX_AGENT_DEFAULT_TIMEOUT": "5"}, "TIMEOUT"),
        ({"SANDBOX_AGENT_UMASK": "9"}, "SANDBOX_AGENT_UMASK"),
        ({"SANDBOX_AGENT_METRICS_AUTH": "maybe"}, "SANDBOX_AGENT_METRICS_AUTH"),
        ({"SANDBOX_AGENT_MAX_BODY_BYTES": "-1"}, "must not be negative"),
        ({"SANDBOX_AGENT_WORKSPACE": "/nonexistent/ws"}, "is not a directory"),
    ],
)
def test_refuses_bad_config(tmp_path: Path, env: dict[str, str], message: str) -> None:
    f = tmp_path / "token"
    f.write_text("x" * 32)
    p = _start({"SANDBOX_AGENT_TOKEN_FILE": str(f), **env}, tmp_path)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr


def test_metrics_can_be_opened_explicitly(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh(env={"SANDBOX_AGENT_METRICS_AUTH": "false"}, runner=False)
    assert sb.anon.get("/metrics").status_code == 200
    assert sb.anon.get("/v1/info").status_code == 401


def test_rotated_token_is_picked_up(fresh: Callable[..., Sandbox]) -> None:
    import time

    sb = fresh(runner=False)
    old = sb.token
    new = "rotated-" + "n" * 30
    time.sleep(1.1)  # the reload check is rate-limited to once a second
    tmp = sb.token_file.with_suffix(".new")
    tmp.write_text(new + "\n")
    os.replace(tmp, sb.token_file)  # like kubelet's atomic symlink swap
    r = sb.anon.get("/v1/info", headers={"Authorization": f"Bearer {new}"})
    assert r.status_code == 200
    r = sb.anon.get("/v1/info", headers={"Authorization": f"Bearer {old}"})
    assert sb.error(r, 401) == "unauthorized"
    # an emptied token file never opens the door
    time.sleep(1.1)
    sb.token_file.write_text("")
    assert sb.anon.get("/v1/info", headers={"Authorization": "Bearer x"}).status_code == 401
    assert sb.anon.get("/v1/info", headers={"Authorization": f"Bearer {new}"}).status_code == 200
