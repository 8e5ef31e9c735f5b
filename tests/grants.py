"""What RBAC rules grant and what an audit log shows was used, as comparable
(apiGroup, resource, subresource, verb) permissions. Pure functions; the
least-privilege test feeds them the chart's rules and the API server's log."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any


@dataclass(frozen=True, order=True)
class Permission:
    group: str  # "" for the core group
    resource: str
    subresource: str  # "" for the object itself
    verb: str

    def __str__(self) -> str:
        sub = f"/{self.subresource}" if self.subresource else ""
        return f"{self.verb} {self.resource}{sub}" + (f".{self.group}" if self.group else "")


def granted(rules: Iterable[Mapping[str, Any]]) -> set[Permission]:
    """Every permission a ClusterRole's rules grant. Wildcards are refused: a
    least-privilege role names what it grants."""
    found: set[Permission] = set()
    for rule in rules:
        if "nonResourceURLs" in rule or "resourceNames" in rule:
            raise ValueError(f"rule not comparable with an audit log: {rule}")
        for field in ("apiGroups", "resources", "verbs"):
            if "*" in rule[field]:
                raise ValueError(f"wildcard in {field} of {rule}")
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                name, _, sub = resource.partition("/")
                found.update(Permission(group, name, sub, verb) for verb in rule["verbs"])
    return found


@dataclass
class Use:
    """How often a permission was exercised, and how often the authorizer refused
    it. Only the authorizer's decision counts: a 403 from admission (a
    terminating namespace, a ResourceQuota) is not a missing grant."""

    requests: int = 0
    refused: int = 0


def used(events: Iterable[Mapping[str, Any]], username: str) -> dict[Permission, Use]:
    """The resource requests `username` made, from audit events (JSON objects,
    one per stage: a request is counted once by its auditID). Requests for
    non-resource URLs (discovery, /version) are left out: every authenticated
    user may make them, whatever a role grants."""
    uses: dict[Permission, Use] = {}
    seen: set[str] = set()
    for event in events:
        ref = event.get("objectRef")
        if event["user"]["username"] != username or ref is None or event["auditID"] in seen:
            continue
        seen.add(event["auditID"])
        permission = Permission(
            ref.get("apiGroup", ""), ref["resource"], ref.get("subresource", ""), event["verb"]
        )
        use = uses.setdefault(permission, Use())
        use.requests += 1
        if event.get("annotations", {}).get("authorization.k8s.io/decision") == "forbid":
            use.refused += 1
    return uses


def audit_events(logs: Iterable[Path]) -> Iterable[dict[str, Any]]:
    """The events of kube-apiserver's JSON audit log files, in order."""
    for log in logs:
        with log.open() as lines:
            for line in lines:
                if line.strip():
                    yield json.loads(line)


def service_account(namespace: str, name: str) -> str:
    """The username a ServiceAccount's token authenticates as."""
    return f"system:serviceaccount:{namespace}:{name}"


def writes(
    events: Iterable[Mapping[str, Any]],
    username: str,
    namespace: str,
    names: Iterable[str],
    since: float,
    until: float,
) -> list[str]:
    """The writes `username` sent to objects `names` of `namespace` from `since`
    to `until` (epoch seconds), one per request, as "verb resource[/subresource]
    name code", in order: what a path through the operator costs the API server."""
    wanted = set(names)
    found: dict[str, str] = {}
    for event in events:
        ref = event.get("objectRef") or {}
        if (
            event["user"]["username"] != username
            or event["verb"] not in ("create", "update", "patch", "delete")
            or ref.get("namespace") != namespace
            or ref.get("name") not in wanted
        ):
            continue
        received = datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp()
        if since <= received <= until:
            sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
            code = (event.get("responseStatus") or {}).get("code")
            found[event["auditID"]] = f"{event['verb']} {ref['resource']}{sub} {ref['name']} {code}"
    return list(found.values())
