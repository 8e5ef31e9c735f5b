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

With `SANDBOX_CI_PHASES` set (`.ci/run`), the builds during collection and
the session clusters' starts and stops are recorded as phases, and at the
end of the session each test tier's time and the slowest tests (see
`devcluster.phases`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TypeVar

import pytest

from devcluster import build, hostdeps, images, netbuild, phases, storage
from devcluster.cluster import LocalCluster, node_binaries
from devcluster.controlplane import ControlPlane, ControlPlaneError
from devcluster.registry import sweep_orphans

FIXTURE = "control_plane"
# What a test needing the node asks for (directly, or through a fixture of its
# own that starts a private node cluster: the e2e tier's).
NODE_FIXTURE = "node_tier"
_build_error = pytest.StashKey[str]()
_node_build_error = pytest.StashKey[str]()
_tally = pytest.StashKey[phases.TestTally]()


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


def pytest_configure(config: pytest.Config) -> None:
    if phases.destination() is not None:
        tally = config.stash[_tally] = phases.TestTally(_tiers(config))
        # An object, not module hooks: pytest_runtest_logreport gets no config
        # to find the tally in, and a module global would outlive the session.
        config.pluginmanager.register(_PhaseRecorder(tally), "devcluster-phases")


def _tiers(config: pytest.Config) -> list[str]:
    """The paths pytest was given (`make test`: the Makefile's TEST_TIERS),
    relative to the rootdir like the test ids they are matched against."""
    root = config.rootpath.resolve()
    tiers = []
    for arg in config.args:
        # An absolute arg stays itself when joined.
        path = Path(config.invocation_params.dir, arg.split("::")[0]).resolve()
        with contextlib.suppress(ValueError):
            tiers.append(path.relative_to(root).as_posix())
    return tiers


class _PhaseRecorder:
    """Sums each test's setup + call + teardown into its tier and writes the
    tiers and the slowest tests to the phase file when the session ends."""

    def __init__(self, tally: phases.TestTally) -> None:
        self.tally = tally

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.tally.add(report.nodeid, report.when, report.outcome, report.duration)

    # Last: after an interrupt the session clusters stop in pytest's own
    # sessionfinish, and their rows then come before the tiers as usual.
    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self) -> None:
        for record in self.tally.records():
            phases.append(record)


@contextlib.contextmanager
def _cluster_phase(config: pytest.Config, name: str) -> Iterator[None]:
    """A cluster start or stop as a phase of its own. It runs inside the setup
    (or teardown) of whichever test first needs (or last held) the session
    fixture, so its time is taken out of that test's, else the tier's total
    would count it twice."""
    began = time.monotonic()
    try:
        with phases.phase(name):
            yield
    finally:
        tally = config.stash.get(_tally, None)
        if tally is not None:
            tally.exclude(time.monotonic() - began)


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


# Image builds run at once by the node tier's preparation.
IMAGE_BUILDS = 3


def _prepare_control_plane() -> None:
    # After `make binaries` this only checks the stamps; a row near 0 s says so.
    with phases.phase("binaries: etcd, Kubernetes (pytest's check)"):
        build.etcd_binary()
        build.kubernetes_binaries()


def _prepare_node() -> None:
    """Debian packages, node binaries and images for `local_cluster`, each a
    phase of its own: together they are the largest cold cost of a run."""
    with phases.phase("node tier: host packages"):
        hostdeps.ensure()
    # The images build beside the Go builds: the compiles want the CPU, an
    # image's build waits mostly on downloads and dpkg's writes (cold, one
    # after the other, they added up to 24 minutes before the first cluster
    # start, which then waited on the CSI sidecars' build too).
    with concurrent.futures.ThreadPoolExecutor(1) as side:
        imaged = side.submit(_build_images)
        with phases.phase("node tier: binaries (kubelet, kube-scheduler, crictl)"):
            node_binaries(build_missing=True)
        with phases.phase("node tier: binaries (kube-proxy, CoreDNS, kube-network-policies)"):
            netbuild.network_binaries(build_missing=True)
        with phases.phase("node tier: binaries (CSI driver and sidecars)"):
            storage.storage_binaries(build_missing=True)
        built = imaged.result()
    # The fixture's cluster imports every image: its seeded store too.
    with phases.phase("image seed store"):
        images.ensure_seed(built)


def _build_images() -> list[images.BuiltImage]:
    """Every image, several at once (cold, one after another: 7 minutes)."""
    specs = list(images.IMAGES.values())
    with (
        phases.phase(f"images ({len(specs)}, {IMAGE_BUILDS} at a time, beside the Go builds)"),
        concurrent.futures.ThreadPoolExecutor(IMAGE_BUILDS) as pool,
    ):
        return list(pool.map(images.ensure_built, specs))


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
def node_tier(request: pytest.FixtureRequest) -> None:
    """The node tier's packages, binaries and images, built before the first test
    (see pytest_collection_finish): a fixture that starts a node cluster of its
    own asks for this one, so that no build runs under a test's timeout."""
    _fail_if_unprepared(request, "preparing the node tier", _build_error, _node_build_error)


@pytest.fixture(scope="session")
def local_cluster(request: pytest.FixtureRequest, node_tier: None) -> Iterator[LocalCluster]:
    """A running single-node cluster: pods are scheduled and run, from the local
    images (use `imagePullPolicy: IfNotPresent` or `Never`). Pod IPs are
    reachable from the test process. Fails, never skips, when it cannot start.
    """
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
        yield _reused(request, kind(name))
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


def _reused(request: pytest.FixtureRequest, cluster: ClusterT) -> ClusterT:
    """A named cluster (the developer's, for a fast edit-test loop): started
    unless it is healthy, and left running after the session."""
    if not cluster.is_healthy():
        _start(request, cluster)
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
        _start(request, cluster)
        try:
            yield cluster
        finally:
            failed = request.session.testsfailed > 0
            with _cluster_phase(request.config, f"cluster stop: {_label(request, cluster)}"):
                cluster.stop(remove_state=not failed)
            if failed:
                reporter = request.config.pluginmanager.get_plugin("terminalreporter")
                if reporter is not None:
                    reporter.write_line(
                        f"devcluster: logs of {cluster.name} kept in {cluster.logs_dir}"
                    )


def _label(request: pytest.FixtureRequest, cluster: ControlPlane) -> str:
    """What the phase table calls a cluster: the fixture that holds it
    (control_plane, local_cluster, e2e_install), not its per-run name."""
    return request.fixturename or cluster.name


def _start(request: pytest.FixtureRequest, cluster: ControlPlane) -> None:
    try:
        with _cluster_phase(request.config, f"cluster start: {_label(request, cluster)}"):
            cluster.start()
    except (ControlPlaneError, images.ImageError, hostdeps.HostDepsError) as error:
        pytest.fail(f"devcluster: cluster {cluster.name!r} did not start: {error}", pytrace=False)
