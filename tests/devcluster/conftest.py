"""Fixtures the devcluster test modules share (each module brings its own `kube`)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.kube import KubeJSON, core_path


@pytest.fixture
def namespace(kube: KubeJSON) -> Iterator[str]:
    """A fresh namespace for one test, through the module's `kube` client; the
    namespace controller removes whatever the test left in it."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.create(core_path("namespaces"), {"metadata": {"name": name}})
    yield name
    kube.delete(core_path("namespaces", name=name))
