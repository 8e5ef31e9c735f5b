"""The E2B adapter's shared pieces: sandbox IDs, the access token, the lease, and
the Connect envelope codec. Pure: no cluster, no agent."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from sandbox_operator.gateway import signing
from sandbox_operator.gateway.e2b import connect, core
from sandbox_operator.gateway.signing import Keys
from sandbox_operator.gateway.table import Route


def _adapter(directory: Path, *kids: str) -> core.Adapter:
    for kid in kids:
        (directory / kid).write_text("k" * 48 + kid)
    gateway = SimpleNamespace(keys=Keys(directory))
    return core.Adapter(cast(Any, gateway))


def _route(name: str = "ibox", uid: str = "uid-1", **fields: Any) -> Route:
    base: dict[str, Any] = dict(
        namespace="team-a",
        name=name,
        uid=uid,
        endpoint="http://10.0.0.1:8080",
        pod_ip="10.0.0.1",
        phase="Running",
        ready=True,
        reason="",
        message="",
        paused=False,
        paused_by_spec=False,
    )
    return Route(**{**base, **fields})


def test_new_ids_are_sandbox_names_without_dashes() -> None:
    ids = {core.new_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(core.is_id(i) and len(i) == 20 and "-" not in i for i in ids)
    for bad in ("", "ab", "with-dash", "Upper", "1leadingdigit", "x" * 64, "a/b", "a.b"):
        assert not core.is_id(bad), bad


def test_the_access_token_belongs_to_one_sandbox_object(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path, "20260101")
    route = _route()
    token = adapter.access_token("team-a", "ibox", "uid-1")
    assert adapter.token_namespace(token) == "team-a"
    assert adapter.verify_access(token, route)
    # A namesake made after a delete, another sandbox, another namespace's name.
    assert not adapter.verify_access(token, _route(uid="uid-2"))
    assert not adapter.verify_access(token, _route(name="iother"))
    assert not adapter.verify_access(token, None)
    other_ns = adapter.access_token("team-b", "ibox", "uid-1")
    assert not adapter.verify_access(other_ns, route)
    # Tampering with any part, or trailing bytes, is refused.
    head, _, mac = token.rpartition(".")
    assert not adapter.verify_access(f"{head}.{mac[::-1]}", route)
    assert not adapter.verify_access(token + "A", route)
    assert not adapter.verify_access(" " + token, route)
    assert adapter.token_namespace("e2b_" + "0" * 40) is None


def test_access_tokens_outlive_a_new_signer_and_die_with_their_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(signing, "RELOAD_SECONDS", 0.0)
    adapter = _adapter(tmp_path, "20260101")
    token = adapter.access_token("team-a", "ibox", "uid-1")
    (tmp_path / "20270101").write_text("n" * 48)
    adapter.gateway.keys.reload()
    assert adapter.verify_access(token, _route())
    (tmp_path / "20260101").unlink()
    adapter.gateway.keys.reload()
    assert not adapter.verify_access(token, _route())


def test_a_lease_ends_at_its_time() -> None:
    now = time.time()
    assert not core.lease_ended(_route())
    assert not core.lease_ended(_route(lease="2999-01-01T00:00:00Z"), now)
    assert core.lease_ended(_route(lease="2000-01-01T00:00:00Z"), now)
    assert core.lease_ended(_route(lease="2000-01-01T00:00:00.123456789+02:00"), now)


def test_not_running_is_what_e2b_sdks_read_as_not_running() -> None:
    error = core.not_running("ibox")
    body = json.loads(error.response().text or "")
    assert error.status == 502
    assert "was not found" in body["message"]
    assert body == {"code": 502, "message": body["message"]}


def test_connect_envelopes_and_errors() -> None:
    frame = connect.envelope({"a": 1})
    flags, length = struct.unpack(">BI", frame[:5])
    assert flags == 0
    assert json.loads(frame[5:]) == {"a": 1}
    assert length == len(frame) - 5
    end = connect.end_stream(connect.ConnectError("not_found", "no such process"))
    assert end[0] == connect.END_STREAM
    assert json.loads(end[5:]) == {"error": {"code": "not_found", "message": "no such process"}}
    assert json.loads(connect.end_stream()[5:]) == {}
    assert connect.ConnectError.from_http(404, "x").code == "not_found"
    assert connect.ConnectError.from_http(418, "x").code == "unknown"
    assert connect.ConnectError.from_http(507, "x").code == "internal"
    assert connect.ConnectError("unauthenticated", "x").response().status == 401


def test_the_route_knows_the_workspace_and_lease_the_sandbox_runs_with() -> None:
    from sandbox_operator.gateway.table import route_of

    body: dict[str, Any] = {
        "metadata": {"name": "ibox", "namespace": "team-a", "uid": "u"},
        "spec": {
            "poolRef": {"name": "e2b-base"},
            "lifecycle": {"expiresAt": "2030-01-01T00:00:00Z"},
        },
        "status": {},
    }
    assert route_of(body).workspace == "/workspace"
    assert route_of(body).lease == "2030-01-01T00:00:00Z"
    # A claim or a template use records the template's fields: the mount path is there.
    body["status"]["template"] = {
        "kind": "ClusterSandboxTemplate",
        "name": "base",
        "defaults": {"runtime": "e2b", "workspace": {"mountPath": "/home/user"}},
    }
    assert route_of(body).workspace == "/home/user"


# Numbers a caller spells: '²' and '٣' are str.isdigit() but not int()'s, and int()
# refuses more than 4,300 digits; each must be a bad value, never an exception.
ODD_NUMBERS = ["²", "٤٩٩٨٣", "1²", "9" * 5000, "", "-1", "+1", " 1", "1.0", "0x1"]


def test_whole_numbers_are_ascii_digits_within_a_length() -> None:
    assert core.whole("0", 1) == 0
    assert core.whole("49983", 5) == 49983
    assert core.whole("123456", 5) is None
    for odd in ODD_NUMBERS:
        assert core.whole(odd, 18) is None, odd


def _headers(**headers: str) -> Any:
    from aiohttp.test_utils import make_mocked_request

    return make_mocked_request("POST", "/", headers=headers)


@pytest.mark.parametrize("odd", ODD_NUMBERS)
def test_numbers_in_headers_and_queries_are_refused_not_raised(odd: str) -> None:
    from sandbox_operator.gateway.e2b import control, entries, listing, process_stream, watch
    from sandbox_operator.gateway.e2b import process_wire as wire
    from sandbox_operator.gateway.e2b.app import E2BApp
    from sandbox_operator.gateway.e2b.connect import ConnectError

    assert connect.timeout_seconds(_headers(**{"Connect-Timeout-Ms": odd})) is None
    assert watch.keepalive_seconds(_headers(**{"Keepalive-Ping-Interval": odd})) == 50.0
    assert process_stream.keepalive_of(_headers(**{"Keepalive-Ping-Interval": odd})) == 90.0
    with pytest.raises(core.E2BError) as refused:
        listing.parse_list({"limit": odd}, v2=True)
    assert refused.value.status == 400
    with pytest.raises(core.E2BError) as refused:
        control._epoch({"start": odd}, "start")
    assert refused.value.status == 400
    with pytest.raises(ConnectError) as invalid:
        entries.field({"depth": odd}, "depth", int, 0)
    assert invalid.value.code == "invalid_argument"
    with pytest.raises(ConnectError) as invalid:
        wire.parse_selector({"process": {"pid": odd}})
    assert invalid.value.code == "invalid_argument"
    with pytest.raises(ConnectError):
        wire.parse_signal(odd)
    app = E2BApp(cast(Any, SimpleNamespace(gateway=SimpleNamespace())), [])
    if odd.strip() != "1":  # the HTTP parser strips a header's spaces: " 1" is 1
        with pytest.raises(core.E2BError) as refused:
            app._sandbox(_headers(**{"E2b-Sandbox-Id": "ibox", "E2b-Sandbox-Port": odd}))
        assert refused.value.status == 400
    domain = SimpleNamespace(settings=SimpleNamespace(e2b_domain="e2b.test"))
    by_host = E2BApp(cast(Any, SimpleNamespace(gateway=domain)), [])
    host = f"{odd}-ibox.e2b.test".encode().decode("latin-1")
    assert by_host._sandbox(_headers(Host=host)) is None


def test_a_route_is_matched_on_the_path_as_sent() -> None:
    """Percent-encoding in a path is refused before any route is matched: no
    E2B route needs it, and a decoded `%2F` or `%2e%2e` must not reach one."""
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from sandbox_operator.gateway.e2b.app import E2BApp

    async def kill(request: web.Request, params: dict[str, str]) -> web.StreamResponse:
        return web.json_response(params)

    route = core.Endpoint(core.CONTROL, "DELETE", r"/sandboxes/(?P<id>[^/]+)", kill)
    gateway = SimpleNamespace(settings=SimpleNamespace(e2b_domain=None))
    app = E2BApp(cast(Any, SimpleNamespace(gateway=gateway)), [route])

    def answer(raw: str) -> tuple[int, str]:
        request = make_mocked_request("DELETE", raw, headers={})
        try:
            done = asyncio.run(app.dispatch(request))
        except core.E2BError as exc:
            return exc.status, exc.message
        return done.status, str(cast(web.Response, done).text)

    assert answer("/sandboxes/ibox") == (200, '{"id": "ibox"}')
    for raw in ("/sandboxes/%2e%2e", "/sandboxes/ibox%2Fkill", "/%73andboxes/ibox"):
        status, message = answer(raw)
        assert status == 400, (raw, message)
        assert "without percent-encoding" in message
    assert answer("/sandboxes/ibox/more")[0] == 404


@pytest.mark.parametrize("odd", ["²", "--5", "-²", "9" * 5000, "1e3"])
def test_a_signed_urls_expiration_is_a_number_or_a_400(odd: str) -> None:
    import asyncio

    from aiohttp.test_utils import make_mocked_request

    from sandbox_operator.gateway.e2b.files import Files

    files = Files(cast(Any, SimpleNamespace()))
    request = make_mocked_request("GET", f"/files?signature=v1_x&signature_expiration={odd}")
    with pytest.raises(core.E2BError) as refused:
        asyncio.run(files.signed_target(request, "ibox"))
    assert refused.value.status == 400


def test_a_connect_body_that_does_not_come_is_a_408_not_a_hang() -> None:
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from sandbox_operator.gateway.e2b.connect import ConnectError

    async def scenario(kind: str) -> ConnectError:
        app = web.Application()
        app[connect.BODY_SECONDS] = 0.2
        from unittest import mock

        from aiohttp.streams import StreamReader

        payload = StreamReader(
            mock.Mock(_reading_paused=False), 1 << 16, loop=asyncio.get_running_loop()
        )
        payload.feed_data(b"{")  # announced more, sends one byte, then nothing
        request = make_mocked_request(
            "POST",
            "/filesystem.Filesystem/Stat",
            headers={"Content-Type": kind, "Content-Length": "50"},
            payload=payload,
            app=app,
        )
        started = time.monotonic()
        with pytest.raises(ConnectError) as refused:
            await connect.read_request(request)
        assert time.monotonic() - started < 2
        return refused.value

    for kind in (connect.UNARY, connect.STREAM):
        error = asyncio.run(scenario(kind))
        assert (error.code, error.status) == ("deadline_exceeded", 408)
        assert error.response().status == 408


def test_a_client_stream_that_goes_quiet_ends_with_deadline_exceeded() -> None:
    """StreamInput: each message within the gateway's idle time, keepalives
    included; a stream that sends nothing does not hold its handler for ever."""
    import asyncio
    from unittest import mock

    from aiohttp.streams import StreamReader
    from aiohttp.test_utils import make_mocked_request

    from sandbox_operator.gateway.e2b.connect import ConnectError

    async def scenario(*, then_eof: bool) -> tuple[list[Any], ConnectError | None]:
        payload = StreamReader(
            mock.Mock(_reading_paused=False), 1 << 16, loop=asyncio.get_running_loop()
        )
        payload.feed_data(connect.envelope({"event": {"keepalive": {}}}))
        if then_eof:
            payload.feed_data(connect.end_stream(None))
            payload.feed_eof()
        request = make_mocked_request(
            "POST",
            "/process.Process/StreamInput",
            headers={"Content-Type": connect.STREAM},
            payload=payload,
        )
        got: list[Any] = []
        try:
            async for message in connect.read_stream(request, idle=0.2):
                got.append(message)
        except ConnectError as exc:
            return got, exc
        return got, None

    got, error = asyncio.run(scenario(then_eof=False))
    assert got == [{"event": {"keepalive": {}}}]
    assert error is not None
    assert error.code == "deadline_exceeded", error
    assert "no message for 0.2 s" in str(error.message)
    assert asyncio.run(scenario(then_eof=True)) == ([{"event": {"keepalive": {}}}], None)


def _broken_body() -> Any:
    """A request whose body does not decode (a Content-Encoding: gzip that is not):
    aiohttp raises RequestPayloadError from every read of it."""
    import asyncio
    from unittest import mock

    from aiohttp.http_exceptions import ContentEncodingError
    from aiohttp.streams import StreamReader
    from aiohttp.test_utils import make_mocked_request
    from aiohttp.web_protocol import RequestPayloadError

    payload = StreamReader(
        mock.Mock(_reading_paused=False), 1 << 16, loop=asyncio.get_running_loop()
    )
    error = RequestPayloadError("400, message: Can not decode content-encoding: gzip")
    error.__cause__ = ContentEncodingError("gzip")
    payload.set_exception(error)
    return make_mocked_request(
        "POST",
        "/",
        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
        payload=payload,
    )


def test_a_body_that_does_not_decode_is_a_400_everywhere_it_is_read() -> None:
    import asyncio

    from sandbox_operator.gateway.app import Gateway, Refusal
    from sandbox_operator.gateway.e2b.control import Control
    from sandbox_operator.gateway.e2b.interpreter import Interpreter, InterpreterError

    settings = SimpleNamespace(head_seconds=5.0)
    gateway: Any = SimpleNamespace(settings=settings, upstreams=SimpleNamespace(body_seconds=5.0))
    adapter: Any = SimpleNamespace(gateway=gateway)

    async def scenario() -> None:
        with pytest.raises(core.E2BError) as refused:
            await Control(adapter).body(_broken_body())
        assert refused.value.status == 400
        with pytest.raises(InterpreterError) as refused_here:
            await Interpreter(adapter)._body(_broken_body(), 1 << 20)
        assert refused_here.value.status == 400
        with pytest.raises(Refusal) as refusal:
            await Gateway._json(cast(Any, gateway), _broken_body())
        assert refusal.value.status == 400

    asyncio.run(scenario())


def test_the_log_leaves_out_what_the_callers_body_did() -> None:
    import logging

    from aiohttp.web_protocol import RequestPayloadError

    from sandbox_operator.gateway.__main__ import CallerErrors

    def record(error: BaseException) -> logging.LogRecord:
        return logging.LogRecord(
            "aiohttp.server",
            logging.ERROR,
            "",
            0,
            "Unhandled exception",
            None,
            (type(error), error, None),
        )

    keep = CallerErrors()
    assert not keep.filter(record(RequestPayloadError("Can not decode content-encoding: gzip")))
    assert keep.filter(record(RuntimeError("ours")))
