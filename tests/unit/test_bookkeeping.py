"""The claim's own bookkeeping patch: what Kopf's patch would write, and nothing
lost; and the digest Kopf's change detection compares."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, cast

import kopf
import pytest

from sandbox_operator.bookkeeping import DIFF_BASE, DigestDiffBaseStorage, digest, handled_patch
from sandbox_operator.resources import FINALIZER, LABEL_POOL

TEST_RV = {"op": "test", "path": "/metadata/resourceVersion", "value": "41"}
DIGEST_PATH = "/metadata/annotations/kopf.sandbox.dev~1last-handled-digest"


def test_a_new_object_gets_both_maps_whole() -> None:
    ops = handled_patch({"metadata": {"resourceVersion": "41"}}, "abc")
    assert ops == [
        TEST_RV,
        {"op": "add", "path": "/metadata/annotations", "value": {DIFF_BASE.annotation: "abc"}},
        {"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]},
    ]


def test_other_annotations_and_finalizers_are_kept() -> None:
    body = {
        "metadata": {
            "resourceVersion": "41",
            "annotations": {"team": "a"},
            "finalizers": ["example.com/keep"],
        }
    }
    assert handled_patch(body, "abc") == [
        TEST_RV,
        {"op": "add", "path": DIGEST_PATH, "value": "abc"},
        {"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER},
    ]


def test_a_finalizer_already_there_is_not_added_twice() -> None:
    body = {"metadata": {"resourceVersion": "41", "finalizers": [FINALIZER]}}
    ops = handled_patch(body, "abc")
    assert [op["path"] for op in ops] == ["/metadata/resourceVersion", "/metadata/annotations"]


# -- the digest -----------------------------------------------------------------------

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "health" / "sandbox-running.json"


def _sandbox() -> dict[str, Any]:
    body: dict[str, Any] = json.loads(FIXTURE.read_text())
    body["metadata"]["managedFields"] = [{"manager": "kopf", "fieldsV1": {"f:status": {}}}]
    body["metadata"]["labels"] = {"team": "a", LABEL_POOL: "warm"}
    body["metadata"]["annotations"] = {
        "note": "kept",
        "kopf.sandbox.dev/last-handled-digest": "0" * 64,
        "kopf.sandbox.dev/sandbox_changed": "{}",
    }
    return body


def _digest(body: dict[str, Any], extra: list[str] | None = None) -> str:
    return str(DIFF_BASE.build(body=cast(kopf.Body, body), extra_fields=extra)["digest"])


def test_the_digest_is_that_of_kopfs_essence_of_the_whole_body() -> None:
    # Built from a trimmed copy, it must equal what it was when Kopf copied the
    # whole body: a changed digest makes every object look changed after an upgrade.
    body = _sandbox()
    whole = copy.deepcopy(body)
    meta = whole["metadata"]
    meta["labels"].pop(LABEL_POOL)
    meta["annotations"] = {"note": "kept"}
    stock = super(DigestDiffBaseStorage, DIFF_BASE).build(body=cast(kopf.Body, whole))
    assert _digest(body) == digest(stock)
    assert _digest(body) == _digest(body, extra=[])


def test_status_and_system_metadata_leave_the_digest_alone() -> None:
    body, changed = _sandbox(), _sandbox()
    changed["status"]["phase"] = "Paused"
    changed["metadata"]["resourceVersion"] = "99999"
    changed["metadata"]["managedFields"].append({"manager": "kubectl"})
    changed["metadata"]["finalizers"] = []
    changed["metadata"]["labels"].pop(LABEL_POOL)
    changed["metadata"]["annotations"]["kopf.sandbox.dev/sandbox_changed"] = '{"retries": 1}'
    assert _digest(changed) == _digest(body)


@pytest.mark.parametrize(
    ("where", "key", "value"),
    [("spec", "runtime", "node"), ("labels", "team", "b"), ("annotations", "note", "other")],
)
def test_spec_labels_and_user_annotations_change_the_digest(
    where: str, key: str, value: str
) -> None:
    body = _sandbox()
    base = _digest(body)
    (body["spec"] if where == "spec" else body["metadata"][where])[key] = value
    assert _digest(body) != base


def test_a_handlers_extra_fields_are_in_the_digest() -> None:
    body, changed = _sandbox(), _sandbox()
    changed["status"]["phase"] = "Paused"
    assert _digest(changed, ["status.phase"]) != _digest(body, ["status.phase"])
