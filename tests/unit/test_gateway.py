"""The gateway's pure parts: which agent operations it forwards with which
permission (generated from the agent's document), canonical paths, scoped
tokens and signed URLs (with key rotation and their minter's lifetime),
bounded caches, preview hosts, bulk copies giving way to short calls."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from pathlib import Path

import pytest

from sandbox_operator.gateway import canonical, operations
from sandbox_operator.gateway.access import Caller, Operation, TtlCache, jwt_expiry
from sandbox_operator.gateway.app import (
    agent_operation,
    attachment,
    preview_host,
    workspace_path_problem,
)
from sandbox_operator.gateway.proxy import SHORT_SECONDS, YIELD_SECONDS, Fairness
from sandbox_operator.gateway.signing import Claims, Keys, SigningError
from sandbox_operator.gateway.table import JSON, RouteTable, token_of

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


def test_the_gateways_table_is_generated_from_the_agents_document() -> None:
    """Each operation of the agent's OpenAPI document is forwarded with the
    permission its x-access-class names, or not at all; the checked-in table
    is what the generator makes of the document now."""
    assert operations.main(["--check"]) == 0, "run `make openapi`"
    document = json.loads((REPO / "sandbox-agent/openapi.json").read_text())
    for path, methods in document["paths"].items():
        for method, spec in methods.items():
            tail = path.removeprefix("/v1/").replace("{id}", "ex-1")
            found = agent_operation(method.upper(), tail)
            if path in NOT_SERVED:
                assert spec["x-access-class"] in ("operator", "public", "metrics"), path
                assert found is None, f"{method} {path} is served"
            else:
                assert found is not None, f"{method} {path} is not served"
                assert found.operation.value == spec["x-access-class"]
    assert _permission("GET", "files/content") is Operation.FILES_READ
    assert _permission("POST", "files/search") is Operation.FILES_READ
    assert _permission("PUT", "files/archive") is Operation.FILES_WRITE
    assert _permission("GET", "executions/ex-1/output") is Operation.EXEC
    assert _permission("HEAD", "files/content") is Operation.FILES_READ
    assert Operation.EXEC.describe() == "create sandboxes/exec.sandbox.dev"
    # What is not in the table is not forwarded, however it is spelled.
    for method, tail in (
        ("POST", "workspace/quiesce"),
        ("PUT", "environment"),
        ("GET", "files"),
        ("GET", "files/content/extra"),
        ("PATCH", "files/content"),
        ("GET", "executions/ex-1/output/more"),
        ("GET", "executions/-bad/output"),
        ("GET", "executions/" + "x" * 200),
        ("POST", "info"),
    ):
        assert agent_operation(method, tail) is None, (method, tail)


def _permission(method: str, tail: str) -> Operation:
    found = agent_operation(method, tail)
    assert found is not None, (method, tail)
    return found.operation


def test_an_operation_without_an_access_class_fails_generation() -> None:
    document = {"paths": {"/v1/new": {"post": {"x-access-class": "root"}}}}
    with pytest.raises(ValueError, match="unknown x-access-class"):
        operations.render(document)
    with pytest.raises(ValueError, match="unknown x-access-class"):
        operations.render({"paths": {"/v1/new": {"post": {}}}})


API = "/v1/namespaces/ns/sandboxes/box"


@pytest.mark.parametrize(
    "path",
    [
        f"{API}/files/content",
        f"{API}/executions/ex-1/output",
        "/healthz",
        "/",
        f"{API}/ports/8000",
        f"{API}/ports/8000/",
        f"{API}/ports/8000/app/a%20b/",
        f"{API}/ports/8000/caf%C3%A9",
    ],
)
def test_canonical_paths_pass(path: str) -> None:
    canonical.check(path)


@pytest.mark.parametrize(
    "path",
    [
        f"{API}/files/%2e%2e/executions",
        f"{API}/files/%2E%2E/executions",
        f"{API}/files/%252e%252e/executions",
        f"{API}/files/../executions",
        f"{API}/files/./content",
        f"{API}/files//content",
        f"{API}/files/content/",
        f"{API}/files%2fcontent",
        f"{API}/files%5ccontent",
        f"{API}/files\\content",
        f"{API}/files;x/content",
        f"{API}/files/content;x",
        f"{API}/fil%65s/content",
        "/v1/namespaces/n%73/sandboxes/box/info",
        f"{API}/ports/8000/a/../../files/content",
        f"{API}/ports/8000/a/%2e%2e/b",
        f"{API}/ports/8000/a/%25252e%25252e/b",
        f"{API}/ports/8000/a%2fb",
        f"{API}/ports/8000/a%5cb",
        f"{API}/ports/8000/a;jsessionid=1",
        f"{API}/ports/8000//a",
        f"{API}/ports/8000/a%00",
        f"{API}/ports/8000/%09/evil.example/",
        f"{API}/ports/8000/a%0d%0aX-Injected:%20yes",
        "http://evil/v1/namespaces/ns/sandboxes/box/info",
        "*",
    ],
)
def test_anything_else_is_refused(path: str) -> None:
    with pytest.raises(canonical.NotCanonical):
        canonical.check(path)


def test_a_preview_host_path_is_checked_as_a_preview_path() -> None:
    canonical.check("/any/%20path/", preview_host=True)
    for path in ("/a/%2e%2e/b", "/a//b", "/a;b", "/a%2Fb"):
        with pytest.raises(canonical.NotCanonical):
            canonical.check(path, preview_host=True)


def test_what_a_url_may_name_is_refused_at_minting() -> None:
    assert workspace_path_problem("report/data.csv") is None
    assert workspace_path_problem(".") is None
    for path in (
        "",
        "../../etc/passwd",
        "/etc/passwd",
        "a/../../b",
        "%2e%2e/x",
        "%252e%252e/x",
        "a\\b",
        "a\0b",
        "%2fetc",
        "x" * 5000,
        "n\r\nX-Injected: 1",
        "\ud800",
    ):
        assert workspace_path_problem(path) is not None, path


def test_download_names_cannot_break_the_header() -> None:
    assert attachment("data.csv") == "attachment; filename=\"data.csv\"; filename*=UTF-8''data.csv"
    header = attachment('n\r\nX-Inj: 1;"é')
    assert "\r" not in header
    assert "\n" not in header
    assert header.endswith("filename*=UTF-8''n%0D%0AX-Inj%3A%201%3B%22%C3%A9")


def _jwt(claims: dict[str, object]) -> str:
    def part(data: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2ln"


def test_nothing_minted_outlives_its_minter() -> None:
    assert jwt_expiry(_jwt({"exp": 1_900_000_000, "sub": "x"})) == 1_900_000_000
    assert jwt_expiry(_jwt({"sub": "x"})) is None
    assert jwt_expiry(_jwt({"exp": True})) is None
    assert jwt_expiry("opaque-token") is None
    assert jwt_expiry("a.!!!.c") is None
    now = 1_000_000.0
    assert Caller("u").lifetime(600, now) == 1_000_600
    assert Caller("u", expires=now + 5).lifetime(86400, now) == 1_000_005
    assert Caller("u", expires=now + 5000).lifetime(60, now) == 1_000_060


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
    # One token, one spelling: nothing may follow or pad its signature.
    for variant in (
        token + "=",
        token + "=;Max-Age=9",
        token + "A",
        f"{body}.{sig}==",
        " " + token,
    ):
        with pytest.raises(SigningError, match="malformed"):
            keys.verify_token(variant)
    nested = "sbxt1." + base64.urlsafe_b64encode(b"[" * 1500).rstrip(b"=").decode() + "." + sig
    with pytest.raises(SigningError, match="malformed"):
        keys.verify_token(nested)


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
    # No such sandbox (uid ""): refused as a wrong signature is, after the same checks.
    with pytest.raises(SigningError, match="signature does not match"):
        keys.verify_url("GET", "ns", "box", "", "a.txt", query)
    with pytest.raises(SigningError, match="signature does not match"):
        keys.verify_url("GET", "ns", "box", "uid-1", "a.txt", {**query, "sig": "é" * 43})
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
    assert preview_host("²-web-app-team-a", exists) is None
    assert preview_host("123456-web-app-team-a", exists) is None
    # Another tenant's sandbox that also resolves the label does not take it over.
    existing.add(("app-team-a", "web"))
    assert preview_host("8000-web-app-team-a", exists) is None


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


# -- bulk copies give way to short calls (proxy.Fairness; a real event loop) -------------


def test_a_bulk_copy_waits_for_short_calls_a_moment_at_most() -> None:
    async def scenario() -> None:
        fair = Fairness()
        loop = asyncio.get_running_loop()
        await fair.turn()  # nothing short in flight: no wait at all
        assert fair.short == 0
        end = fair.begin()
        assert fair.short == 1
        waited = loop.time()
        await asyncio.wait_for(fair.turn(), 30)  # bounded by YIELD_SECONDS, not by the call
        assert loop.time() - waited >= YIELD_SECONDS * 0.9
        # The short call ends: a waiting copy goes on at once.
        waiter = asyncio.create_task(fair.turn())
        await asyncio.sleep(0)
        end()
        end()  # twice: counted once
        await asyncio.wait_for(waiter, 30)
        assert fair.short == 0

    asyncio.run(scenario())


def test_a_call_stops_counting_as_short_after_short_seconds() -> None:
    async def scenario() -> None:
        fair = Fairness()
        end = fair.begin()
        await asyncio.sleep(SHORT_SECONDS * 2)
        assert fair.short == 0  # a long command no longer holds bulk copies back
        end()
        assert fair.short == 0

    asyncio.run(scenario())


def _secret(name: str, sandbox: str, owner: str, *, controller: bool = True) -> JSON:
    return {
        "metadata": {
            "name": name,
            "namespace": "team",
            "labels": {
                "sandbox.dev/sandbox": sandbox,
                "app.kubernetes.io/managed-by": "sandbox-operator",
            },
            "ownerReferences": [
                {"kind": "Sandbox", "name": sandbox, "uid": owner, "controller": controller}
            ],
        },
        "data": {"token": base64.b64encode(b"s3cret").decode()},
    }


def test_only_the_operators_own_token_secret_is_a_sandboxs_token() -> None:
    assert token_of(_secret("box-agent-token", "box", "u1")) == ("box", "u1", "s3cret")
    # Look-alikes anyone with create on Secrets could make: another name, an
    # owner reference that is not the controller, or one naming another sandbox.
    assert token_of(_secret("box-agent-token-2", "box", "u1")) is None
    assert token_of(_secret("box-agent-token", "box", "u1", controller=False)) is None
    fake = _secret("box-agent-token", "box", "u1")
    fake["metadata"]["ownerReferences"][0]["name"] = "other"
    assert token_of(fake) is None
    table = RouteTable(kube=None, namespaces=["team"])  # type: ignore[arg-type]
    table._apply_secret("ADDED", _secret("box-agent-token", "box", "u1"))
    table._apply_secret("ADDED", _secret("decoy", "box", "u1"))
    table._apply_secret("DELETED", _secret("decoy", "box", "u1"))
    assert table.tokens[("team", "box")] == ("u1", "s3cret")
