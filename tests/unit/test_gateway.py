"""The gateway's pure parts: which permission each agent call needs, scoped
tokens and signed URLs (with key rotation), bounded caches, preview hosts."""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path

import pytest

from sandbox_operator.gateway.access import Operation, TtlCache
from sandbox_operator.gateway.app import operation_of, preview_host
from sandbox_operator.gateway.signing import Claims, Keys, SigningError

REPO = Path(__file__).resolve().parents[2]
# The agent's operations the gateway does not serve: the operator's own controls
# and what only the node's probes and Prometheus read.
NOT_SERVED = {
    "/healthz",
    "/livez/runtime",
    "/readyz",
    "/metrics",
    "/openapi.json",
    "/v1/environment",
    "/v1/workspace/quiesce",
    "/v1/workspace/resume",
    "/v1/workspace/sync",
}


def test_every_agent_operation_is_classified() -> None:
    """The agent's contract, read from its OpenAPI document: each operation is
    either served with a named permission or deliberately not served."""
    document = json.loads((REPO / "sandbox-agent/openapi.json").read_text())
    for path, operations in document["paths"].items():
        for method in operations:
            tail = path.removeprefix("/v1/").replace("{id}", "ex-1")
            operation = operation_of(method.upper(), tail)
            if path in NOT_SERVED:
                assert operation is None, f"{method} {path} is served"
            else:
                assert operation is not None, f"{method} {path} is not classified"
    assert operation_of("GET", "files/content") is Operation.FILES_READ
    assert operation_of("POST", "files/search") is Operation.FILES_READ
    assert operation_of("PUT", "files/archive") is Operation.FILES_WRITE
    assert operation_of("POST", "files/remove") is Operation.FILES_WRITE
    assert operation_of("GET", "executions/ex-1/output") is Operation.EXEC
    assert operation_of("GET", "info") is Operation.VIEW
    assert Operation.EXEC.describe() == "create sandboxes/exec.sandbox.dev"


def _key(directory: Path, kid: str) -> None:
    (directory / kid).write_bytes(base64.b64encode(os.urandom(48)))


def _claims(expires_in: int = 60) -> Claims:
    return Claims("ns", "box", "uid-1", ("exec",), int(time.time()) + expires_in)


def test_scoped_tokens_verify_and_refuse(tmp_path: Path) -> None:
    _key(tmp_path, "20260101")
    keys = Keys(tmp_path)
    token = keys.mint_token(_claims())
    assert Keys.is_scoped(token)
    assert keys.verify_token(token) == _claims()
    body, _, sig = token.rpartition(".")
    with pytest.raises(SigningError, match="signature"):
        keys.verify_token(f"{body}.{sig[::-1]}")
    forged = body.replace(body[10:14], "AAAA") + "." + sig
    with pytest.raises(SigningError):
        keys.verify_token(forged)
    with pytest.raises(SigningError, match="expired"):
        keys.verify_token(keys.mint_token(_claims(-1)))
    with pytest.raises(SigningError, match="malformed"):
        keys.verify_token("sbxt1.nonsense")


def test_keys_rotate_without_invalidating_what_was_signed(tmp_path: Path) -> None:
    _key(tmp_path, "20260101")
    keys = Keys(tmp_path)
    old_token = keys.mint_token(_claims())
    old_url = keys.sign_url("GET", "ns", "box", "uid-1", "a.txt", int(time.time()) + 60)
    _key(tmp_path, "20260201")
    keys._checked = 0  # as after the reload interval
    assert keys.signer == "20260101"
    new_token = keys.mint_token(_claims())
    assert keys.signer == "20260201"
    assert json.loads(base64.urlsafe_b64decode(new_token.split(".")[1] + "=="))["kid"] == "20260201"
    keys.verify_token(old_token)
    keys.verify_url("GET", "ns", "box", "uid-1", "a.txt", old_url)
    (tmp_path / "20260101").unlink()
    keys._checked = 0
    with pytest.raises(SigningError, match="unknown key"):
        keys.verify_token(old_token)
    keys.verify_token(new_token)


def test_signed_urls_are_bound_to_everything_they_name(tmp_path: Path) -> None:
    _key(tmp_path, "k1")
    keys = Keys(tmp_path)
    exp = int(time.time()) + 60
    query = keys.sign_url("GET", "ns", "box", "uid-1", "a.txt", exp)
    keys.verify_url("GET", "ns", "box", "uid-1", "a.txt", query)
    for args in (
        ("GET", "ns", "box", "uid-2", "a.txt"),  # a namesake
        ("GET", "ns", "box", "uid-1", "b.txt"),
        ("GET", "other", "box", "uid-1", "a.txt"),
        ("PUT", "ns", "box", "uid-1", "a.txt"),
    ):
        with pytest.raises(SigningError, match="signature"):
            keys.verify_url(*args, query)
    with pytest.raises(SigningError, match="signature"):
        keys.verify_url("GET", "ns", "box", "uid-1", "a.txt", {**query, "exp": str(exp + 1)})
    with pytest.raises(SigningError, match="not a signed URL"):
        keys.verify_url("GET", "ns", "box", "uid-1", "a.txt", {})
    short_key = tmp_path / "weak"
    short_key.write_bytes(b"too short")
    keys._checked = 0
    assert "weak" not in keys.keys


def test_no_key_no_signing(tmp_path: Path) -> None:
    with pytest.raises(SigningError, match="no signing key"):
        Keys(tmp_path / "missing").mint_token(_claims())


def test_caches_are_bounded_and_expire() -> None:
    cache: TtlCache[int] = TtlCache(3)
    for i in range(5):
        cache.put(i, i, 60)
    assert len(cache.entries) == 3
    assert cache.get(0) is None
    assert cache.get(4) == 4
    cache.put("short", 1, -1)
    assert cache.get("short") is None


def test_preview_hosts_with_dashes_in_both_names() -> None:
    existing = {("team-a", "web-app")}

    def exists(ns: str, name: str) -> bool:
        return (ns, name) in existing

    assert preview_host("8000-web-app-team-a", exists) == ("team-a", "web-app", 8000)
    assert preview_host("8000-web-team-a", exists) is None
    assert preview_host("web-app-team-a", exists) is None


def test_concurrent_misses_ask_once_and_warm_answers_refresh_ahead() -> None:
    import asyncio

    calls: list[int] = []

    async def review() -> int:
        calls.append(1)
        await asyncio.sleep(0.05)
        return len(calls)

    async def scenario() -> None:
        cache: TtlCache[int] = TtlCache(16)
        answers = await asyncio.gather(
            *(cache.fetch("k", review, lambda _: 0.4) for _ in range(10))
        )
        assert [a for a, _ in answers] == [1] * 10
        assert len(calls) == 1  # ten callers, one review
        assert [hit for _, hit in answers].count(False) == 1
        await asyncio.sleep(0.32)  # past three quarters of its life
        value, hit = await cache.fetch("k", review, lambda _: 0.4)
        assert (value, hit) == (1, True)  # served at once...
        await asyncio.sleep(0.1)
        assert len(calls) == 2  # ...and asked again in the background
        assert cache.get("k") == 2

        async def broken() -> int:
            raise RuntimeError("API server down")

        with pytest.raises(RuntimeError):
            await cache.fetch("other", broken, lambda _: 1)
        assert cache.get("other") is None  # failures are not remembered

    asyncio.run(scenario())
