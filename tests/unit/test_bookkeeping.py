"""The claim's own bookkeeping patch: what Kopf's patch would write, and nothing lost."""

from __future__ import annotations

from sandbox_operator.bookkeeping import DIFF_BASE, handled_patch
from sandbox_operator.resources import FINALIZER

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
