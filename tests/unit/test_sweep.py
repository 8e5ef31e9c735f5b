"""What a replica forgets after a peering pause (sandbox_operator/sweep.py): the
parts that touch Kopf's private keys, on Kopf's own index, and the table of
what each index is made from, against the handlers main.py registers. The
listing itself runs against a real API server in tests/integration/test_ha.py."""

from __future__ import annotations

from typing import Any

import kopf
import pytest
from kopf._core.engines.indexing import OperatorIndexer

from sandbox_operator import main, sweep
from sandbox_operator.indexes import SOURCES, Indexes


def _key(namespace: str, name: str, uid: str) -> Any:
    """Kopf's key of an object in its indexes (typed by Kopf with its own NewType)."""
    return (namespace, name, uid)


def _indexer(**objects: tuple[str, str]) -> OperatorIndexer:
    """Kopf's indexer with one value per object: uid -> (namespace, name)."""
    indexer = OperatorIndexer()
    for uid, (namespace, name) in objects.items():
        indexer.replace(_key(namespace, name, uid), {(namespace, name): {"uid": uid}})
    return indexer


def test_held_is_every_object_an_index_holds_values_of() -> None:
    indexer = _indexer(u1=("team", "a"), u2=("team", "b"))
    assert sweep.held(indexer.index) == {("team", "a", "u1"), ("team", "b", "u2")}
    indexer.discard(_key("team", "a", "u1"))  # Kopf's own DELETED
    assert sweep.held(indexer.index) == {("team", "b", "u2")}


def test_dropping_an_object_removes_its_values_and_only_its() -> None:
    indexer = _indexer(u1=("team", "a"), u2=("team", "b"))
    # A namesake created later (another UID) under the same index key.
    indexer.replace(_key("team", "a", "u3"), {("team", "a"): {"uid": "u3"}})
    sweep._drop(indexer.index, ("team", "a", "u1"))
    assert list(indexer.index[("team", "a")]) == [{"uid": "u3"}]
    assert list(indexer.index[("team", "b")]) == [{"uid": "u2"}]
    sweep._drop(indexer.index, ("team", "a", "u1"))  # twice: nothing left to drop
    sweep._drop(indexer.index, ("team", "a", "u3"))
    assert ("team", "a") not in indexer.index
    assert sweep.held(indexer.index) == {("team", "b", "u2")}


def test_an_index_that_is_not_kopfs_is_refused() -> None:
    with pytest.raises(TypeError, match="supported Kopf"):
        sweep.held({})


def test_each_index_is_listed_as_main_registers_it() -> None:
    """SOURCES says what kind (and label selector) each field of Indexes holds:
    the sweep lists that to tell what was deleted. It must be what main.py's
    index function for the field watches, or the sweep would drop live objects
    (a narrower selector) or keep dead ones (a wider one)."""
    handlers = {h.id: h for h in kopf.get_default_registry()._indexing.get_all_handlers()}
    fields = main._indexes({name: name for name in handlers})
    assert set(SOURCES) == set(Indexes.__dataclass_fields__)
    for field, source in SOURCES.items():
        handler: Any = handlers[getattr(fields, field)]
        assert handler.selector.any_name == source.resource.plural, field
        assert handler.selector.group == source.resource.group, field
        labels = ",".join(f"{k}={v}" for k, v in (handler.labels or {}).items())
        assert labels == (source.selector or ""), field
