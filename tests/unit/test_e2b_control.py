"""The E2B control plane's pure parts: request fields, the Sandbox a create makes,
E2B's shapes of a Sandbox, list filters and paging tokens, API keys, metrics."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.parse
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sandbox_operator.api.sandbox import SandboxSpec
from sandbox_operator.gateway.access import Caller
from sandbox_operator.gateway.e2b import core, keys, listing, shapes, usage
from sandbox_operator.gateway.e2b.control import ordered, warm_pool
from sandbox_operator.gateway.e2b.core import E2BError
from sandbox_operator.resources import LABEL_POOL, RESUME_ANNOTATION

NOW = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
JSON = dict[str, Any]


def refused(call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(E2BError) as caught:
        call(*args, **kwargs)
    assert caught.value.status == 400
    return caught.value.message


# -- create requests -----------------------------------------------------------------------


def test_a_create_request_takes_e2b_s_fields() -> None:
    ask = shapes.parse_create(
        {
            "templateID": "base",
            "timeout": 60,
            "autoPause": True,
            "metadata": {"user": "abc", "odd key": "a/b"},
            "envVars": {"FOO": "bar"},
            "allow_internet_access": False,
            "secure": True,
            "autoPauseMemory": True,
            "mcp": {"server": {}},  # the SDK starts it itself, as a command
            "volumeMounts": [],
        },
        300,
        3600,
    )
    assert ask == shapes.CreateRequest(
        "base", 60, True, {"user": "abc", "odd key": "a/b"}, {"FOO": "bar"}, False
    )
    assert shapes.parse_create({"templateID": "base"}, 300, 3600).timeout == 300


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({}, "templateID"),
        ({"templateID": 5}, "templateID"),
        ({"templateID": "x" * 254}, "templateID"),
        ({"templateID": "b", "timeout": 0}, "timeout"),
        ({"templateID": "b", "timeout": 3601}, "timeout"),
        ({"templateID": "b", "timeout": True}, "timeout"),
        ({"templateID": "b", "timeout": "60"}, "timeout"),
        ({"templateID": "b", "autoPause": "yes"}, "autoPause"),
        ({"templateID": "b", "metadata": ["a"]}, "metadata"),
        ({"templateID": "b", "metadata": {"a": 1}}, "metadata"),
        ({"templateID": "b", "metadata": {"": "x"}}, "metadata"),
        ({"templateID": "b", "metadata": {"a": "x\x00"}}, "metadata"),
        ({"templateID": "b", "metadata": {"a": "\ud800"}}, "metadata"),
        ({"templateID": "b", "metadata": {f"k{i}": "v" for i in range(65)}}, "metadata"),
        ({"templateID": "b", "envVars": {"1 A": "x"}}, "envVars"),
        ({"templateID": "b", "envVars": {"A": "x" * 32769}}, "envVars"),
        ({"templateID": "b", "mcp": "server"}, "mcp"),
        ({"templateID": "b", "network": {"allowOut": ["1.1.1.1"]}}, "network"),
        ({"templateID": "b", "network": {"allowPublicTraffic": True}}, "network"),
        (
            {"templateID": "b", "network": {"allowPublicTraffic": False, "denyOut": ["0.0.0.0/0"]}},
            "network",
        ),
        ({"templateID": "b", "autoResume": {"enabled": True}}, "autoResume"),
        ({"templateID": "b", "allow_internet_access": "no"}, "allow_internet_access"),
    ],
)
def test_a_bad_create_field_is_a_400_naming_it(body: JSON, says: str) -> None:
    assert says in refused(shapes.parse_create, body, 300, 3600)


def test_private_traffic_is_what_a_sandbox_has_anyway() -> None:
    body = {"templateID": "b", "network": {"allowPublicTraffic": False}}
    assert shapes.parse_create(body, 300, 3600).template == "b"


def test_the_sandbox_of_a_create_request() -> None:
    ask = shapes.CreateRequest(
        "base", 60, True, {"user": "abc", "odd key": "a/b", "long": "x" * 64}, {"FOO": "bar"}, False
    )
    ref = {"kind": "ClusterSandboxTemplate", "name": "base"}
    body = shapes.sandbox_body("iabc", ask, ref, None, NOW)
    meta, spec = body["metadata"], body["spec"]
    assert meta["name"] == "iabc"
    # Only the pairs that fit a label are labels; the annotation holds them all.
    assert meta["labels"] == {shapes.E2B_LABEL: "true", "e2b.sandbox.dev/user": "abc"}
    assert json.loads(meta["annotations"][shapes.METADATA_ANNOTATION]) == ask.metadata
    assert meta["annotations"][shapes.TEMPLATE_ANNOTATION] == "base"
    assert meta["annotations"][shapes.STARTED_ANNOTATION] == "2026-01-02T03:04:05.678901Z"
    assert spec["templateRef"] == ref
    assert "poolRef" not in spec
    assert spec["env"] == [{"name": "FOO", "value": "bar"}]
    assert spec["network"] == {"egress": "None"}
    # The timeout and the start's grace from now.
    assert spec["lifecycle"] == {"expiresAt": "2026-01-02T03:05:07Z", "onExpiry": "Pause"}
    SandboxSpec.model_validate(spec)
    # From a warm pool: the pool names the template (poolRef and templateRef exclude).
    warm = shapes.sandbox_body(
        "iabc", shapes.CreateRequest("base", 5, False), ref, "base-warm", NOW
    )
    assert warm["spec"]["poolRef"] == {"name": "base-warm"}
    assert "templateRef" not in warm["spec"]
    assert warm["spec"]["lifecycle"]["onExpiry"] == "Delete"
    # Until it is Ready (when create writes the lease again), the start has its time.
    slow = shapes.sandbox_body("iabc", shapes.CreateRequest("base", 5, False), ref, None, NOW, 49.5)
    assert slow["spec"]["lifecycle"]["expiresAt"] == "2026-01-02T03:04:55Z"


def test_a_lease_is_written_again_only_when_the_start_took_longer_than_its_grace() -> None:
    first = shapes.first_lease(NOW, 300, 50)
    assert first == "2026-01-02T03:09:07Z"
    # A warm claim, Ready within the grace: the first lease stands.
    for after in (0.1, 0.9, 1.5):
        assert shapes.lease_after_start(first, NOW + timedelta(seconds=after), 300) is None
    # A cold start: the timeout from Ready, to the second.
    late = shapes.lease_after_start(first, NOW + timedelta(seconds=3.2), 300)
    assert late == "2026-01-02T03:09:08Z"
    # A short timeout had the whole start's wait as its first lease: cut back.
    short = shapes.first_lease(NOW, 5, 50)
    cut = shapes.lease_after_start(short, NOW + timedelta(seconds=0.2), 5)
    assert cut == "2026-01-02T03:04:10Z"


def test_new_ids_are_e2b_ids_and_dns_labels() -> None:
    for _ in range(50):
        new = core.new_id()
        assert core.is_id(new)
        assert "-" not in new
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", new)
        assert len(new) <= 63


# -- a Sandbox as E2B shows it ------------------------------------------------------------


def sandbox(
    name: str = "iabc",
    *,
    started: str = "2026-01-02T03:00:00.000001Z",
    metadata: dict[str, str] | None = None,
    lifecycle: JSON | None = None,
    paused: bool = False,
    status: JSON | None = None,
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
) -> JSON:
    spec: JSON = {"templateRef": {"kind": "ClusterSandboxTemplate", "name": "base"}}
    if lifecycle is not None:
        spec["lifecycle"] = lifecycle
    if paused:
        spec["paused"] = True
    return {
        "metadata": {
            "name": name,
            "namespace": "team",
            "uid": f"uid-{name}",
            "creationTimestamp": "2026-01-02T03:00:00Z",
            "labels": {shapes.E2B_LABEL: "true", **(labels or {})},
            "annotations": {
                shapes.METADATA_ANNOTATION: json.dumps(metadata or {}),
                shapes.TEMPLATE_ANNOTATION: "base",
                shapes.STARTED_ANNOTATION: started,
                **(annotations or {}),
            },
        },
        "spec": spec,
        "status": status or {"podName": name},
    }


LEASE = {"expiresAt": "2026-01-02T04:00:00Z", "onExpiry": "Delete"}


def test_a_running_sandbox_in_e2b_s_shapes() -> None:
    view = shapes.view_of(sandbox(metadata={"a": "b"}, lifecycle=LEASE), NOW)
    assert view is not None
    listed = shapes.listed(view)
    assert listed == {
        "templateID": "base",
        "alias": "base",
        "sandboxID": "iabc",
        "clientID": "team",
        "startedAt": "2026-01-02T03:00:00.000001Z",
        "endAt": "2026-01-02T04:00:00Z",
        "cpuCount": 1,
        "memoryMB": 1024,
        "diskSizeMB": 1024,
        "metadata": {"a": "b"},
        "state": "running",
        "envdVersion": core.ENVD_VERSION,
    }
    detail = shapes.detail(view, "sandboxes.example.com")
    assert detail["lifecycle"] == {"autoResume": False, "onTimeout": "kill"}
    assert detail["domain"] == "sandboxes.example.com"
    made = shapes.created(view, "tok", None)
    assert made["envdAccessToken"] == made["trafficAccessToken"] == "tok"
    assert made["sandboxID"] == "iabc"
    assert made["envdVersion"] == core.ENVD_VERSION


def test_states_and_the_lease() -> None:
    over_delete = {"expiresAt": "2026-01-02T03:00:00Z", "onExpiry": "Delete"}
    over_pause = {"expiresAt": "2026-01-02T03:00:00Z", "onExpiry": "Pause"}
    # Past a lease that deletes: gone for E2B already (the operator is on its way).
    assert shapes.view_of(sandbox(lifecycle=over_delete), NOW) is None
    # Past a lease that pauses: paused, by the operator's hand (resumed by annotation).
    view = shapes.view_of(sandbox(lifecycle=over_pause), NOW)
    assert view is not None
    assert view.state == "paused"
    assert view.paused_by_operator
    # E2B's pause: spec.paused, lease lifted.
    view = shapes.view_of(sandbox(paused=True, status={"pausedSince": "2026-01-02T03:01:00Z"}), NOW)
    assert view is not None
    assert view.state == "paused"
    assert view.paused_by_spec
    assert view.end_at == "2026-01-02T03:01:00Z"
    # Idle-paused by the operator, then resumed by the annotation.
    idle = sandbox(lifecycle=LEASE, status={"idlePausedAt": "2026-01-02T03:02:00Z"})
    view = shapes.view_of(idle, NOW)
    assert view is not None
    assert view.state == "paused"
    assert view.paused_by_operator
    resumed = sandbox(
        lifecycle=LEASE,
        status={"idlePausedAt": "2026-01-02T03:02:00Z"},
        annotations={RESUME_ANNOTATION: "2026-01-02T03:03:00.5Z"},
    )
    view = shapes.view_of(resumed, NOW)
    assert view is not None
    assert view.state == "running"
    # Being deleted: gone.
    deleting = sandbox()
    deleting["metadata"]["deletionTimestamp"] = "2026-01-02T03:04:00Z"
    assert shapes.view_of(deleting, NOW) is None


def test_pool_members_are_not_e2b_sandboxes() -> None:
    assert shapes.is_pool_member(sandbox(labels={LABEL_POOL: "warm"}))
    claimed = sandbox()
    claimed["metadata"]["ownerReferences"] = [{"kind": "Sandbox", "controller": True, "uid": "x"}]
    assert shapes.is_pool_member(claimed)
    assert not shapes.is_pool_member(sandbox())


# -- list filters and paging ------------------------------------------------------------------


def sdk_metadata_query(metadata: dict[str, str]) -> str:
    """What the E2B SDK sends as `metadata` (before the query string's own encoding)."""
    quoted = {urllib.parse.quote(k): urllib.parse.quote(v) for k, v in metadata.items()}
    return urllib.parse.urlencode(quoted)


def test_the_sdk_s_metadata_filter_round_trips() -> None:
    wanted = {"user": "abc", "odd key": "a=b&c", "ünï": "ß/%"}
    assert listing.parse_metadata_query(sdk_metadata_query(wanted)) == wanted
    assert listing.parse_metadata_query("") == {}
    assert "metadata" in refused(listing.parse_metadata_query, "=x")


def test_the_label_selector_narrows_by_the_pairs_that_fit_labels() -> None:
    selector = listing.label_selector({"user": "abc", "odd key": "x", "b": "c/d"})
    assert selector == "sandbox.dev/e2b=true,e2b.sandbox.dev/user=abc"


def test_list_parameters() -> None:
    query = listing.parse_list(
        {"state": "paused", "order": "asc", "limit": "2", "template": "base"}, v2=True
    )
    assert query.states == {"paused"}
    assert not query.descending
    assert query.limit == 2
    assert listing.parse_list({}, v2=True).states == {"running", "paused"}
    # The first list only ever showed running sandboxes.
    assert listing.parse_list({"state": "paused"}, v2=False).states == {"running"}
    after = listing.parse_list({"startedAfter": "2026-01-02T04:00:00+01:00"}, v2=True)
    assert after.started_after == datetime(2026, 1, 2, 3, tzinfo=UTC)
    for bad in (
        {"state": "dead"},
        {"state": ""},
        {"order": "up"},
        {"limit": "0"},
        {"limit": "101"},
        {"limit": "-1"},
        {"startedAfter": "yesterday"},
        {"nextToken": "not a token"},
    ):
        refused(listing.parse_list, bad, v2=True)


def test_paging_tokens_round_trip_and_refuse_forgeries() -> None:
    cursor = listing.Cursor("2026-01-02T03:00:00.000001Z", "iabc")
    assert listing.decode_token(listing.encode_token(cursor)) == cursor
    for forged in ("", "x" * 2000, "a+b", "e30", "bnVsbA", listing.encode_token(cursor) + "A"):
        refused(listing.decode_token, forged)


def views(*specs: tuple[str, str, str]) -> list[shapes.View]:
    found = []
    for name, started, state in specs:
        body = sandbox(name, started=started, lifecycle=LEASE, paused=state == "paused")
        view = shapes.view_of(body, NOW)
        assert view is not None
        found.append(view)
    return found


def test_pages_follow_the_order_and_the_cursor() -> None:
    all_views = views(
        ("iaaa", "2026-01-02T03:00:00.1Z", "running"),
        ("ibbb", "2026-01-02T03:00:00.2Z", "paused"),
        ("iccc", "2026-01-02T03:00:00.2Z", "running"),  # same time: the name orders
        ("iddd", "2026-01-02T03:00:01Z", "running"),
    )
    for descending in (True, False):
        seen: list[str] = []
        after = None
        for _ in range(5):
            query = listing.ListQuery(
                {}, frozenset(shapes.STATES), descending, None, None, 1, after
            )
            shown, after = listing.page(all_views, query)
            seen += [v.id for v in shown]
            if after is None:
                break
        expected = ["iaaa", "ibbb", "iccc", "iddd"]
        assert seen == (expected[::-1] if descending else expected)
    running = listing.ListQuery({}, frozenset({"running"}), True, None, None, 100, None)
    shown, after = listing.page(all_views, running)
    assert [v.id for v in shown] == ["iddd", "iccc", "iaaa"]
    assert after is None
    since = datetime(2026, 1, 2, 3, 0, 0, 200000, tzinfo=UTC)
    later = listing.ListQuery({}, frozenset(shapes.STATES), False, since, None, 100, None)
    assert [v.id for v in listing.page(all_views, later)[0]] == ["ibbb", "iccc", "iddd"]
    other = listing.ListQuery({}, frozenset(shapes.STATES), False, None, "unknown", 100, None)
    assert listing.page(all_views, other)[0] == []


def test_the_metadata_filter_matches_every_pair() -> None:
    tagged = views(("iaaa", "2026-01-02T03:00:00Z", "running"))
    body = sandbox("ibbb", metadata={"a": "1", "b": "2"}, lifecycle=LEASE)
    view = shapes.view_of(body, NOW)
    assert view is not None
    query = listing.ListQuery({"a": "1"}, frozenset(shapes.STATES), True, None, None, 100, None)
    assert [v.id for v in listing.page([*tagged, view], query)[0]] == ["ibbb"]
    both = listing.ListQuery(
        {"a": "1", "b": "3"}, frozenset(shapes.STATES), True, None, None, 9, None
    )
    assert listing.page([view], both)[0] == []


# -- API keys -----------------------------------------------------------------------------


def test_keys_have_e2b_s_shape_and_are_kept_as_their_hash() -> None:
    key = keys.new_key()
    assert keys.KEY.fullmatch(key)
    assert key != keys.new_key()
    digest = keys.digest(key)
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert key[4:] not in digest
    account = {"metadata": {"name": "alice", "uid": "sa-uid"}}
    expires = NOW + timedelta(days=1)
    secret = keys.key_secret(
        digest, "team", account, "system:serviceaccount:team:admin", NOW, expires
    )
    assert secret["metadata"]["name"] == "e2b-key-" + digest
    assert key not in json.dumps(secret)
    record = keys.record_of(secret)
    assert record == keys.KeyRecord(
        digest, "team", "alice", "sa-uid", expires.replace(microsecond=0).timestamp()
    )
    caller = record.caller()
    assert caller.user == "system:serviceaccount:team:alice"
    assert caller.uid == "sa-uid"
    assert set(caller.groups) == {
        "system:serviceaccounts",
        "system:serviceaccounts:team",
        "system:authenticated",
    }
    shown = keys.described(secret, record, ("Active", ""))
    assert (shown["serviceAccount"], shown["state"]) == ("alice", "Active")
    assert "reason" not in shown
    # The list says which keys can never work again, and why.
    now = NOW.timestamp()
    live = {"metadata": {"name": "alice", "uid": "sa-uid"}}
    assert keys.key_state(record, live, now) == ("Active", "")
    gone = keys.key_state(record, None, now)
    assert gone == ("Orphaned", "ServiceAccount alice no longer exists")
    again = keys.key_state(record, {"metadata": {"name": "alice", "uid": "other"}}, now)
    assert again == ("Orphaned", "ServiceAccount alice was deleted and made again")
    assert keys.key_state(record, live, expires.timestamp() + 1)[0] == "Expired"
    assert keys.described(secret, record, gone)["reason"] == gone[1]
    # Anything else in the keys' namespace is not a key.
    assert keys.record_of({**secret, "type": "Opaque"}) is None
    broken = json.loads(json.dumps(secret))
    broken["data"]["sha256"] = "eA=="
    assert keys.record_of(broken) is None


def test_the_namespace_of_a_kubernetes_identity() -> None:
    assert keys.home_namespace(Caller("system:serviceaccount:team-a:bot"), "default") == "team-a"
    assert keys.home_namespace(Caller("alice@example.com"), "sandboxes") == "sandboxes"
    assert keys.home_namespace(Caller("system:serviceaccount:bad"), "sandboxes") == "sandboxes"


# -- metrics ------------------------------------------------------------------------------


def test_a_metrics_sample() -> None:
    view = shapes.view_of(sandbox(lifecycle=LEASE), NOW)
    assert view is not None
    info = {"workspaceUsage": {"totalBytes": 1000, "usedBytes": 10, "availableBytes": 990}}
    pod = {"containers": [{"name": "sandbox", "usage": {"cpu": "250m", "memory": "64Mi"}}]}
    found = usage.sample(view, info, pod, 1_700_000_000)
    assert found["cpuUsedPct"] == 25.0
    assert found["memUsed"] == 64 << 20
    assert found["memTotal"] == 1 << 30
    assert found["diskUsed"] == 10
    assert found["diskTotal"] == 1000
    assert found["timestamp"] == "2023-11-14T22:13:20Z"
    assert found["timestampUnix"] == 1_700_000_000
    nothing = usage.sample(view, None, None, 1)
    assert nothing["cpuUsedPct"] == 0
    assert nothing["memUsed"] == 0
    assert nothing["diskTotal"] == 0
    assert usage.overlaps(100, None, None)
    assert usage.overlaps(100, 100, 96)
    assert not usage.overlaps(100, 101, None)
    assert not usage.overlaps(100, None, 94)


# -- create's lookups ---------------------------------------------------------------------


def test_the_warm_pool_of_a_template_is_the_one_with_most_ready_members() -> None:
    def pool(name: str, template: str, ready: int, kind: str | None = None) -> JSON:
        ref = {"name": template, **({"kind": kind} if kind else {})}
        return {
            "metadata": {"name": name},
            "spec": {"templateRef": ref},
            "status": {"ready": ready},
        }

    base = {"kind": "ClusterSandboxTemplate", "name": "base"}
    listed = {
        "items": [
            pool("few", "base", 1, "ClusterSandboxTemplate"),
            pool("many", "base", 3, "ClusterSandboxTemplate"),
            pool("namesake", "base", 9),  # a SandboxTemplate `base` of the namespace
            pool("other", "code-interpreter-v1", 9, "ClusterSandboxTemplate"),
        ]
    }
    assert warm_pool(listed, base) == "many"
    assert warm_pool(listed, {"kind": "SandboxTemplate", "name": "base"}) == "namesake"
    empty = {"items": [pool("drained", "base", 0, "ClusterSandboxTemplate")]}
    assert warm_pool(empty, base) is None  # a cold start
    assert warm_pool(None, base) is None


def test_lookups_run_at_once_and_fail_in_the_order_given() -> None:
    async def answer(value: str, after: float) -> str:
        await asyncio.sleep(after)
        return value

    async def refuse(status: int, after: float) -> str:
        await asyncio.sleep(after)
        raise E2BError(status, f"refused {status}")

    async def scenario() -> None:
        began = asyncio.get_running_loop().time()
        assert await ordered(answer("a", 0.05), answer("b", 0.05)) == ["a", "b"]
        assert asyncio.get_running_loop().time() - began < 0.09  # not one after the other
        # The later-answered failure first in order is the one raised.
        with pytest.raises(E2BError) as caught:
            await ordered(refuse(403, 0.03), refuse(404, 0.0), answer("c", 0.0))
        assert caught.value.status == 403

    asyncio.run(scenario())
