"""Where Kopf keeps its bookkeeping on our objects, and how older objects move there.

Two problems with Kopf's defaults shape this module:
- Kopf ignores changes to annotations under its own prefix. Its bookkeeping
  used to live under `sandbox.dev/`, the prefix of the user-facing resume and
  restore annotations, so those requests waited for the next timer tick. It
  now lives under `kopf.sandbox.dev/`, which nothing else uses.
- Kopf's default diff base is a copy of the whole spec in an annotation. With
  `kubectl apply`'s own copy beside it, a large (valid) spec passes the API
  server's 256 KiB limit on annotations, after which no patch is accepted, not
  even the one that removes the finalizer. Our handlers reconcile from the
  whole object and never read Kopf's diff, so a digest of the essence is all
  the change detection needs.

Objects written by an older operator carry Kopf's old annotations; they are
read as a diff base (no creation handler runs again) and removed with the
first diff base written here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from contextlib import suppress
from typing import Any, cast

import kopf

from sandbox_operator.kube import JSON_PATCH, Api, KubeError
from sandbox_operator.resources import FINALIZER, KOPF_PREFIX, LABEL_POOL, LEGACY_KOPF_PREFIX

DIGEST_KEY = "last-handled-digest"
CONSISTENCY_TIMEOUT_SECONDS = 60.0
# What Kopf wrote under the old prefix: its marker, diff base, touch key and the
# progress records of the handlers registered in main.py at the time.
LEGACY_KEYS = frozenset(
    f"{LEGACY_KOPF_PREFIX}/{name}"
    for name in (
        "kopf-managed",
        "last-handled-configuration",
        "touch-dummy",
        "sandbox_changed",
        "sandbox_deleted",
        "execution_deleted",
        "snapshot_changed",
        "snapshot_deleted",
    )
)
LEGACY_DIFF_BASE = f"{LEGACY_KOPF_PREFIX}/last-handled-configuration"

JSON = dict[str, Any]


def digest(essence: Any) -> str:
    return hashlib.sha256(
        json.dumps(essence, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def _without_bookkeeping(body: Any, prefix: str, whole: bool) -> JSON:
    """The body without Kopf's annotations, old or new, so they never count as changes.

    A pool member's pool label goes too: a claim removes it, and the member's
    own handlers have nothing to do about that (the claim is one write, and no
    handler run or digest write of the member follows it).

    Unless `whole`, only what Kopf's essence keeps is left (everything but
    status and metadata, and of metadata the labels and annotations): Kopf
    deep-copies the body it is given on every event, and status and
    managedFields are most of a Sandbox. The essence, and so the digest, is
    the same either way."""
    raw: JSON = {k: v for k, v in dict(body).items() if whole or k != "status"}
    meta: JSON = dict(raw.get("metadata") or {}) if whole else {}
    annotations = {
        key: value
        for key, value in (body.get("metadata", {}).get("annotations") or {}).items()
        if key not in LEGACY_KEYS and not key.startswith(f"{prefix}/")
    }
    labels = {
        k: v for k, v in (body.get("metadata", {}).get("labels") or {}).items() if k != LABEL_POOL
    }
    raw["metadata"] = {**meta, "annotations": annotations, "labels": labels}
    return raw


class DigestDiffBaseStorage(kopf.DiffBaseStorage):
    """Kopf's last-handled state as a sha256 of the essence, in one small annotation."""

    def __init__(self, prefix: str = KOPF_PREFIX, key: str = DIGEST_KEY) -> None:
        super().__init__()
        self.prefix = prefix
        self.annotation = f"{prefix}/{key}"

    def build(self, *, body: Any, extra_fields: Iterable[Any] | None = None) -> Any:
        # Handlers with `field=` (none now) would need the fields Kopf drops.
        extra = list(extra_fields or ())
        essence = super().build(
            body=cast(kopf.Body, _without_bookkeeping(body, self.prefix, whole=bool(extra))),
            extra_fields=extra,
        )
        return {"digest": digest(essence)}

    def fetch(self, *, body: Any) -> Any:
        annotations = body.get("metadata", {}).get("annotations") or {}
        stored = annotations.get(self.annotation)
        if stored:
            return {"digest": stored}
        legacy = annotations.get(LEGACY_DIFF_BASE)
        if legacy:
            # Written by an older operator: a full essence. Standing in for a diff
            # base, it makes the object an update, never a creation; the update's
            # store() then replaces the old annotations (Kopf stores a diff base
            # only when something changed, hence the marker key).
            return {"digest": "", "legacy": LEGACY_DIFF_BASE}
        return None

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        patch.metadata.annotations[self.annotation] = essence["digest"]
        for key in (body.get("metadata", {}).get("annotations") or {}).keys() & LEGACY_KEYS:
            patch.metadata.annotations[key] = None


# The one diff-base storage: Kopf's (configure) and the claim's (mark_handled).
DIFF_BASE = DigestDiffBaseStorage()


def _pointer(key: str) -> str:
    """`key` as one JSON Pointer token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def handled_patch(body: JSON, digest_value: str) -> list[JSON]:
    """The JSON patch that records `body` as handled (its diff base) and adds Kopf's
    finalizer, as Kopf's own patch would: conditioned on the resourceVersion read,
    so that nothing written since (a finalizer of another controller) is lost.
    Pure."""
    meta = body["metadata"]
    annotations = meta.get("annotations")
    finalizers = meta.get("finalizers")
    ops: list[JSON] = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]}
    ]
    if annotations:
        path = f"/metadata/annotations/{_pointer(DIFF_BASE.annotation)}"
        ops.append({"op": "add", "path": path, "value": digest_value})
    else:
        ops.append(
            {
                "op": "add",
                "path": "/metadata/annotations",
                "value": {DIFF_BASE.annotation: digest_value},
            }
        )
    if not finalizers:
        ops.append({"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]})
    elif FINALIZER not in finalizers:
        ops.append({"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER})
    return ops


def _unhandled_digest(body: kopf.Body) -> str | None:
    """The diff base to record for `body`, or None when it has one already."""
    if DIFF_BASE.fetch(body=body) is not None:
        return None
    return str(DIFF_BASE.build(body=body)["digest"])


async def mark_handled(kube: Api, path: str, body: kopf.Body) -> bool:
    """Record `body` (the object at `path`) as handled by its change handlers and
    add Kopf's finalizer, when it has no diff base yet: for a Sandbox that an
    event handler is converging completely (a claim). No creation handler runs
    after it. True when this wrote it; False when there was a diff base, the
    object changed since `body` was read, or it is gone.

    The claim handler writes this beside the claim, before Kopf's patch of the
    round (the status it leaves there): Kopf's finalizer is then on the object
    when Kopf writes the status, and no event shows the status without it.
    (Kopf, shown one, adds its finalizer again, tested against a
    resourceVersion that is no longer current: a write refused with 422.)"""
    digest_value = _unhandled_digest(body)
    if digest_value is None:
        return False
    try:
        written = await kube.patch(path, handled_patch(dict(body), digest_value), JSON_PATCH)
    except KubeError as exc:
        if exc.status not in (409, 422):
            raise
        return False
    return written is not None


def mark_in_patch(body: kopf.Body, patch: kopf.Patch) -> None:
    """`mark_handled` in Kopf's patch of the round, beside its finalizer, for when
    the object changed before the claim handler could write it."""
    digest_value = _unhandled_digest(body)
    if digest_value is None:
        return

    def annotate(raw: Any) -> None:
        raw.setdefault("metadata", {}).setdefault("annotations", {})[DIFF_BASE.annotation] = (
            digest_value
        )

    patch.fns.append(annotate)


async def unmark(kube: Api, path: str) -> None:
    """Take back the diff base `mark_handled` wrote: the claim did not happen, and
    the change handlers have work to do (start cold, or wait for a member)."""
    key = _pointer(DIFF_BASE.annotation)
    with suppress(KubeError):  # gone already, with the annotation
        await kube.patch(
            path, [{"op": "remove", "path": f"/metadata/annotations/{key}"}], JSON_PATCH
        )


def configure(settings: kopf.OperatorSettings) -> None:
    """Kopf's persistence: finalizer, progress and diff base (see the module docstring)."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = DIFF_BASE
    # After its own patch (the diff base that says "created"), Kopf waits this
    # long for the watch to deliver that version before it takes an older event
    # of the object as current and may run the creation handler again. Kopf's
    # 5 s is shorter than the watch lagged with 3,000 Sandboxes arriving at once
    # (9 s). Change handlers of that object wait meanwhile; events, timers and
    # daemons do not.
    settings.persistence.consistency_timeout = CONSISTENCY_TIMEOUT_SECONDS
