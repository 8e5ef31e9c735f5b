"""Sandbox reconciliation: children from builders, status from observation.

Every entry point (create/update/resume, the periodic timer, pod events) ends
in `reconcile`, which is level-based: it looks at what exists and converges,
so a missed event or an operator restart at any moment costs nothing.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import Enum
from typing import Any, cast

import kopf
from pydantic import ValidationError

from sandbox_operator import conditions, metrics
from sandbox_operator.agent_client import AgentClient, AgentError, parse_time
from sandbox_operator.api.common import parse_duration
from sandbox_operator.api.sandbox import OnIdle, SandboxSpec
from sandbox_operator.builders import sandbox as build
from sandbox_operator.config import Settings
from sandbox_operator.kube import MERGE_PATCH, Kube, KubeError, resource_path

JSON = dict[str, Any]

RESUME_ANNOTATION = "sandbox.dev/resume-requested-at"
POD_HASH_ANNOTATION = "sandbox.dev/pod-spec-hash"
SANDBOXES = ("sandbox.dev/v1alpha1", "sandboxes")
# How long teardown waits for a graceful pod exit before forcing it.
POD_DELETE_PATIENCE = timedelta(seconds=60)
CREATE_RETRY_SECONDS = 3


class Children(Enum):
    """How much of the Sandbox's children a reconciliation looks after."""

    # Only the pod (timer, pod events): cheapest, the common case.
    POD = "pod"
    # Create missing children, leave existing ones be (creation, operator restart).
    ENSURE = "ensure"
    # Also bring drifted children back to the spec (spec updates).
    CONVERGE = "converge"


@dataclass
class Runtime:
    """Process-wide collaborators, created once at startup and kept in Kopf's memo."""

    settings: Settings
    kube: Kube
    agents: AgentClient
    # One reconciliation per Sandbox at a time: create/update handlers, the timer
    # and pod events all converge the same object and must not interleave.
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    # The status this process last wrote per Sandbox. The operator is the only
    # writer of status, so this is fresher than a body Kopf received earlier.
    statuses: dict[tuple[str, str], JSON] = field(default_factory=dict)

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())

    def forget(self, namespace: str, name: str) -> None:
        self.locks.pop((namespace, name), None)
        self.statuses.pop((namespace, name), None)


def event(body: JSON, kind: str, reason: str, message: str) -> None:
    """A Kubernetes Event on the Sandbox, posted in the background.

    kopf.event, not kopf.info: the latter obeys the posting level, which is set
    to WARNING so that routine handler chatter stays out of Events."""
    kopf.event(
        cast(kopf.Body, body),
        type="Normal" if kind == "info" else "Warning",
        reason=reason,
        message=message,
    )


def now_utc() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


def iso(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _path(plural: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    api_version = {
        "sandboxes": SANDBOXES[0],
        "networkpolicies": "networking.k8s.io/v1",
    }.get(plural, "v1")
    return resource_path(api_version, plural, namespace, name, sub)


def readable(error: ValidationError) -> str:
    """One line per problem, with the field path as the user wrote it."""
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"])
        parts.append(f"spec.{where}: {item['msg']}")
    return "; ".join(parts)


def parse_spec(body: JSON, settings: Settings) -> tuple[SandboxSpec | None, str | None]:
    """(spec, None), or (spec or None, why it cannot run)."""
    try:
        spec = SandboxSpec.model_validate(body.get("spec") or {})
    except ValidationError as exc:
        return None, readable(exc)
    try:
        build.image_of(spec, settings)
    except ValueError as exc:
        return spec, f"spec.runtime: {exc}"
    return spec, None


def ref_of(body: JSON) -> build.SandboxRef:
    meta = body["metadata"]
    return build.SandboxRef(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def _hash(obj: JSON) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def desired_pod(ref: build.SandboxRef, spec: SandboxSpec, settings: Settings) -> JSON:
    """The pod, stamped with a hash of the Sandbox spec it was built from.

    The hash covers the spec, not the built pod: a change of operator settings
    (a new agent image, say) reaches each sandbox at its next pod start instead
    of killing every running sandbox at once. `paused` is left out: pausing
    is handled by deleting the pod, not by replacing it."""
    pod = build.build_pod(ref, spec, settings)
    stamped = spec.model_copy(update={"paused": False}).to_wire()
    pod["metadata"]["annotations"][POD_HASH_ANNOTATION] = _hash(stamped)
    return pod


def effective_paused(body: JSON, spec: SandboxSpec) -> bool:
    """Paused by the user (spec) or by the idle policy (status), unless resumed since."""
    if spec.paused:
        return True
    idle_paused_at = (body.get("status") or {}).get("idlePausedAt")
    if not idle_paused_at:
        return False
    resumed = (body["metadata"].get("annotations") or {}).get(RESUME_ANNOTATION)
    try:
        return not (resumed and parse_time(resumed) > parse_time(idle_paused_at))
    except ValueError:
        return True


async def _create_or_converge(kube: Kube, plural: str, obj: JSON, converge: bool) -> None:
    namespace = obj["metadata"]["namespace"]
    created = await kube.create(_path(plural, namespace), obj)
    if created is None and converge:
        # Exists: bring its spec in line (merge patch replaces lists wholesale,
        # which is what we want for a fully-specified desired object).
        await kube.patch(_path(plural, namespace, obj["metadata"]["name"]), {"spec": obj["spec"]})


async def ensure_children(
    rt: Runtime, ref: build.SandboxRef, spec: SandboxSpec, converge: bool
) -> None:
    """Create what is missing; with `converge`, also update what drifted. Idempotent."""
    kube, settings = rt.kube, rt.settings
    child = build.names(ref.name)
    # The token is random, so only ever created, never replaced (409 = keep the old one).
    await kube.create(
        _path("secrets", ref.namespace), build.build_secret(ref, secrets.token_urlsafe(32))
    )
    claim = build.build_claim(ref, spec, settings)
    if claim is not None:
        await kube.create(_path("persistentvolumeclaims", ref.namespace), claim)
    await _create_or_converge(
        kube, "networkpolicies", build.build_network_policy(ref, spec, settings), converge
    )
    service = build.build_service(ref, spec)
    if service is not None:
        await _create_or_converge(kube, "services", service, converge)
    elif converge:
        await kube.delete(_path("services", ref.namespace, child["service"]))


async def ensure_pod(
    rt: Runtime, body: JSON, spec: SandboxSpec, pod: JSON | None, logger: kopf.Logger
) -> JSON | None:
    """Converge the pod: create it, replace it when its spec changed or it ended,
    delete it when paused. Returns the pod as it now stands (None if absent)."""
    ref = ref_of(body)
    path = _path("pods", ref.namespace)
    if effective_paused(body, spec):
        if pod is not None and not pod["metadata"].get("deletionTimestamp"):
            await rt.kube.delete(f"{path}/{pod['metadata']['name']}", uid=pod["metadata"]["uid"])
            event(body, "info", reason="Paused", message="pod deleted, workspace kept")
        return pod
    desired = desired_pod(ref, spec, rt.settings)
    if pod is not None:
        if pod["metadata"].get("deletionTimestamp"):
            return pod  # going away; recreated once gone
        phase = pod.get("status", {}).get("phase")
        outdated = (pod["metadata"].get("annotations") or {}).get(POD_HASH_ANNOTATION) != desired[
            "metadata"
        ]["annotations"][POD_HASH_ANNOTATION]
        if phase in ("Failed", "Succeeded") or outdated:
            why = "the sandbox spec changed" if outdated else f"pod {phase}"
            logger.info("replacing pod: %s", why)
            event(body, "info", reason="PodReplaced", message=f"replacing the pod: {why}")
            metrics.POD_RECREATIONS.inc()
            await rt.kube.delete(f"{path}/{pod['metadata']['name']}", uid=pod["metadata"]["uid"])
        return pod
    created = await rt.kube.create(path, desired)
    if created is None:  # a namesake exists that our view has not caught up with
        return await rt.kube.get(f"{path}/{desired['metadata']['name']}")
    return created


def build_status(
    body: JSON,
    spec: SandboxSpec | None,
    observed: conditions.Observed,
    settings: Settings,
    now: datetime,
    extra: JSON,
) -> JSON:
    """The complete status object for this observation (pure)."""
    old = body.get("status") or {}
    phase, conds = conditions.compute(observed)
    pod = observed.pod or {}
    pod_ip = pod.get("status", {}).get("podIP") if observed.pod else None
    status: JSON = {
        "phase": phase,
        "observedGeneration": observed.generation,
        "conditions": conditions.merge(
            old.get("conditions", []), conds, observed.generation, iso(now)
        ),
        "podName": pod.get("metadata", {}).get("name"),
        "podIP": pod_ip,
        "agentEndpoint": f"http://{pod_ip}:{settings.agent_port}" if pod_ip else None,
    }
    if spec is not None and observed.invalid is None:
        status["image"] = build.image_of(spec, settings)
        if not spec.workspace.ephemeral:
            status["workspaceClaim"] = build.names(body["metadata"]["name"])["claim"]
        lifetime = spec.lifecycle.max_lifetime or settings.default_max_lifetime
        if lifetime:
            created = parse_time(body["metadata"]["creationTimestamp"])
            status["expiresAt"] = iso(created + parse_duration(lifetime))
    for key in ("lastActivity", "idleDeadline", "activeExecutions", "idlePausedAt"):
        if key in old:
            status[key] = old[key]
    status.update(extra)
    return {k: v for k, v in status.items() if v is not None}


def _same(old: JSON, new: JSON) -> bool:
    return all(old.get(k) == v for k, v in new.items()) and all(k in new for k in old)


async def write_status(rt: Runtime, body: JSON, status: JSON) -> None:
    """Patch status only when it changed: every write costs the API server."""
    old = body.get("status") or {}
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    metrics.PHASES.set(*key, status.get("phase", ""))
    if _same(old, status):
        rt.statuses[key] = status
        return
    patch: JSON = {"status": {**{k: None for k in old if k not in status}, **status}}
    written = await rt.kube.patch(
        _path("sandboxes", meta["namespace"], meta["name"], "status"), patch, MERGE_PATCH
    )
    if written is not None:
        rt.statuses[key] = status
    body["status"] = status


async def _agent_token(rt: Runtime, body: JSON, memo: Any) -> str | None:
    token: str | None = memo.get("agent_token")
    if token:
        return token
    ref = ref_of(body)
    secret = await rt.kube.get(_path("secrets", ref.namespace, build.names(ref.name)["secret"]))
    if not secret:
        return None
    token = base64.b64decode(secret.get("data", {}).get(build.TOKEN_KEY, "")).decode()
    memo["agent_token"] = token
    return token


async def lifecycle(
    rt: Runtime,
    body: JSON,
    spec: SandboxSpec,
    status: JSON,
    memo: Any,
    now: datetime,
    logger: kopf.Logger,
) -> JSON:
    """Idle timeout and max lifetime. Returns status fields to add."""
    extra: JSON = {}
    expires_at = status.get("expiresAt")
    if expires_at and now >= parse_time(expires_at):
        logger.info("max lifetime reached; deleting")
        event(body, "info", reason="MaxLifetimeReached", message=f"expired at {expires_at}")
        metrics.TEARDOWNS.labels("max_lifetime").inc()
        meta = body["metadata"]
        await rt.kube.delete(_path("sandboxes", meta["namespace"], meta["name"]), uid=meta["uid"])
        return extra

    idle_timeout = spec.lifecycle.idle_timeout or rt.settings.default_idle_timeout
    endpoint = status.get("agentEndpoint")
    if status.get("phase") != conditions.RUNNING or not endpoint or not idle_timeout:
        return extra
    token = await _agent_token(rt, body, memo)
    if not token:
        return extra
    try:
        info = await rt.agents.info(endpoint, token)
    except AgentError as exc:
        # Unknown activity is never taken for idleness: no teardown on a blip.
        metrics.AGENT_ERRORS.inc()
        logger.warning("agent info failed: %s", exc)
        memo.pop("agent_token", None)
        return extra
    reported = now if info.active_executions else info.last_activity.replace(microsecond=0)
    previous = status.get("lastActivity")
    last = max(reported, parse_time(previous)) if previous else reported
    deadline = last + parse_duration(idle_timeout)
    extra.update(
        lastActivity=iso(last), idleDeadline=iso(deadline), activeExecutions=info.active_executions
    )
    if now < deadline:
        return extra
    action = spec.lifecycle.on_idle
    logger.info("idle since %s; %s", iso(last), action.value)
    metrics.TEARDOWNS.labels(f"idle_{action.value.lower()}").inc()
    event(body, "info", reason="IdleTimeout", message=f"idle since {iso(last)}: {action.value}")
    if action is OnIdle.DELETE:
        meta = body["metadata"]
        await rt.kube.delete(_path("sandboxes", meta["namespace"], meta["name"]), uid=meta["uid"])
    else:
        extra["idlePausedAt"] = iso(now)
    return extra


async def reconcile(
    rt: Runtime,
    body: JSON,
    memo: Any,
    logger: kopf.Logger,
    *,
    children: Children,
    pod: JSON | None = None,
    pod_known: bool = False,
) -> None:
    """Converge one Sandbox. `children` says how far beyond the pod to look;
    `pod_known` means `pod` is the pod as it stands (None: there is none)."""
    meta = body["metadata"]
    async with rt.lock(meta["namespace"], meta["name"]):
        known = rt.statuses.get((meta["namespace"], meta["name"]))
        if known is not None:
            body = {**body, "status": known}
        await _reconcile(rt, body, memo, logger, children=children, pod=pod, pod_known=pod_known)


async def _reconcile(
    rt: Runtime,
    body: JSON,
    memo: Any,
    logger: kopf.Logger,
    *,
    children: Children,
    pod: JSON | None,
    pod_known: bool,
) -> None:
    meta = body["metadata"]
    spec, invalid = parse_spec(body, rt.settings)
    now = now_utc()
    if invalid is not None:
        observed = conditions.Observed(
            generation=meta.get("generation", 0),
            paused=False,
            deleting=False,
            ephemeral=False,
            pod=None,
            invalid=invalid,
        )
        await write_status(rt, body, build_status(body, None, observed, rt.settings, now, {}))
        event(body, "warn", reason="InvalidSpec", message=invalid)
        raise kopf.PermanentError(invalid)
    assert spec is not None
    ref = ref_of(body)
    try:
        if children is not Children.POD:
            await ensure_children(rt, ref, spec, converge=children is Children.CONVERGE)
        if not pod_known:
            pod = await rt.kube.get(_path("pods", ref.namespace, build.names(ref.name)["pod"]))
        if pod is None and children is Children.POD and not effective_paused(body, spec):
            # The pod is gone (evicted, deleted): its siblings may be too.
            await ensure_children(rt, ref, spec, converge=False)
        pod = await ensure_pod(rt, body, spec, pod, logger)
    except KubeError as exc:
        if exc.status >= 500 or exc.status == 429:
            raise kopf.TemporaryError(f"API server: {exc}", delay=CREATE_RETRY_SECONDS) from exc
        # Refused (quota, admission policy, a namespace still being set up):
        # say so in status and try again; the cause is usually outside our reach.
        observed = conditions.Observed(
            generation=meta.get("generation", 0),
            paused=False,
            deleting=False,
            ephemeral=spec.workspace.ephemeral,
            pod=None,
            create_error=f"{exc.status} {exc.reason}: {exc.message}",
        )
        await write_status(rt, body, build_status(body, spec, observed, rt.settings, now, {}))
        raise kopf.TemporaryError(str(exc), delay=CREATE_RETRY_SECONDS) from exc

    extra: JSON = {}
    paused = effective_paused(body, spec)
    if not paused:
        extra["idlePausedAt"] = None
    observed = conditions.Observed(
        generation=meta.get("generation", 0),
        paused=paused,
        deleting=bool(meta.get("deletionTimestamp")),
        ephemeral=spec.workspace.ephemeral,
        pod=pod,
    )
    status = build_status(body, spec, observed, rt.settings, now, extra)
    if not observed.deleting:
        changes = await lifecycle(rt, body, spec, status, memo, now, logger)
        if changes.get("idlePausedAt"):
            # Paused by the idle policy just now: converge again as a paused sandbox.
            body["status"] = {**(body.get("status") or {}), **status, **changes}
            await _reconcile(rt, body, memo, logger, children=Children.POD, pod=pod, pod_known=True)
            return
        status.update(changes)
    status = {k: v for k, v in status.items() if v is not None}
    await write_status(rt, body, status)


async def teardown(rt: Runtime, body: JSON, logger: kopf.Logger) -> None:
    """Finalizer: stop the pod first (no writes in flight), then let GC take the rest."""
    ref = ref_of(body)
    metrics.PHASES.forget(ref.namespace, ref.name)
    rt.forget(ref.namespace, ref.name)
    path = _path("pods", ref.namespace, build.names(ref.name)["pod"])
    pod = await rt.kube.get(path)
    if pod is None:
        return
    deleting_since = pod["metadata"].get("deletionTimestamp")
    if not deleting_since:
        await rt.kube.delete(path, uid=pod["metadata"]["uid"])
        raise kopf.TemporaryError("waiting for the pod to stop", delay=1)
    if now_utc() - parse_time(deleting_since) > POD_DELETE_PATIENCE:
        logger.warning("pod did not stop in %s; forcing", POD_DELETE_PATIENCE)
        await rt.kube.delete(path, grace_seconds=0, uid=pod["metadata"]["uid"])
        return
    raise kopf.TemporaryError("waiting for the pod to stop", delay=1)
