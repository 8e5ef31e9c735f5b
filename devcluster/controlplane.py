"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager.

For tests and local use only. Each cluster has a name and a state directory
(`<cache root>/clusters/<name>` unless given) holding its PKI, kubeconfigs, etcd
data, logs and the PID records of its processes, so clusters of different
names never collide and a later process (the CLI's `down`, or the next `up`
after a crash) can find and stop what an earlier one started.

Components are a list of `Component`s started in order, each waited on until
its health probe passes, and stopped in reverse order. A node tier (kubelet,
containerd, scheduler, CSI sidecars) is meant to extend `ControlPlane.components`
in a subclass rather than rewrite this module.

This module knows no subclass: which class to open a cluster found on disk
with is `devcluster.registry`'s business, above both this module and
`devcluster.cluster`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import random
import re
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from devcluster import build, pki, probes, processes, records, state
from devcluster.state import LOOPBACK, ClusterRecord, Ports

log = logging.getLogger("devcluster")

DEFAULT_NAME = "dev"
DEFAULT_SERVICE_CIDR = "10.96.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
# Whose requests kube-apiserver writes to the audit log (`ControlPlane.audit_logs`):
# the ServiceAccounts of the operator's namespace, i.e. the operator and the
# gateway. What they used is what the least-privilege test compares with what
# the chart grants; nobody else is logged, so the log stays small.
AUDITED_GROUP = "system:serviceaccounts:sandbox-system"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
# Ports are drawn below the kernel's ephemeral range: the kernel never hands
# those out to outgoing connections, so a port that was free when chosen stays
# free until the component binds it (barring another cluster picking it too,
# which the start retries handle).
_PORT_RANGE_START = 20000
_ADDRESS_IN_USE = "address already in use"
T = TypeVar("T")


def audit_flags(
    policy: Path,
    log: Path,
    subjects: Mapping[str, list[str]],
    *,
    max_megabytes: int = 0,
    backups: int = 0,
) -> list[str]:
    """kube-apiserver flags for a JSON audit log at `log` of the requests of
    `subjects` (a policy rule's `users` and/or `userGroups`), metadata only,
    everyone else left out; writes the policy to `policy`. `max_megabytes` 0:
    never rotated."""
    rules = [{"level": "Metadata", **subjects}, {"level": "None"}]
    policy.write_text(
        json.dumps(
            {
                "apiVersion": "audit.k8s.io/v1",
                "kind": "Policy",
                "omitStages": ["RequestReceived"],
                "rules": rules,
            }
        )
    )
    flags = [
        f"--audit-policy-file={policy}",
        f"--audit-log-path={log}",
        "--audit-log-format=json",
        f"--audit-log-maxsize={max_megabytes}",
    ]
    return flags + ([f"--audit-log-maxbackup={backups}"] if backups else [])


@dataclass
class Component:
    """One process of the cluster: how to run it and how to know it is serving."""

    name: str
    argv: list[str]
    ready: Callable[[], bool]
    """One quick probe (a couple of seconds at most); True once the component serves."""
    env: dict[str, str] = field(default_factory=dict)
    """Added to the minimal environment every component gets."""
    ports: list[int] = field(default_factory=list)
    """Ports it listens on (recorded, so stop() can be checked against them)."""
    ready_timeout: float = 120.0
    cleanup: Callable[[], None] | None = None
    """Run after its processes are gone (e.g. unmount, delete interfaces)."""
    post_start: Callable[[], None] | None = None
    """Run once the component is ready, before the next one starts (e.g. import
    images into a container runtime); an exception fails the start."""


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    pid: int
    running: bool
    ready: bool


@dataclass(frozen=True)
class Status:
    name: str
    state_dir: Path
    server: str | None
    components: list[ComponentStatus]

    @property
    def healthy(self) -> bool:
        return bool(self.components) and all(c.running and c.ready for c in self.components)


class ControlPlaneError(RuntimeError):
    """The cluster could not be started or stopped; the message says which part and why."""


def run_kubectl(
    kubectl: Path,
    kubeconfig: Path,
    args: list[str],
    *,
    stdin: str | None = None,
    error: type[Exception] = ControlPlaneError,
) -> str:
    """kubectl's stdout; `error` with its stderr when it fails. A minimal
    environment: no KUBECONFIG or kubectl plugins of the caller's leak in."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home())}
    proc = subprocess.run(
        [str(kubectl), f"--kubeconfig={kubeconfig}", *args],
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        raise error(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


# Ports this process handed out: a cluster chooses its control plane's and its
# node's ports in separate calls before anything binds them, so a port free at
# the second call may already be promised to the first (seen: the controller
# manager and kube-proxy's healthz given the same port).
_HANDED_OUT: set[int] = set()


def free_ports(count: int) -> list[int]:
    """Free TCP ports below the ephemeral range, so no outgoing connection takes
    one between choosing and binding it; never one this process handed out before."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    high = max(low - 1, _PORT_RANGE_START + 1000)
    taken = processes.listening_ports()
    chosen: list[int] = []
    while len(chosen) < count:
        port = random.randint(_PORT_RANGE_START, high)
        if port in taken or port in chosen or port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        chosen.append(port)
    _HANDED_OUT.update(chosen)
    return chosen


def secure_serving_flags(
    *, bind: str, port: int, serving: pki.CertPair, client_ca: Path, cert_dir: Path
) -> list[str]:
    """The HTTPS serving flags that kube-apiserver, kube-controller-manager and
    kube-scheduler share (k8s.io/apiserver's SecureServingOptions, plus the CA
    that client certificates are verified against)."""
    return [
        f"--bind-address={bind}",
        f"--secure-port={port}",
        # Only used when no certificate is given; keeps it away from the
        # default /var/run/kubernetes all the same.
        f"--cert-dir={cert_dir}",
        f"--tls-cert-file={serving.cert}",
        f"--tls-private-key-file={serving.key}",
        f"--client-ca-file={client_ca}",
    ]


# How long restart() watches the other components after the restarted one is
# ready: a dependent gives up a few seconds after its last failed call.
_RESTART_SETTLE_SECONDS = 10.0


def loopback_controller(
    name: str,
    binary: Path,
    *,
    kubeconfig: Path,
    port: int,
    serving: pki.CertPair,
    certs: pki.PKI,
    state_dir: Path,
    flags: Sequence[str],
    started_check: str | None = None,
) -> Component:
    """kube-controller-manager or kube-scheduler: a client of the API server
    (`kubeconfig`) that serves HTTPS on 127.0.0.1:`port`, ready once its
    /healthz says ok, or, with `started_check`, once its verbose /healthz lists
    that check as passing. The same kubeconfig serves the delegated
    authentication and authorization of that port (healthz is always allowed;
    metrics need a permitted client); leader election is off (one replica)."""
    ca = ssl.create_default_context(cafile=str(certs.ca.cert))
    path, body = (
        ("/healthz", probes.says_ok)
        if started_check is None
        else ("/healthz?verbose", probes.passes_check(started_check))
    )
    return Component(
        name=name,
        argv=[
            str(binary),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            *secure_serving_flags(
                bind=LOOPBACK,
                port=port,
                serving=serving,
                client_ca=certs.ca.cert,
                cert_dir=state_dir / f"{name}-certs",
            ),
            "--leader-elect=false",
            *flags,
        ],
        ready=lambda: probes.http_ok(port, path, tls=ca, body=body),
        ports=[port],
        ready_timeout=120.0,
    )


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager on 127.0.0.1.

    `start()` (also when a stale cluster of the same name is left over: that one
    is killed and its etcd data wiped first), `stop()`, `status()`. After start:
    `server`, `kubeconfig` (admin, system:masters), `kubectl` (the pinned build;
    call it by this path, a different kubectl may be on PATH), `logs_dir`.
    Usable as a context manager.
    """

    kind = "control-plane"
    """Recorded in cluster.json, so `devcluster.registry.open_cluster` (CLI
    `down`, the test sessions' orphan sweep) stops a cluster with the class
    that started it."""

    def __init__(
        self,
        name: str = DEFAULT_NAME,
        *,
        state_dir: Path | None = None,
        service_cidr: str = DEFAULT_SERVICE_CIDR,
        die_with_parent: bool = False,
        stop_grace: float = 10.0,
        start_attempts: int = 3,
        apiserver_args: Sequence[str] = (),
    ) -> None:
        """`die_with_parent`: the components get SIGKILL when the calling thread's
        process ends (PR_SET_PDEATHSIG), for test sessions; call start() from a
        long-lived thread then, as the signal follows the thread that forked.
        The CLI leaves it off so that `up` can exit and the cluster stays."""
        if not _NAME_RE.match(name):
            raise ValueError(f"cluster name {name!r} must match {_NAME_RE.pattern}")
        self.name = name
        self.state_dir = state_dir or state.clusters_root() / name
        self.service_cidr = service_cidr
        self.die_with_parent = die_with_parent
        self.stop_grace = stop_grace
        self.start_attempts = start_attempts
        # Extra kube-apiserver flags, e.g. an audit log for a benchmark.
        self.apiserver_args = list(apiserver_args)
        self.start_duration: float | None = None
        """Seconds the last start() took (binaries already built), for reporting."""
        self._popens: dict[str, subprocess.Popen[bytes]] = {}

    # ---- layout ---------------------------------------------------------------

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def audit_logs(self) -> list[Path]:
        """kube-apiserver's audit log (metadata of the requests of `AUDITED_GROUP`),
        rotated files first; empty before the first start."""
        return sorted(self.logs_dir.glob("audit-*.log")) + sorted(self.logs_dir.glob("audit.log"))

    @property
    def run_dir(self) -> Path:
        return self.state_dir / "run"

    @property
    def etcd_dir(self) -> Path:
        return self.state_dir / "etcd"

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "admin.kubeconfig"

    @property
    def _lock_file(self) -> Path:
        # Beside the state dir, not in it: `down` removes the state dir while
        # holding the lock.
        return self.state_dir.parent / f".{self.state_dir.name}.lock"

    @property
    def ca_cert(self) -> Path:
        """The cluster CA (PEM): verifies the API server, signs its client certificates."""
        return pki.paths(self.pki_dir).ca.cert

    @property
    def kubectl(self) -> Path:
        return build.kubernetes_binaries()["kubectl"]

    @property
    def record(self) -> ClusterRecord:
        """What the last start recorded in cluster.json (empty before any)."""
        return ClusterRecord.read(self.state_dir)

    def _update_record(self, **changes: object) -> None:
        state.update_record(self.state_dir, **changes)

    def _started(self, value: T | None) -> T:
        # One message for every "recorded by a start" value that is missing.
        if value is None:
            raise ControlPlaneError(f"cluster {self.name!r} has not been started")
        return value

    @property
    def ports(self) -> Ports:
        return self._started(self.record.ports)

    @property
    def apiserver_host(self) -> str:
        """The address kube-apiserver binds and advertises (127.0.0.1 unless a
        subclass's `_prepare_start` chose another, e.g. a pod bridge's gateway)."""
        return self.record.apiserver_host

    @property
    def server(self) -> str:
        return f"https://{self.apiserver_host}:{self.ports.apiserver}"

    def kubectl_command(self, *args: str) -> list[str]:
        """argv for the pinned kubectl against this cluster as admin."""
        return [str(self.kubectl), f"--kubeconfig={self.kubeconfig}", *args]

    def env(self) -> dict[str, str]:
        """Environment for a child process (e.g. the operator) to talk to this cluster."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    # ---- components ----------------------------------------------------------

    def binaries(self, *, build_missing: bool) -> dict[str, Path]:
        """Binaries the components run, by name. Subclasses add theirs.

        stop() and status() pass build_missing=False: they must never start a
        build that takes minutes just to look at a cluster.
        """
        etcd = build.etcd_binary() if build_missing else build.etcd_path()
        return {"etcd": etcd, **build.kubernetes_binaries(build_missing=build_missing)}

    def components(
        self, ports: Ports, certs: pki.PKI, binaries: Mapping[str, Path]
    ) -> list[Component]:
        """The processes of this cluster, in start order. Subclasses append to it."""
        etcd = binaries["etcd"]
        host = self.apiserver_host
        loopback = ipaddress.ip_address(host).is_loopback
        admin_tls = self._client_context(certs)
        peer = f"http://127.0.0.1:{ports.etcd_peer}"
        client = f"http://127.0.0.1:{ports.etcd_client}"
        return [
            Component(
                name="etcd",
                argv=[
                    str(etcd),
                    "--name=default",
                    f"--data-dir={self.etcd_dir}",
                    # Plain HTTP on loopback: nothing but this cluster's API
                    # server talks to it, and TLS would only cost start time.
                    f"--listen-client-urls={client}",
                    f"--advertise-client-urls={client}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=default={peer}",
                    "--initial-cluster-state=new",
                    # A throwaway cluster: durability across power loss is not
                    # worth an fsync per write on a shared CI disk.
                    "--unsafe-no-fsync",
                ],
                ready=lambda: probes.http_ok(
                    ports.etcd_client,
                    "/health",
                    body=probes.json_body(
                        lambda body: isinstance(body, dict) and body.get("health") == "true"
                    ),
                ),
                ports=[ports.etcd_client, ports.etcd_peer],
                ready_timeout=60.0,
            ),
            Component(
                name="kube-apiserver",
                argv=[
                    str(binaries["kube-apiserver"]),
                    f"--etcd-servers={client}",
                    f"--advertise-address={host}",
                    *secure_serving_flags(
                        bind=host,
                        port=ports.apiserver,
                        serving=certs.apiserver,
                        client_ca=certs.ca.cert,
                        cert_dir=self.state_dir / "apiserver-certs",
                    ),
                    "--authorization-mode=Node,RBAC",
                    "--enable-admission-plugins=NodeRestriction",
                    "--allow-privileged=true",
                    f"--service-cluster-ip-range={self.service_cidr}",
                    f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                    f"--service-account-key-file={certs.service_account_pub}",
                    f"--service-account-signing-key-file={certs.service_account_key}",
                    f"--kubelet-client-certificate={certs.apiserver_kubelet_client.cert}",
                    f"--kubelet-client-key={certs.apiserver_kubelet_client.key}",
                    # Aggregation layer (metrics-server, extension API servers).
                    f"--requestheader-client-ca-file={certs.front_proxy_ca.cert}",
                    "--requestheader-allowed-names=front-proxy-client",
                    "--requestheader-username-headers=X-Remote-User",
                    "--requestheader-group-headers=X-Remote-Group",
                    "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                    f"--proxy-client-cert-file={certs.front_proxy_client.cert}",
                    f"--proxy-client-key-file={certs.front_proxy_client.key}",
                    # On loopback, the `kubernetes` Service's endpoints would be
                    # 127.0.0.1, which Endpoints validation rejects, so the
                    # reconciler would only log errors (and nothing in a
                    # cluster can reach a loopback API server anyway). On a
                    # routable address the Service points at it.
                    f"--endpoint-reconciler-type={'none' if loopback else 'lease'}",
                    *self._audit_flags(),
                    # Last: a caller's flag (its own audit policy) wins over ours.
                    *self.apiserver_args,
                ],
                ready=lambda: probes.http_ok(
                    ports.apiserver, "/readyz", host=host, tls=admin_tls, body=probes.says_ok
                ),
                ports=[ports.apiserver],
                ready_timeout=180.0,
            ),
            loopback_controller(
                "kube-controller-manager",
                binaries["kube-controller-manager"],
                kubeconfig=self.state_dir / "controller-manager.kubeconfig",
                port=ports.controller_manager,
                serving=certs.controller_manager_serving,
                certs=certs,
                state_dir=self.state_dir,
                flags=[
                    f"--requestheader-client-ca-file={certs.front_proxy_ca.cert}",
                    # Every default controller: garbage collector, namespace,
                    # serviceaccount, serviceaccount-token, workloads, ...
                    "--controllers=*",
                    "--use-service-account-credentials=true",
                    f"--cluster-name={self.name}",
                    f"--service-cluster-ip-range={self.service_cidr}",
                    f"--root-ca-file={certs.ca.cert}",
                    f"--service-account-private-key-file={certs.service_account_key}",
                    f"--cluster-signing-cert-file={certs.ca.cert}",
                    f"--cluster-signing-key-file={certs.ca.key}",
                ],
                # Its /healthz says ok from the first moment, while it still waits
                # (10 s at most, then exits) for the API server's: ready means its
                # controllers started, which registers this check.
                started_check="serviceaccount-token-controller",
            ),
        ]

    @staticmethod
    def _client_context(certs: pki.PKI) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(certs.ca.cert))
        context.load_cert_chain(str(certs.admin.cert), str(certs.admin.key))
        return context

    def _base_env(self) -> dict[str, str]:
        # A minimal environment: ETCD_* variables become etcd flags, and
        # KUBECONFIG or proxy settings of the caller must not leak in.
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home())}
        for key in ("TMPDIR", "LANG", "TZ"):
            if key in os.environ:
                env[key] = os.environ[key]
        return env

    # ---- kubeconfigs -----------------------------------------------------------

    def _write_kubeconfig(
        self, path: Path, server: str, certs: pki.PKI, user: pki.CertPair
    ) -> None:
        pki.write_kubeconfig(
            path, server=server, ca=certs.ca.cert, user=user, context=f"devcluster-{self.name}"
        )

    # ---- lifecycle -------------------------------------------------------------

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        """One start/stop of a given cluster at a time, across processes."""
        return records.file_lock(self._lock_file)

    def _records(self) -> list[processes.ProcessRecord]:
        """PID records on disk, in start order."""
        found = []
        for name in self.record.started:
            with contextlib.suppress(FileNotFoundError, ValueError):
                found.append(processes.ProcessRecord.load(self.run_dir / f"{name}.json"))
        return found

    def start(self) -> None:
        """Start the cluster and wait until every component is ready.

        A leftover cluster of the same name (crashed run, killed CLI) is
        stopped and its etcd data removed first, so every start is clean.
        Raises ControlPlaneError with the failing component's log tail.
        """
        # Build (or wait for a concurrent build) outside the cluster lock and
        # outside the timed part: a cold build takes tens of minutes.
        binaries = self.binaries(build_missing=True)
        with self._locked():
            self._stop_locked()
            began = time.monotonic()
            for attempt in range(1, self.start_attempts + 1):
                try:
                    self._start_locked(binaries)
                except _PortCollisionError as error:
                    self._stop_locked()
                    if attempt == self.start_attempts:
                        raise ControlPlaneError(str(error)) from error
                    log.warning("%s; retrying with other ports", error)
                    continue
                except BaseException:
                    # Also on KeyboardInterrupt: never leave half a cluster.
                    self._stop_locked()
                    raise
                break
            self.start_duration = time.monotonic() - began
            self._update_record(start_seconds=round(self.start_duration, 2))

    def _audit_flags(self) -> list[str]:
        # A long-lived `make up` cluster: bounded, one rotated file kept.
        return audit_flags(
            self.state_dir / "audit-policy.json",
            self.logs_dir / "audit.log",
            {"userGroups": [AUDITED_GROUP]},
            max_megabytes=500,
            backups=1,
        )

    def _prepare_start(self) -> str:
        """Set up what the components need before any starts; returns the
        address kube-apiserver is to bind and advertise. Subclasses extend it
        (the node tier creates its pod bridge here and returns its gateway).
        The cluster file (name, ports, owner) is written already."""
        return "127.0.0.1"

    def _start_locked(self, binaries: Mapping[str, Path]) -> None:
        for directory in (self.state_dir, self.run_dir, self.logs_dir):
            directory.mkdir(parents=True, exist_ok=True)
        self.state_dir.chmod(0o700)
        ports = Ports(*free_ports(4))
        owner = os.getpid()
        # A new record, not an update: nothing of an earlier start (node
        # ports, say) may look as if this start had chosen it.
        ClusterRecord(
            name=self.name,
            kind=self.kind,
            ports=ports,
            owner_pid=owner,
            owner_start_ticks=processes.process_start_ticks(owner),
            created=time.time(),
        ).write(self.state_dir)
        host = self._prepare_start()
        self._update_record(apiserver_host=host)
        first_service_ip = str(next(ipaddress.ip_network(self.service_cidr).hosts()))
        apiserver_ips = tuple(dict.fromkeys((LOOPBACK, first_service_ip, host)))
        certs = pki.ensure_pki(self.pki_dir, apiserver_ips=apiserver_ips)
        server = f"https://{host}:{ports.apiserver}"
        self._write_kubeconfig(self.kubeconfig, server, certs, certs.admin)
        self._write_kubeconfig(
            self.state_dir / "controller-manager.kubeconfig",
            server,
            certs,
            certs.controller_manager,
        )
        started: list[str] = []
        for component in self.components(ports, certs, binaries):
            self._launch(component)
            started.append(component.name)
            # Recorded before waiting, so a crash during the wait still leaves
            # a record that the next start()/stop() can clean up.
            self._update_record(started=started)
            began = time.monotonic()
            self._wait_ready(component)
            ready = time.monotonic()
            if component.post_start is not None:
                component.post_start()
            # What each component costs a start (`up -v`, the README's figures).
            log.info(
                "%s ready in %.1fs, post-start %.1fs",
                component.name,
                ready - began,
                time.monotonic() - ready,
            )
        log.info("cluster %s is up at %s", self.name, server)

    def _launch(self, component: Component) -> None:
        popen, record = processes.launch(
            component.name,
            component.argv,
            env={**self._base_env(), **component.env},
            log_path=self.logs_dir / f"{component.name}.log",
            cwd=self.state_dir,
            ports=component.ports,
            die_with_parent=self.die_with_parent,
        )
        self._popens[component.name] = popen
        record.save(self.run_dir / f"{component.name}.json")

    def _wait_ready(self, component: Component) -> None:
        popen = self._popens[component.name]
        log_path = self.logs_dir / f"{component.name}.log"
        deadline = time.monotonic() + component.ready_timeout
        while True:
            code = popen.poll()
            if code is not None:
                tail = _log_tail(log_path)
                message = (
                    f"{component.name} exited with code {code} while starting "
                    f"(log {log_path}):\n{tail}"
                )
                if _ADDRESS_IN_USE in tail.lower():
                    raise _PortCollisionError(message)
                raise ControlPlaneError(message)
            if component.ready():
                return
            if time.monotonic() >= deadline:
                raise ControlPlaneError(
                    f"{component.name} not ready after {component.ready_timeout:.0f}s "
                    f"(log {log_path}):\n{_log_tail(log_path)}"
                )
            time.sleep(0.2)

    def stop(self, *, remove_state: bool = False) -> None:
        """Kill every process of this cluster and verify none is left.

        SIGTERM to each component's process group in reverse start order,
        SIGKILL after `stop_grace` seconds. Works on a cluster started by
        another process, from the PID records. `remove_state` also deletes
        the state directory (PKI, kubeconfig, data, logs).
        """
        with self._locked():
            self._stop_locked()
            if remove_state:
                shutil.rmtree(self.state_dir, ignore_errors=True)

    def stop_if_orphaned(self) -> bool:
        """Stop and remove this cluster if the process that started it is gone;
        whether it did. Decided under the cluster's lock: a cluster another
        process is starting right now (its owner not recorded yet) is waited
        for, then found owned, and left alone."""
        with self._locked():
            if self.owner_alive():
                return False
            self._stop_locked()
            shutil.rmtree(self.state_dir, ignore_errors=True)
        return True

    def _stop_locked(self) -> None:
        errors = []
        recorded = {record.name: record for record in self._records()}
        cleanups: dict[str, Callable[[], None]] = {}
        if recorded and self.pki_dir.exists():
            # Rebuild the component list only for its cleanup hooks, with the
            # recorded ports; no process is started by this.
            with contextlib.suppress(Exception):
                certs = pki.paths(self.pki_dir)
                binaries = self.binaries(build_missing=False)
                for component in self.components(self.ports, certs, binaries):
                    if component.cleanup is not None:
                        cleanups[component.name] = component.cleanup
        for name in reversed(list(recorded)):
            try:
                processes.terminate(
                    recorded[name], grace=self.stop_grace, popen=self._popens.pop(name, None)
                )
                if name in cleanups:
                    cleanups[name]()
            except Exception as error:  # keep stopping the others, report all
                errors.append(f"{name}: {error}")
        if errors:
            raise ControlPlaneError("could not stop cluster cleanly: " + "; ".join(errors))
        leftovers = [r for r in recorded.values() if processes.group_members(r.pid)]
        if leftovers:
            raise ControlPlaneError(f"processes left behind: {leftovers}")
        # Records are removed only once their processes are verified gone.
        shutil.rmtree(self.run_dir, ignore_errors=True)
        shutil.rmtree(self.etcd_dir, ignore_errors=True)
        if ClusterRecord.path(self.state_dir).exists():
            self._update_record(started=[])

    def restart(self, name: str) -> float:
        """Stop one running component (SIGTERM, then SIGKILL after the stop
        grace) and start it again with the same flags and ports, as a crashed
        or upgraded process comes back; its cleanup and post-start hooks do not
        run. Waits until it is ready again; returns the seconds it was away.
        For chaos runs: the API server restarted under a working operator.

        Components that die meanwhile (kube-controller-manager exits when it
        cannot get a ServiceAccount token from the API server) are started
        again, as a node's kubelet restarts its static pods: restart() watches
        them for a few seconds after the restarted one is ready."""
        with self._locked():
            certs = pki.paths(self.pki_dir)
            binaries = self.binaries(build_missing=False)
            components = {c.name: c for c in self.components(self.ports, certs, binaries)}
            record = next((r for r in self._records() if r.name == name), None)
            if name not in components or record is None or not record.is_running():
                raise ControlPlaneError(f"{name} is not a running component of {self.name}")
            others = [r.name for r in self._records() if r.name != name and r.name in components]
            began = time.monotonic()
            processes.terminate(record, grace=self.stop_grace, popen=self._popens.pop(name, None))
            self._launch(components[name])
            self._wait_ready(components[name])
            away = time.monotonic() - began
            watch_until = time.monotonic() + _RESTART_SETTLE_SECONDS
            while time.monotonic() < watch_until:
                running = {r.name for r in self._records() if r.is_running()}
                for other in others:
                    if other not in running:
                        log.warning("%s died while %s restarted; starting it again", other, name)
                        self._popens.pop(other, None)
                        self._launch(components[other])
                        self._wait_ready(components[other])
                time.sleep(0.5)
            return away

    def pids(self) -> dict[str, int]:
        """PID (= process group id) of each recorded component that is running."""
        return {r.name: r.pid for r in self._records() if r.is_running()}

    def status(self) -> Status:
        recorded = self._records()
        ready: dict[str, bool] = {}
        if recorded and self.pki_dir.exists():
            with contextlib.suppress(ControlPlaneError, OSError, ValueError):
                certs = pki.paths(self.pki_dir)
                binaries = self.binaries(build_missing=False)
                for component in self.components(self.ports, certs, binaries):
                    ready[component.name] = component.ready()
        components = [
            ComponentStatus(r.name, r.pid, r.is_running(), ready.get(r.name, False))
            for r in recorded
        ]
        server = self.server if recorded else None
        return Status(self.name, self.state_dir, server, components)

    def is_healthy(self) -> bool:
        return self.status().healthy

    def owner_alive(self) -> bool:
        """Whether the process that last started this cluster still runs."""
        record = self.record
        if record.owner_pid is None or record.owner_start_ticks is None:
            return False
        return processes.process_start_ticks(record.owner_pid) == record.owner_start_ticks

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ControlPlane(name={self.name!r}, state_dir={str(self.state_dir)!r})"


class _PortCollisionError(ControlPlaneError):
    """A component lost the race for a port chosen as free; start again with others."""
