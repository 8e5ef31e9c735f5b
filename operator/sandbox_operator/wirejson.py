"""JSON from the API server, parsed so that what the operator keeps is small.

Nearly every object the operator parses lives on: Kopf keeps the latest body
of every Sandbox and Execution, and the indexes keep Sandboxes, pods and
claims. The standard library's parser makes a new string for every key and
value of every document, so 10,000 kept bodies hold 10,000 copies of
"lastTransitionTime", of "True" and of the namespace's name. pydantic-core's
parser (there through pydantic) hands out one string for repeats of up to 64
bytes, from a cache of fixed size: what the operator keeps of the parsed
documents went from 21 to 8 KiB per Sandbox (docs/benchmarks.md, "Where the
operator's memory goes").

Every document the operator and Kopf read comes through here: the operator's
own client (`kube.py`), Kopf's responses (the session's `response_class`,
`login.py`) and Kopf's watch events, which Kopf parses with the `json` of its
API module (`use_in_kopf`).
"""

from __future__ import annotations

import importlib
import json
import logging
import types
from typing import Any

import aiohttp
import pydantic_core

log = logging.getLogger(__name__)

# Where Kopf parses each line of a watch stream: `json.loads` of this module.
KOPF_API_MODULE = "kopf._cogs.clients.api"


def loads(data: str | bytes | bytearray) -> Any:
    """`json.loads`, with repeated strings shared."""
    return pydantic_core.from_json(data, cache_strings="all")


class Response(aiohttp.ClientResponse):
    """aiohttp's response, whose `json()` parses with `loads`."""

    async def json(
        self,
        *,
        encoding: str | None = None,
        loads: Any = loads,
        content_type: str | None = "application/json",
    ) -> Any:
        return await super().json(encoding=encoding, loads=loads, content_type=content_type)


def use_in_kopf(module_name: str = KOPF_API_MODULE) -> bool:
    """Have Kopf parse watch events with `loads`; whether it took.

    Kopf has no setting for its parser, so its API module's `json` is replaced
    by one whose `loads` is ours (the rest is the standard module's). A Kopf
    that parses elsewhere keeps its own parser, with a warning here and a
    failing unit test (tests/unit/test_wirejson.py)."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        module = None
    current = getattr(module, "json", None)
    if getattr(current, "loads", None) is loads:
        return True  # a second call
    if module is None or current is not json:
        log.warning("Kopf's watch events keep the standard JSON parser: %s moved", module_name)
        return False
    shim = types.ModuleType("json", "The standard json module, with sandbox_operator's loads.")
    shim.__dict__.update({k: v for k, v in vars(json).items() if not k.startswith("__")})
    shim.loads = loads  # type: ignore[attr-defined]
    module.json = shim  # type: ignore[attr-defined]
    return True
