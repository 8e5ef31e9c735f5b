"""The control plane's pure half: E2B's request fields checked, a Sandbox built
from a create request, a Sandbox shown in E2B's JSON shapes (the list's
filters and pages: listing.py). No I/O (control.py does it).

How an E2B sandbox is written on its Sandbox:

    metadata.name                              the sandbox ID (core.new_id)
    label sandbox.dev/e2b: "true"              made through the E2B API (what its list shows)
    annotation sandbox.dev/e2b-metadata        the `metadata` map, as JSON (the truth)
    labels e2b.sandbox.dev/<key>: <value>      the pairs that fit a label (list filters)
    annotation sandbox.dev/e2b-template        the template name the caller asked for
    annotation sandbox.dev/e2b-started-at      creation time to the microsecond (list order)
    spec.lifecycle.expiresAt, onExpiry         the lease (`timeout`, `autoPause`)
    spec.env                                   `envVars`
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

from pydantic import ValidationError

from sandbox_operator.api.common import API_VERSION, ENV_NAME_PATTERN, GROUP, quantity_value
from sandbox_operator.api.sandbox import MAX_ENV_CHARACTERS, SandboxSpec
from sandbox_operator.clock import iso, iso_precise, parse_time
from sandbox_operator.config import Settings
from sandbox_operator.effective import effectively_paused, sandbox_spec
from sandbox_operator.gateway.e2b import core
from sandbox_operator.gateway.e2b.core import E2BError
from sandbox_operator.resources import LABEL_POOL

JSON = dict[str, Any]

E2B_LABEL = f"{GROUP}/e2b"
METADATA_ANNOTATION = f"{GROUP}/e2b-metadata"
TEMPLATE_ANNOTATION = f"{GROUP}/e2b-template"
STARTED_ANNOTATION = f"{GROUP}/e2b-started-at"
METADATA_LABEL_PREFIX = f"e2b.{GROUP}/"

RUNNING, PAUSED = "running", "paused"
STATES = (RUNNING, PAUSED)
ON_EXPIRY_DELETE, ON_EXPIRY_PAUSE = "Delete", "Pause"

# Bounds of what a caller may store (E2B states none; these keep a Sandbox small).
MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY = 256
MAX_METADATA_VALUE = 1024
MAX_METADATA_JSON = 32768
MAX_ENV_ENTRIES = 128
MAX_TEMPLATE_NAME = 253

# A label's name (after the prefix) and value.
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-_.A-Za-z0-9]{0,61}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-_.A-Za-z0-9]{0,61}[A-Za-z0-9])?)?")
_ENV_NAME = re.compile(ENV_NAME_PATTERN)
_MIB = 1 << 20

# What the operator's own defaults are when neither the Sandbox nor its template
# says (a chart may configure others; the E2B shapes are informative only).
_DEFAULTS = {
    name: str(Settings.model_fields[name].default)
    for name in ("default_cpu", "default_memory", "default_workspace_size")
}


def bad(message: str) -> E2BError:
    return E2BError(400, message)


def printable(text: str) -> bool:
    """No control characters or lone surrogates (they do not survive the API server)."""
    return not any(c < " " or c == "\x7f" or "\ud800" <= c <= "\udfff" for c in text)


# -- request fields ---------------------------------------------------------------------


def integer(body: Mapping[str, Any], name: str, default: int | None, low: int, high: int) -> int:
    value = body.get(name, default)
    if value is None and default is None:
        raise bad(f"{name} is required")
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad(f"{name} must be a whole number of seconds from {low} to {high}")
    return value


def boolean(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{name} must be true or false")
    return value


def string_map(value: Any, name: str, entries: int, key_max: int, value_max: int) -> dict[str, str]:
    """A JSON object of strings, within bounds (None: empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad(f"{name} must be an object of strings")
    if len(value) > entries:
        raise bad(f"{name} may hold at most {entries} entries")
    for key, item in value.items():
        if not isinstance(item, str):
            raise bad(f"{name}[{key[:64]!r}] must be a string")
        if not 1 <= len(key) <= key_max or not printable(key):
            raise bad(f"{name}: a key is 1 to {key_max} printable characters")
        if len(item) > value_max or not printable(item):
            raise bad(f"{name}[{key[:64]!r}]: at most {value_max} printable characters")
    return dict(value)


def metadata_map(value: Any) -> dict[str, str]:
    found = string_map(
        value, "metadata", MAX_METADATA_ENTRIES, MAX_METADATA_KEY, MAX_METADATA_VALUE
    )
    if len(json.dumps(found)) > MAX_METADATA_JSON:
        raise bad(f"metadata may hold at most {MAX_METADATA_JSON} characters as JSON")
    return found


def env_map(value: Any) -> dict[str, str]:
    found = string_map(value, "envVars", MAX_ENV_ENTRIES, 256, 32768)
    for key in found:
        if not _ENV_NAME.fullmatch(key):
            raise bad(f"envVars: {key[:64]!r} is not a variable name (letters, digits, -._)")
    if sum(len(v) for v in found.values()) > MAX_ENV_CHARACTERS:
        raise bad(f"envVars: the values may hold at most {MAX_ENV_CHARACTERS} characters")
    return found


@dataclass(frozen=True)
class CreateRequest:
    template: str
    timeout: int
    auto_pause: bool
    metadata: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    # allow_internet_access: None leaves the template's egress policy.
    internet: bool | None = None


# Fields of E2B's NewSandbox this adapter cannot honour: refused, not ignored,
# when a caller sets them to anything but their "off" value.
_UNSUPPORTED = {
    "iam": "workload identity tokens are not supported here",
    "volumeMounts": "volumes are not supported here (the sandbox has its own workspace)",
    "network": "per-sandbox network rules are not supported here; allow_internet_access"
    " or the template's spec.network decide egress",
}


def _private_traffic(body: JSON, name: str) -> bool:
    """`network: {allowPublicTraffic: false}` alone: a sandbox's ports need its
    traffic token. Here they need a credential always (the token, or RBAC on
    `sandboxes/ports`), so that is what happens anyway; `true` (ports open to
    anyone) cannot be granted per sandbox and stays refused."""
    network = body.get(name)
    return (
        name == "network"
        and isinstance(network, dict)
        and set(network) == {"allowPublicTraffic"}
        and network["allowPublicTraffic"] is False
    )


def parse_create(body: JSON, default_timeout: int, max_timeout: int) -> CreateRequest:
    template = body.get("templateID")
    if not isinstance(template, str) or not 1 <= len(template) <= MAX_TEMPLATE_NAME:
        raise bad(f"templateID: a template name of 1 to {MAX_TEMPLATE_NAME} characters")
    for name, why in _UNSUPPORTED.items():
        if body.get(name) not in (None, {}, []) and not _private_traffic(body, name):
            raise bad(f"{name}: {why}")
    # `mcp` is the SDK's to act on (it starts the MCP gateway as a command in the
    # sandbox, which says so when the image has none): nothing here to do.
    if body.get("mcp") is not None and not isinstance(body["mcp"], dict):
        raise bad("mcp must be an object")
    resume = body.get("autoResume")
    if resume is not None:
        if not isinstance(resume, dict) or not isinstance(resume.get("enabled", False), bool):
            raise bad("autoResume must be an object {enabled: bool}")
        if resume.get("enabled"):
            raise bad("autoResume: a paused sandbox resumes through connect only here")
    for flag in ("autoPauseMemory", "secure"):
        boolean(body, flag, True)  # checked, then ignored: no memory snapshots; always secured
    internet = body.get("allow_internet_access")
    if internet is not None and not isinstance(internet, bool):
        raise bad("allow_internet_access must be true or false")
    return CreateRequest(
        template=template,
        timeout=integer(body, "timeout", default_timeout, 1, max_timeout),
        auto_pause=boolean(body, "autoPause", False),
        metadata=metadata_map(body.get("metadata")),
        env=env_map(body.get("envVars")),
        internet=internet,
    )


# -- the Sandbox of a create request --------------------------------------------------


def metadata_labels(metadata: Mapping[str, str]) -> dict[str, str]:
    """The metadata pairs that fit a label, as labels (the rest is in the annotation)."""
    return {
        METADATA_LABEL_PREFIX + key: value
        for key, value in metadata.items()
        if _LABEL_NAME.fullmatch(key) and _LABEL_VALUE.fullmatch(value)
    }


def lease_end(now: datetime, seconds: int) -> str:
    return iso(now + timedelta(seconds=seconds))


# A warm claim is Ready well within this: a first lease this much longer than
# asked needs no second write once the sandbox is Ready (`lease_after_start`),
# which keeps a round trip to the API server out of the common create.
START_GRACE_SECONDS = 2


def first_lease(now: datetime, timeout: int, start_seconds: float) -> str:
    """The lease a sandbox is made with: `timeout` and the grace from now, and
    never shorter than the longest start create waits for (`start_seconds`), so
    no lease ends before its sandbox ever ran."""
    return lease_end(now, max(timeout + START_GRACE_SECONDS, math.ceil(start_seconds)))


def lease_after_start(first: str, ready_at: datetime, timeout: int) -> str | None:
    """The lease to write once the sandbox is Ready at `ready_at` (E2B's timeout
    runs from when a sandbox can first be used); None when the first lease
    already ends within the grace after that."""
    wanted = ready_at.replace(microsecond=0) + timedelta(seconds=timeout)
    extra = (parse_time(first) - wanted).total_seconds()
    return None if 0 <= extra <= START_GRACE_SECONDS else iso(wanted)


def sandbox_body(
    name: str,
    ask: CreateRequest,
    template_ref: JSON,
    pool: str | None,
    now: datetime,
    start_seconds: float = 0,
) -> JSON:
    """The Sandbox a create request makes: from a warm member of `pool` when one
    serves its template, else from the template itself. Its lease allows
    `start_seconds` for the start (`first_lease`): it runs from Ready, where
    create writes it again when it must."""
    spec: JSON = {"poolRef": {"name": pool}} if pool else {"templateRef": template_ref}
    if ask.env:
        spec["env"] = [{"name": k, "value": v} for k, v in ask.env.items()]
    if ask.internet is False:
        spec["network"] = {"egress": "None"}
    spec["lifecycle"] = {
        "expiresAt": first_lease(now, ask.timeout, start_seconds),
        "onExpiry": ON_EXPIRY_PAUSE if ask.auto_pause else ON_EXPIRY_DELETE,
    }
    # Checked as the API server will, so a bad field is a 400 that names it.
    try:
        SandboxSpec.model_validate(spec)
    except ValidationError as exc:
        raise bad(f"the sandbox cannot be made: {exc.errors()[0].get('msg', exc)}") from exc
    return {
        "apiVersion": API_VERSION,
        "kind": "Sandbox",
        "metadata": {
            "name": name,
            "labels": {E2B_LABEL: "true", **metadata_labels(ask.metadata)},
            "annotations": {
                METADATA_ANNOTATION: json.dumps(ask.metadata, separators=(",", ":")),
                TEMPLATE_ANNOTATION: ask.template,
                STARTED_ANNOTATION: iso_precise(now),
            },
        },
        "spec": spec,
    }


# -- a Sandbox in E2B's shapes ------------------------------------------------------------


@dataclass(frozen=True)
class View:
    """What E2B's shapes say of one Sandbox."""

    id: str
    uid: str
    namespace: str
    template_id: str
    alias: str
    started_at: str
    end_at: str
    state: str
    cpu_count: int
    memory_mb: int
    disk_mb: int
    metadata: dict[str, str]
    # The lease as written (None when the Sandbox has none) and what ends it.
    expires_at: datetime | None
    on_expiry: str
    # Paused by spec.paused (E2B's pause), or by the operator (idle policy, lease).
    paused_by_spec: bool
    paused_by_operator: bool
    pod: str | None


def is_pool_member(body: JSON) -> bool:
    """A warm member waiting in a pool, or one serving another Sandbox: for its
    claimer, never to be used by its own name."""
    meta = body["metadata"]
    if LABEL_POOL in (meta.get("labels") or {}):
        return True
    return any(
        o.get("controller") and o.get("kind") == "Sandbox"
        for o in meta.get("ownerReferences") or []
    )


def lifecycle_of(body: JSON) -> JSON:
    lifecycle = ((body.get("spec") or {}).get("lifecycle")) or {}
    return lifecycle if isinstance(lifecycle, dict) else {}


def _cores(value: str) -> int:
    try:
        return max(1, math.ceil(quantity_value(value)))
    except (InvalidOperation, ValueError, TypeError):
        return 1


def _mib(value: str) -> int:
    try:
        return int(quantity_value(value) / Decimal(_MIB))
    except (InvalidOperation, ValueError, TypeError):
        return 0


def _template_of(body: JSON, asked: str) -> str:
    spec, status = body.get("spec") or {}, body.get("status") or {}
    for ref in (
        spec.get("templateRef"),
        status.get("template"),
        (status.get("pool") or {}).get("templateRef"),
    ):
        if isinstance(ref, dict) and isinstance(ref.get("name"), str):
            return str(ref["name"])
    return asked or str(spec.get("runtime") or spec.get("image") or "")


def view_of(body: JSON, now: datetime) -> View | None:
    """The sandbox as E2B shows it; None when, for E2B, it is gone: being
    deleted, or past a lease whose end deletes it (the operator is on its way)."""
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return None
    annotations = meta.get("annotations") or {}
    status = body.get("status") or {}
    try:
        # As it runs: its own fields over its template's (a template may lease too).
        spec: SandboxSpec | None = sandbox_spec(body)
    except ValidationError:
        spec = None  # the operator refuses it (InvalidSpec); it can still be killed
    lifecycle = lifecycle_of(body)
    lease, on_expiry = lifecycle.get("expiresAt"), lifecycle.get("onExpiry")
    if spec is not None:
        lease, on_expiry = spec.lifecycle.expires_at, spec.lifecycle.on_expiry.value
    expires = None
    if isinstance(lease, str):
        with contextlib.suppress(ValueError):
            expires = parse_time(lease)
    on_expiry = ON_EXPIRY_PAUSE if on_expiry == ON_EXPIRY_PAUSE else ON_EXPIRY_DELETE
    lease_over = expires is not None and expires <= now
    if lease_over and on_expiry == ON_EXPIRY_DELETE:
        return None
    if spec is not None:
        by_spec = spec.paused
        by_operator = effectively_paused(body, spec) and not by_spec
        cpu = spec.resources.cpu or _DEFAULTS["default_cpu"]
        memory = spec.resources.memory or _DEFAULTS["default_memory"]
        disk = spec.workspace.size or _DEFAULTS["default_workspace_size"]
    else:
        by_spec, by_operator = bool((body.get("spec") or {}).get("paused")), False
        cpu, memory = _DEFAULTS["default_cpu"], _DEFAULTS["default_memory"]
        disk = _DEFAULTS["default_workspace_size"]
    paused = by_spec or by_operator or lease_over
    started = str(annotations.get(STARTED_ANNOTATION) or meta.get("creationTimestamp") or iso(now))
    if expires is not None:
        end = iso(expires)
    else:  # no lease (paused through E2B, or not made through it)
        end = str(
            status.get("pausedSince")
            or status.get("expiresAt")
            or status.get("idleDeadline")
            or iso(now)
        )
    asked = str(annotations.get(TEMPLATE_ANNOTATION) or "")
    return View(
        id=meta["name"],
        uid=meta.get("uid", ""),
        namespace=meta.get("namespace", ""),
        template_id=_template_of(body, asked),
        alias=asked or _template_of(body, asked),
        started_at=started,
        end_at=end,
        state=PAUSED if paused else RUNNING,
        cpu_count=_cores(cpu),
        memory_mb=_mib(memory),
        disk_mb=_mib(disk),
        metadata=stored_metadata(annotations),
        expires_at=expires,
        on_expiry=on_expiry,
        paused_by_spec=by_spec,
        paused_by_operator=by_operator or (lease_over and not by_spec),
        pod=status.get("podName"),
    )


def stored_metadata(annotations: Mapping[str, str]) -> dict[str, str]:
    try:
        found = json.loads(annotations.get(METADATA_ANNOTATION) or "{}")
    except ValueError:
        return {}
    if not isinstance(found, dict):
        return {}
    return {str(k): str(v) for k, v in found.items() if isinstance(v, str)}


def listed(view: View) -> JSON:
    """E2B's ListedSandbox."""
    return {
        "templateID": view.template_id,
        "alias": view.alias,
        "sandboxID": view.id,
        "clientID": view.namespace,
        "startedAt": view.started_at,
        "endAt": view.end_at,
        "cpuCount": view.cpu_count,
        "memoryMB": view.memory_mb,
        "diskSizeMB": view.disk_mb,
        "metadata": view.metadata,
        "state": view.state,
        "envdVersion": core.ENVD_VERSION,
    }


def detail(view: View, domain: str | None) -> JSON:
    """E2B's SandboxDetail."""
    return {
        **listed(view),
        "domain": domain,
        "lifecycle": {
            "autoResume": False,
            "onTimeout": "pause" if view.on_expiry == ON_EXPIRY_PAUSE else "kill",
        },
    }


def created(view: View, token: str, domain: str | None) -> JSON:
    """E2B's Sandbox (the answer of create and connect)."""
    return {
        "templateID": view.template_id,
        "alias": view.alias,
        "sandboxID": view.id,
        "clientID": view.namespace,
        "envdVersion": core.ENVD_VERSION,
        "envdAccessToken": token,
        "trafficAccessToken": token,
        "domain": domain,
    }
