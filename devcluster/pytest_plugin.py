"""pytest plugin: a real Kubernetes control plane for the test session.

Load it from the top-level conftest with
`pytest_plugins = ["devcluster.pytest_plugin"]` (or `-p devcluster.pytest_plugin`).

The session-scoped fixture `control_plane` starts a private cluster named
`pytest-<pid>`, yields the `ControlPlane`, and always stops it. It never skips:
if the binaries cannot be built or the cluster cannot start, every test that
uses it errors with the reason. `--devcluster-name NAME` uses (and starts if
needed) a named cluster such as the one `make cluster-up` runs, and leaves it
running, for a fast edit-test loop.

The session-scoped fixture `local_cluster` is the node tier: a
`devcluster.cluster.LocalCluster` named `pytest-<pid>-node` (control plane,
kube-scheduler, containerd, kubelet, pod network, every image of
`devcluster.images.IMAGES` imported), stopped at the end with everything it
started. Needs root. It never skips either: missing Debian packages are
installed, binaries and images are built during collection, and whatever
fails errors the tests that use it. `--devcluster-node NAME` runs against
the named node cluster (`python -m devcluster up --node`) and leaves it up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TypeVar

import pytest

from devcluster import build, hostdeps, images, netbuild
from devcluster.cluster import LocalCluster, node_binaries
from devcluster.controlplane import ControlPlane, ControlPlaneError
from devcluster.registry import sweep_orphans

FIXTURE = "control_plane"
NODE_FIXTURE = "local_cluster"
_build_error = pytest.StashKey[str]()
_node_build_error = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("devcluster")
    group.addoption(
        "--devcluster-name",
        default=None,
        metavar="NAME",
        help="run against the named local cluster (started if not healthy) and leave it "
        "running; default: a private cluster for this session, stopped at the end",
    )
    group.addoption(
        "--devcluster-node",
        default=None,
        metavar="NAME",
        help="local_cluster: use the named node cluster (started if not healthy) and leave "
        "it running; default: a private node cluster for this session",
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the binaries before any test runs, only if a collected test needs them.

    Here rather than in the fixture: a cold build takes minutes, far longer than
    the per-test timeout, which also covers fixture setup.
    """

    def used(fixture: str) -> bool:
        return any(fixture in getattr(item, "fixturenames", ()) for item in session.items)

    if used(NODE_FIXTURE):
        _prepare(
            session,
            _node_build_error,
            "node tier",
            _prepare_node,
            "devcluster: preparing the node tier (Debian packages, kubelet/scheduler/crictl, "
            "kube-proxy/CoreDNS/kube-network-policies, images); cold, this takes many minutes",
        )
    if used(FIXTURE) or used(NODE_FIXTURE):
        _prepare(
            session,
            _build_error,
            "binaries",
            _prepare_control_plane,
            None
            if build.binaries_current()
            else "devcluster: building etcd and Kubernetes binaries from the Go modules "
            f"(cache {build.cache_root()}); a cold build takes several minutes",
        )


def _prepare_control_plane() -> None:
    build.etcd_binary()
    build.kubernetes_binaries()


def _prepare_node() -> None:
    """Debian packages, node binaries and images for `local_cluster`."""
    hostdeps.ensure()
    node_binaries(build_missing=True)
    netbuild.network_binaries(build_missing=True)
    # The fixture's cluster imports every image: its seeded store too.
    images.ensure_seed([images.ensure_built(spec) for spec in images.IMAGES.values()])


def _prepare(
    session: pytest.Session,
    failure: pytest.StashKey[str],
    what: str,
    work: Callable[[], None],
    announce: str | None,
) -> None:
    """Run `work` (builds: minutes when cold, longer than a test's timeout)
    before any test runs, saying so first when `announce` says what. A failure
    is stashed under `failure` for the fixture to report, so the tests that
    need it error with the reason (a failing hook here would be an
    INTERNALERROR instead)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    began = time.monotonic()
    if announce is not None and reporter is not None:
        reporter.write_line(announce)
    try:
        work()
    except Exception as error:
        session.config.stash[failure] = f"{type(error).__name__}: {error}"
        return
    elapsed = time.monotonic() - began
    if elapsed > 5 and reporter is not None:
        reporter.write_line(f"devcluster: {what} ready after {elapsed:.0f}s")


@contextlib.contextmanager
def _sigterm_raises_interrupt() -> Iterator[None]:
    """Turn SIGTERM (CI timeouts, `kill`) into KeyboardInterrupt during the session,
    so the fixture's teardown runs instead of the process vanishing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        # Someone else handles SIGTERM already; leave it to them.
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="session")
def control_plane(request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    """A running control plane (etcd, kube-apiserver, kube-controller-manager).

    Use `control_plane.kubeconfig` (admin) with the Kubernetes client, and
    `control_plane.kubectl` by path. Fails, never skips, when it cannot start.
    """
    _fail_if_unprepared(request, "building the binaries", _build_error)
    yield from _session_cluster(request, "devcluster_name", ControlPlane, f"pytest-{os.getpid()}")


@pytest.fixture(scope="session")
def local_cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """A running single-node cluster: pods are scheduled and run, from the local
    images (use `imagePullPolicy: IfNotPresent` or `Never`). Pod IPs are
    reachable from the test process. Fails, never skips, when it cannot start.
    """
    _fail_if_unprepared(request, "preparing the node tier", _build_error, _node_build_error)
    yield from _session_cluster(
        request, "devcluster_node", LocalCluster, f"pytest-{os.getpid()}-node"
    )


ClusterT = TypeVar("ClusterT", bound=ControlPlane)


def _session_cluster(
    request: pytest.FixtureRequest,
    option: str,
    kind: Callable[..., ClusterT],
    private_name: str,
) -> Iterator[ClusterT]:
    """The body of a session fixture: the cluster named by `--<option>` if
    given (see `_reused`), else this session's own `private_name`, stopped at
    the end."""
    name: str | None = request.config.getoption(option)
    if name:
        yield _reused(kind(name))
        return
    # die_with_parent: even a SIGKILLed pytest takes its cluster along.
    with private_cluster(request, kind(private_name, die_with_parent=True)) as cluster:
        yield cluster


def _fail_if_unprepared(
    request: pytest.FixtureRequest, what: str, *failures: pytest.StashKey[str]
) -> None:
    for key in failures:
        error = request.config.stash.get(key, None)
        if error is not None:
            pytest.fail(f"devcluster: {what} failed: {error}", pytrace=False)


def _reused(cluster: ClusterT) -> ClusterT:
    """A named cluster (the developer's, for a fast edit-test loop): started
    unless it is healthy, and left running after the session."""
    if not cluster.is_healthy():
        _start(cluster)
    elif isinstance(cluster, LocalCluster):
        # Images rebuilt since it started (an edit to sandbox-agent/) go in
        # without a restart.
        cluster.load_images(cluster.image_names)
    return cluster


@contextlib.contextmanager
def private_cluster(request: pytest.FixtureRequest, cluster: ClusterT) -> Iterator[ClusterT]:
    """Start a session's own cluster (named "pytest-...", so the next session's
    sweep removes it if this one is SIGKILLed) and always stop it. SIGTERM
    unwinds through here too. A failed session keeps the state (logs!) for a look."""
    sweep_orphans("pytest-")
    with _sigterm_raises_interrupt():
        _start(cluster)
        try:
            yield cluster
        finally:
            failed = request.session.testsfailed > 0
            cluster.stop(remove_state=not failed)
            if failed:
                reporter = request.config.pluginmanager.get_plugin("terminalreporter")
                if reporter is not None:
                    reporter.write_line(
                        f"devcluster: logs of {cluster.name} kept in {cluster.logs_dir}"
                    )


def _start(cluster: ControlPlane) -> None:
    try:
        cluster.start()
    except (ControlPlaneError, images.ImageError, hostdeps.HostDepsError) as error:
        pytest.fail(f"devcluster: cluster {cluster.name!r} did not start: {error}", pytrace=False)
