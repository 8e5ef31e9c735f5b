"""E2B's sandbox list: its query (filters, order, page size, paging token),
what the API server can narrow it to by label, and one page of it. Pure.

Paging is by cursor: the token names where the previous page ended (the last
sandbox's start time and ID), so a page stays consistent while sandboxes come
and go, and a token is checked like any other input (400 when this API did not
hand it out).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from urllib.parse import parse_qsl, unquote

from sandbox_operator.clock import parse_time
from sandbox_operator.gateway.e2b.core import whole
from sandbox_operator.gateway.e2b.shapes import (
    E2B_LABEL,
    MAX_METADATA_ENTRIES,
    MAX_METADATA_JSON,
    MAX_TEMPLATE_NAME,
    RUNNING,
    STATES,
    View,
    bad,
    metadata_labels,
    printable,
)

# E2B's page size bounds.
DEFAULT_LIMIT = 100
MAX_LIMIT = 100
MAX_TOKEN = 1024


@dataclass(frozen=True)
class ListQuery:
    metadata: dict[str, str]
    states: frozenset[str]
    descending: bool
    started_after: datetime | None
    template: str | None
    limit: int
    after: Cursor | None


@dataclass(frozen=True)
class Cursor:
    """Where the previous page ended: the last sandbox it held."""

    started: str
    name: str


def encode_token(cursor: Cursor) -> str:
    raw = json.dumps({"s": cursor.started, "n": cursor.name}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).rstrip(b"=").decode()


def decode_token(token: str) -> Cursor:
    problem = bad("nextToken is not a token this API handed out")
    if not 1 <= len(token) <= MAX_TOKEN or not re.fullmatch(r"[A-Za-z0-9_-]+", token):
        raise problem
    try:
        found = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    except (ValueError, binascii.Error) as exc:
        raise problem from exc
    if not isinstance(found, dict) or set(found) != {"s", "n"}:
        raise problem
    started, name = found["s"], found["n"]
    if not isinstance(started, str) or not isinstance(name, str) or len(name) > 253:
        raise problem
    try:
        parse_time(started)
    except ValueError as exc:
        raise problem from exc
    return Cursor(started, name)


def parse_metadata_query(text: str) -> dict[str, str]:
    """E2B's metadata filter: `k=v&k2=v2`, each key and value URL-encoded (again)."""
    if len(text) > MAX_METADATA_JSON:
        raise bad("metadata: the filter is too long")
    try:
        pairs = parse_qsl(text, keep_blank_values=True, strict_parsing=bool(text))
    except ValueError as exc:
        raise bad("metadata: a filter is key=value pairs joined by &") from exc
    found: dict[str, str] = {}
    for key, value in pairs:
        key, value = unquote(key), unquote(value)
        if not key or not printable(key) or not printable(value):
            raise bad("metadata: a filter key is printable and not empty")
        found[key] = value
    if len(found) > MAX_METADATA_ENTRIES:
        raise bad(f"metadata: at most {MAX_METADATA_ENTRIES} pairs")
    return found


def parse_list(params: Mapping[str, str], *, v2: bool) -> ListQuery:
    states: frozenset[str] = frozenset(STATES) if v2 else frozenset({RUNNING})
    if v2 and "state" in params:
        asked = {s.strip() for s in params["state"].split(",") if s.strip()}
        if not asked or not asked <= set(STATES):
            raise bad(f"state: a comma-separated list of {', '.join(STATES)}")
        states = frozenset(asked)
    order = params.get("order", "desc") if v2 else "desc"
    if order not in ("asc", "desc"):
        raise bad("order: asc or desc")
    started_after = None
    if v2 and params.get("startedAfter"):
        try:
            started_after = parse_time(params["startedAfter"])
        except ValueError as exc:
            raise bad("startedAfter: an RFC 3339 time") from exc
        if started_after.tzinfo is None:
            started_after = started_after.replace(tzinfo=UTC)
    template = params.get("template") if v2 else None
    if template is not None and not 1 <= len(template) <= MAX_TEMPLATE_NAME:
        raise bad("template: a template name")
    limit = DEFAULT_LIMIT
    if v2 and "limit" in params:
        number = whole(params["limit"], 3)
        if number is None or not 1 <= number <= MAX_LIMIT:
            raise bad(f"limit: a whole number from 1 to {MAX_LIMIT}")
        limit = number
    token = params.get("nextToken") if v2 else None
    return ListQuery(
        metadata=parse_metadata_query(params.get("metadata", "")),
        states=states,
        descending=order == "desc",
        started_after=started_after,
        template=template,
        limit=limit,
        after=decode_token(token) if token else None,
    )


def label_selector(metadata: Mapping[str, str]) -> str:
    """What the API server can narrow the list to: E2B's label, and the filter's
    pairs that fit labels (a pair that does not fit is on no sandbox's labels,
    so the annotation decides it)."""
    terms = [f"{E2B_LABEL}=true"]
    terms += [f"{key}={value}" for key, value in sorted(metadata_labels(metadata).items())]
    return ",".join(terms)


def _order_key(view: View) -> tuple[datetime, str]:
    return parse_time(view.started_at), view.id


def selected(views: Iterable[View], query: ListQuery) -> list[View]:
    """The views the query's filters select (every filter; no order, no paging)."""
    return [
        v
        for v in views
        if v.state in query.states
        and all(v.metadata.get(k) == value for k, value in query.metadata.items())
        and (query.started_after is None or parse_time(v.started_at) >= query.started_after)
        and (query.template is None or query.template in (v.template_id, v.alias))
    ]


def running_total(views: Iterable[View], query: ListQuery) -> int:
    """E2B's X-Total-Running: the running sandboxes the filters select, all pages."""
    return len(selected(views, replace(query, states=frozenset({RUNNING}))))


def page(views: Iterable[View], query: ListQuery) -> tuple[list[View], Cursor | None]:
    """The views the query selects, in its order, after its cursor, at most
    `limit` of them; and the cursor of the next page when there is one."""
    chosen = selected(views, query)
    chosen.sort(key=_order_key, reverse=query.descending)
    if query.after is not None:
        mark = (parse_time(query.after.started), query.after.name)
        chosen = [
            v
            for v in chosen
            if (_order_key(v) < mark if query.descending else _order_key(v) > mark)
        ]
    shown = chosen[: query.limit]
    more = len(chosen) > query.limit
    return shown, (Cursor(shown[-1].started_at, shown[-1].id) if more else None)
