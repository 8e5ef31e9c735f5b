"""pytest plugin: a real Kubernetes control plane for the test session.

Load it from the top-level conftest with
`pytest_plugins = ["devcluster.pytest_plugin"]` (or `-p devcluster.pytest_plugin`).

The session-scoped fixture `control_plane` starts a private cluster named
`pytest-<pid>`, yields the `ControlPlane`, and always stops it. It never skips:
if the binaries cannot be built or the cluster cannot start, every test that
uses it errors with the reason. `--devcluster-name NAME` uses (and starts if
needed) a named cluster such as the one `make cluster-up` runs, and leaves it
running, for a fast edit-test loop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

import pytest

from devcluster import build
from devcluster.controlplane import ControlPlane, ControlPlaneError, sweep_orphans

FIXTURE = "control_plane"
_build_error = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("devcluster")
    group.addoption(
        "--devcluster-name",
        default=None,
        metavar="NAME",
        help="run against the named local cluster (started if not healthy) and leave it "
        "running; default: a private cluster for this session, stopped at the end",
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the binaries before any test runs, only if a collected test needs them.

    Here rather than in the fixture: a cold build takes minutes, far longer than
    the per-test timeout, which also covers fixture setup.
    """
    if not any(FIXTURE in getattr(item, "fixturenames", ()) for item in session.items):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    began = time.monotonic()
    if not build.binaries_current() and reporter is not None:
        reporter.write_line(
            "devcluster: building etcd and Kubernetes binaries from the Go modules "
            f"(cache {build.cache_root()}); a cold build takes several minutes"
        )
    try:
        build.etcd_binary()
        build.kubernetes_binaries()
    except Exception as error:
        # Reported by the fixture, so the tests that need it error with the
        # reason (a failing hook here would be an INTERNALERROR instead).
        session.config.stash[_build_error] = f"{type(error).__name__}: {error}"
        return
    elapsed = time.monotonic() - began
    if elapsed > 5 and reporter is not None:
        reporter.write_line(f"devcluster: binaries ready after {elapsed:.0f}s")


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
    error = request.config.stash.get(_build_error, None)
    if error is not None:
        pytest.fail(f"devcluster: building the binaries failed: {error}", pytrace=False)
    name: str | None = request.config.getoption("devcluster_name")
    if name:
        cluster = ControlPlane(name)
        if not cluster.is_healthy():
            _start(cluster)
        yield cluster
        return

    sweep_orphans("pytest-")
    # die_with_parent: even a SIGKILLed pytest takes its cluster along.
    cluster = ControlPlane(f"pytest-{os.getpid()}", die_with_parent=True)
    with _sigterm_raises_interrupt():
        _start(cluster)
        try:
            yield cluster
        finally:
            # Keep state (logs!) of a failed session for a look; the next
            # session's sweep removes it once this process is gone.
            failed = request.session.testsfailed > 0
            cluster.stop(remove_state=not failed)
            if failed:
                reporter = request.config.pluginmanager.get_plugin("terminalreporter")
                if reporter is not None:
                    reporter.write_line(f"devcluster: logs kept in {cluster.logs_dir}")


def _start(cluster: ControlPlane) -> None:
    try:
        cluster.start()
    except ControlPlaneError as error:
        pytest.fail(f"devcluster: cluster {cluster.name!r} did not start: {error}", pytrace=False)
