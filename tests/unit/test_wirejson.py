"""The operator's JSON parser (wirejson.py): what the standard parser gives, with
repeated strings shared across documents, in the operator's client, in Kopf's
responses and in Kopf's watch events."""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sandbox_operator import wirejson

POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "demo", "namespace": "team-a", "resourceVersion": "123456789012"},
    "spec": {"containers": [{"name": "sandbox", "env": [{"name": "LANG", "value": "C.UTF-8"}]}]},
    "status": {
        "phase": "Running",
        "conditions": [
            {"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-30T22:49:21Z"},
            {"type": "Initialized", "status": "True", "lastProbeTime": None},
        ],
        "podIP": "10.244.0.5",
    },
    "odd": {"big": 2**70, "float": 0.25, "unicode": "z\u00fcrich \u2603", "empty": {}},
}


def test_it_parses_what_the_standard_parser_parses() -> None:
    text = json.dumps(POD)
    assert wirejson.loads(text) == json.loads(text) == POD
    assert wirejson.loads(text.encode()) == POD


def test_repeated_strings_are_one_object_across_documents() -> None:
    text = json.dumps(POD)
    one, two = wirejson.loads(text), wirejson.loads(text)
    key_one = next(k for k in one["status"]["conditions"][0] if k == "lastTransitionTime")
    key_two = next(k for k in two["status"]["conditions"][0] if k == "lastTransitionTime")
    assert key_one is key_two
    assert one["metadata"]["namespace"] is two["metadata"]["namespace"]
    # The standard parser makes a copy per document.
    three, four = json.loads(text), json.loads(text)
    assert three["metadata"]["namespace"] is not four["metadata"]["namespace"]


def test_bad_json_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"EOF|expected"):
        wirejson.loads('{"metadata": ')


@pytest.fixture
def kopf_api() -> Iterator[Any]:
    module: Any = importlib.import_module(wirejson.KOPF_API_MODULE)
    before = module.json
    yield module
    module.json = before


def test_kopf_parses_watch_events_with_it(kopf_api: Any) -> None:
    """A Kopf that parses its watch streams elsewhere fails here: its events
    would keep the standard parser (and a warning at the operator's start)."""
    assert kopf_api.json is json
    assert wirejson.use_in_kopf()
    assert kopf_api.json.loads is wirejson.loads
    assert kopf_api.json.dumps is json.dumps
    assert wirejson.use_in_kopf()  # again: no change, no warning
    assert kopf_api.json.loads is wirejson.loads


def test_a_missing_kopf_module_is_a_warning_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert not wirejson.use_in_kopf("kopf._no_such_module")
    assert "standard JSON parser" in caplog.text


def test_responses_of_a_session_with_its_response_class() -> None:
    """A real server on loopback; the session as login.py makes Kopf's."""

    async def run() -> tuple[Any, Any]:
        async def handler(_: web.Request) -> web.Response:
            return web.json_response(POD)

        app = web.Application()
        app.router.add_get("/pod", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession(response_class=wirejson.Response) as session:
                got = []
                for _ in range(2):
                    async with session.get(f"http://127.0.0.1:{port}/pod") as response:
                        got.append(await response.json())
                return got[0], got[1]
        finally:
            await runner.cleanup()

    one, two = asyncio.run(run())
    assert one == POD
    assert one["metadata"]["namespace"] is two["metadata"]["namespace"]
