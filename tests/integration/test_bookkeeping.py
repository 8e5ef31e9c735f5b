"""Kopf's bookkeeping on our objects: a prefix of its own, a diff base that fits,
and objects of an older operator taken over without running creation again."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import kopf
import pytest

from sandbox_operator.api.sandbox import SandboxSpec
from sandbox_operator.builders.sandbox import legacy_pod_hash
from sandbox_operator.resources import POD_HASH_ANNOTATION, POD_SPEC_ANNOTATION
from tests.integration.conftest import OPERATOR_ENV
from tests.integration.harness import OperatorProcess, wait_for
from tests.kube import KubeJSON, core_path
from tests.sandboxes import Sandboxes

LEGACY = "sandbox.dev"


@pytest.fixture
def slow_operator(
    running_operator: OperatorProcess,
    operator_kubeconfig: Path,
    tmp_path: Path,
) -> Iterator[OperatorProcess]:
    """An operator whose timer ticks once in 5 minutes, in place of the usual one
    (which `running_operator` starts again afterwards): whatever happens within a
    test came from a change handler, not from a tick."""
    running_operator.stop()
    env = {**OPERATOR_ENV, "SANDBOX_OPERATOR_RECONCILE_INTERVAL_SECONDS": "300"}
    slow = OperatorProcess(operator_kubeconfig, tmp_path, env)
    yield slow
    slow.stop()
    assert slow.errors() == [], f"handler tracebacks in {slow.log}"


def _pod_uid(kube: KubeJSON, ns: str, name: str) -> str | None:
    pod = kube.get(core_path("pods", ns, name))
    return (
        None if pod is None or pod["metadata"].get("deletionTimestamp") else pod["metadata"]["uid"]
    )


def test_a_resume_request_is_acted_on_at_once(
    slow_operator: OperatorProcess, sandboxes: Sandboxes, kube: KubeJSON
) -> None:
    """The resume annotation lives under sandbox.dev/, Kopf's bookkeeping under
    kopf.sandbox.dev/: Kopf sees the annotation change and the update handler
    runs, instead of the request waiting for the next timer tick."""
    ns = sandboxes.namespace
    sandboxes.create("resumable")
    # Paused by the idle policy, as the operator records it (none runs yet).
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    kube.patch(sandboxes.path("resumable") + "/status", {"status": {"idlePausedAt": stamp}})
    slow_operator.start()
    sandboxes.wait_phase("resumable", "Paused")
    time.sleep(2)
    assert _pod_uid(kube, ns, "resumable") is None, "a paused sandbox got a pod"

    requested = time.monotonic()
    later = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 1))
    sandboxes.patch(
        "resumable", {"metadata": {"annotations": {f"{LEGACY}/resume-requested-at": later}}}
    )
    wait_for(lambda: _pod_uid(kube, ns, "resumable"), 30, "a pod after the resume")
    # Far from the 300 s tick: the change handler did it.
    assert time.monotonic() - requested < 20

    annotations = sandboxes.read("resumable")["metadata"]["annotations"]
    kopf_keys = [k for k in annotations if k.startswith("kopf.sandbox.dev/")]
    assert kopf_keys == ["kopf.sandbox.dev/last-handled-digest"], annotations
    assert re.fullmatch(r"[0-9a-f]{64}", annotations["kopf.sandbox.dev/last-handled-digest"])
    assert f"{LEGACY}/kopf-managed" not in annotations


def test_objects_of_an_older_operator_are_taken_over_without_creating_them_again(
    slow_operator: OperatorProcess, sandboxes: Sandboxes, kube: KubeJSON
) -> None:
    """An operator upgraded in place finds Kopf's old annotations under sandbox.dev/
    (its marker, a full copy of the spec as diff base) and the finalizer: it
    resumes the object (no creation handler), drops the old annotations, keeps the
    finalizer, and user annotations under sandbox.dev/ count as changes again."""
    ns = sandboxes.namespace
    body = sandboxes.create("veteran", {"runtime": "python"})
    # As the older operator left it: Kopf's essence under the old prefix, its marker
    # and the finalizer (computed by Kopf itself, with the old storage settings).
    old_storage = kopf.AnnotationsDiffBaseStorage(prefix=LEGACY, key="last-handled-configuration")
    essence = old_storage.build(body=kopf.Body(cast(kopf.RawBody, body)))
    legacy = {
        f"{LEGACY}/kopf-managed": "yes",
        f"{LEGACY}/last-handled-configuration": json.dumps(essence, separators=(",", ":")) + "\n",
    }
    sandboxes.patch(
        "veteran",
        {"metadata": {"annotations": legacy, "finalizers": [f"{LEGACY}/finalizer"]}},
    )

    slow_operator.start()
    wait_for(lambda: _pod_uid(kube, ns, "veteran"), 30, "the pod")

    def migrated() -> dict[str, str] | None:
        annotations: dict[str, str] = sandboxes.read("veteran")["metadata"].get("annotations") or {}
        return annotations if "kopf.sandbox.dev/last-handled-digest" in annotations else None

    annotations = wait_for(migrated, 30, "the new diff base")
    assert not set(legacy) & set(annotations), annotations
    assert sandboxes.read("veteran")["metadata"]["finalizers"] == [f"{LEGACY}/finalizer"]
    triggers = re.findall(
        r'sandbox_operator_reconciles_total\{kind="Sandbox",result="\w+",trigger="([-\w]+)"\}',
        slow_operator.metrics(),
    )
    assert "create" not in triggers, "a creation handler ran for an existing object"
    assert "update" in triggers, triggers

    # Deleting goes through the kept finalizer.
    sandboxes.delete("veteran")
    sandboxes.wait_gone("veteran", 60, "the Sandbox to be deleted")


def test_a_pod_of_an_older_release_is_kept_and_stamped(
    running_operator: OperatorProcess, sandboxes: Sandboxes, kube: KubeJSON
) -> None:
    """A pod made before pods carried what they were built from (only the older
    digest of the spec) is kept, not replaced, and stamped in place."""
    ns = sandboxes.namespace
    body = sandboxes.create("elder", {"runtime": "python"})
    uid = wait_for(lambda: _pod_uid(kube, ns, "elder"), 30, "the pod")
    older = {
        POD_SPEC_ANNOTATION: None,
        POD_HASH_ANNOTATION: legacy_pod_hash(SandboxSpec.model_validate(body["spec"])),
    }
    kube.patch(core_path("pods", ns, "elder"), {"metadata": {"annotations": older}})

    def stamped() -> bool:
        pod = kube.get(core_path("pods", ns, "elder")) or {"metadata": {}}
        return POD_SPEC_ANNOTATION in (pod["metadata"].get("annotations") or {})

    wait_for(stamped, 30, "the pod stamped again")
    assert _pod_uid(kube, ns, "elder") == uid, "the pod was replaced"
