"""Fixtures the devcluster test modules share. `kube` is a client of the
session's node cluster; a module about another cluster brings its own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from devcluster.cluster import LocalCluster
from tests.devcluster.support import Pods
from tests.kube import KubeJSON, core_path


@pytest.fixture
def kube(local_cluster: LocalCluster) -> Iterator[KubeJSON]:
    with KubeJSON(local_cluster.kubeconfig) as client:
        yield client


@pytest.fixture
def pods(local_cluster: LocalCluster, kube: KubeJSON, namespace: str) -> Pods:
    return Pods(local_cluster, kube, namespace)


@pytest.fixture
def namespace(kube: KubeJSON) -> Iterator[str]:
    """A fresh namespace for one test, through the module's `kube` client; the
    namespace controller removes whatever the test left in it."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.create(core_path("namespaces"), {"metadata": {"name": name}})
    yield name
    kube.delete(core_path("namespaces", name=name))
