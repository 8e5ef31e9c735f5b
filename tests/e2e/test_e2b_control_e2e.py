"""The E2B control plane through E2B's own Python SDK (`e2b`, pinned), unchanged:
create, info, list with metadata filters, the lease (set_timeout, its end),
pause and connect, kill; API keys (a ServiceAccount token, an `e2b_` key
minted on the gateway, a wrong key, another namespace's key, a revoked key);
a template that does not exist.

Which gateway it talks to (the `e2b` fixture):
- SANDBOX_E2E_E2B_URL set: that E2B listener (and SANDBOX_E2E_GATEWAY_URL, the
  same gateway's main listener, where keys are minted), on the cluster of
  KUBECONFIG, e.g. a gateway run from a checkout against `make up`'s cluster;
  SANDBOX_E2E_E2B_TEMPLATE names the template (default `base`).
- Otherwise the e2e tier's own cluster: the chart's gateway when its Service has
  a port named `e2b`, else a gateway process started from this tree on the
  node with its E2B listener on (the chart's image, the same code).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import e2b
import httpx
import pytest
from e2b import Sandbox, SandboxQuery, SandboxState

from devcluster import deploy
from tests.e2e.conftest import E2E
from tests.integration.harness import wait_for
from tests.kube import ApiError, KubeJSON, api_path, core_path

pytestmark = pytest.mark.timeout(900)

URL_VARIABLE = "SANDBOX_E2E_E2B_URL"
GATEWAY_VARIABLE = "SANDBOX_E2E_GATEWAY_URL"
TEMPLATE_VARIABLE = "SANDBOX_E2E_E2B_TEMPLATE"
RBAC = "rbac.authorization.k8s.io/v1"
SANDBOXES = "/apis/sandbox.dev/v1alpha1/namespaces/{ns}/sandboxes"


@dataclass
class E2BTarget:
    """A gateway's E2B listener, its main listener, and the cluster behind them."""

    kube: KubeJSON
    url: str
    gateway: str
    template: str
    namespaces: list[str] = field(default_factory=list)

    def namespace(self) -> str:
        name = f"e2b-{uuid.uuid4().hex[:8]}"
        self.kube.create(core_path("namespaces"), deploy.restricted_namespace(name))
        wait_for(
            lambda: self.kube.get(core_path("serviceaccounts", name, "default")) is not None,
            30,
            f"default ServiceAccount in {name}",
        )
        self.namespaces.append(name)
        return name

    def account(self, ns: str, name: str, role: str | None = "user") -> None:
        """A ServiceAccount, bound in its namespace to the chart's `role` (or nothing)."""
        self.kube.create(
            core_path("serviceaccounts", ns), {"apiVersion": "v1", "metadata": {"name": name}}
        )
        if role:
            self.kube.create(
                api_path(RBAC, "rolebindings", ns),
                {
                    "apiVersion": RBAC,
                    "kind": "RoleBinding",
                    "metadata": {"name": f"{name}-{role}"},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": role if role in ("edit", "admin") else f"{deploy.RELEASE}-{role}",
                    },
                    "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
                },
            )

    def token(self, ns: str, name: str) -> str:
        issued = self.kube.create(
            core_path("serviceaccounts", ns, name, "token"),
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}},
        )
        token: str = issued["status"]["token"]
        return token

    def mint(self, ns: str, account: str, minter: str) -> dict[str, str]:
        """An `e2b_` key for `account`, minted on the main listener by `minter`'s token."""
        answer = httpx.post(
            f"{self.gateway}/v1/namespaces/{ns}/e2bkeys",
            headers={"Authorization": f"Bearer {minter}"},
            json={"serviceAccount": account},
            timeout=30,
        )
        assert answer.status_code == 201, answer.text
        minted: dict[str, str] = answer.json()
        return minted

    def opts(self, key: str) -> dict[str, Any]:
        """The SDK's connection options: what E2B_API_KEY, E2B_API_URL and
        E2B_SANDBOX_URL would say."""
        return {"api_key": key, "api_url": self.url, "sandbox_url": self.url}

    def sandboxes(self, ns: str) -> list[str]:
        return [s["metadata"]["name"] for s in self.kube.list(SANDBOXES.format(ns=ns))]

    def sandbox(self, ns: str, name: str) -> dict[str, Any] | None:
        return self.kube.get(f"{SANDBOXES.format(ns=ns)}/{name}")

    def cleanup(self) -> None:
        for name in self.namespaces:
            with contextlib.suppress(ApiError):
                self.kube.delete(core_path("namespaces", name=name))
        for name in self.namespaces:
            wait_for(partial(self._gone, name), 120, f"namespace {name} deleted")
        self.namespaces.clear()

    def _gone(self, namespace: str) -> bool:
        return self.kube.get(core_path("namespaces", name=namespace)) is None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.contextmanager
def _gateway_process(kubeconfig: Path, keys_namespace: str) -> Iterator[tuple[str, str]]:
    """This tree's gateway, on the node, with its E2B listener: (main, e2b) URLs."""
    main, e2b_port = _free_port(), _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp, "keys")
        keys.mkdir()
        (keys / "k1").write_bytes(os.urandom(48).hex().encode())
        repo = Path(__file__).resolve().parents[2]
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "PYTHONPATH": str(repo / "operator"),
            "SANDBOX_GATEWAY_KEYS_DIR": str(keys),
            "SANDBOX_GATEWAY_HOST": "127.0.0.1",
            "SANDBOX_GATEWAY_PORT": str(main),
            "SANDBOX_GATEWAY_E2B_PORT": str(e2b_port),
            "SANDBOX_GATEWAY_METRICS_PORT": "0",
            "SANDBOX_GATEWAY_E2B_KEYS_NAMESPACE": keys_namespace,
        }
        log = Path(tmp, "gateway.log")
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "sandbox_operator.gateway"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:

            def ready() -> bool:
                if process.poll() is not None:
                    raise AssertionError(f"the gateway exited:\n{log.read_text()[-4000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    return httpx.get(f"http://127.0.0.1:{main}/readyz").status_code == 200
                return False

            wait_for(ready, 60, "the gateway ready")
            yield f"http://127.0.0.1:{main}", f"http://127.0.0.1:{e2b_port}"
        finally:
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(30)
            if process.poll() is None:
                process.kill()


def _chart_urls(kube: KubeJSON) -> tuple[str, str] | None:
    """(main, e2b) URLs of the chart's gateway Service by its ClusterIP (the tests
    run on the node), when the Service has an `e2b` port."""
    service = kube.read(core_path("services", deploy.NAMESPACE, f"{deploy.RELEASE}-gateway"))
    ports = {p.get("name"): p["port"] for p in service["spec"]["ports"]}
    if "e2b" not in ports:
        return None
    address = service["spec"]["clusterIP"]
    return f"http://{address}:{ports['http']}", f"http://{address}:{ports['e2b']}"


if os.environ.get(URL_VARIABLE):

    @pytest.fixture
    def e2b_target() -> Iterator[E2BTarget]:
        gateway = os.environ.get(GATEWAY_VARIABLE)
        assert gateway, f"{GATEWAY_VARIABLE}: the main listener of the gateway at {URL_VARIABLE}"
        with KubeJSON(os.environ["KUBECONFIG"]) as kube:
            target = E2BTarget(
                kube,
                os.environ[URL_VARIABLE].rstrip("/"),
                gateway.rstrip("/"),
                os.environ.get(TEMPLATE_VARIABLE, "base"),
            )
            try:
                yield target
            finally:
                target.cleanup()

else:

    @pytest.fixture
    def e2b_target(e2e: E2E) -> Iterator[E2BTarget]:
        target = E2BTarget(e2e.kube, "", "", os.environ.get(TEMPLATE_VARIABLE, "base"))
        try:
            chart = _chart_urls(e2e.kube)
            if chart is not None:
                target.gateway, target.url = chart
                yield target
                return
            with _gateway_process(e2e.cluster.kubeconfig, target.namespace()) as (main, url):
                target.gateway, target.url = main, url
                yield target
        finally:
            target.cleanup()


@dataclass
class Team:
    """A namespace with a user (the chart's user role) and a key of it."""

    ns: str
    key: str
    opts: dict[str, Any]


def _team(target: E2BTarget) -> Team:
    ns = target.namespace()
    target.account(ns, "worker")
    target.account(ns, "keymaster", "edit")  # may create serviceaccounts/token
    minted = target.mint(ns, "worker", target.token(ns, "keymaster"))
    assert minted["key"].startswith("e2b_")
    assert len(minted["key"]) == 44
    return Team(ns, minted["key"], target.opts(minted["key"]))


def test_create_info_list_lease_kill(e2b_target: E2BTarget) -> None:
    team = _team(e2b_target)
    tag = uuid.uuid4().hex
    started = time.monotonic()
    sbx = Sandbox.create(
        e2b_target.template,
        timeout=300,
        metadata={"suite": tag, "odd key": "a/b c"},
        envs={"GREETING": "hello"},
        **team.opts,
    )
    print(f"Sandbox.create: {time.monotonic() - started:.2f} s")
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert info.state == SandboxState.RUNNING
    assert info.metadata == {"suite": tag, "odd key": "a/b c"}
    assert timedelta(seconds=250) < info.end_at - datetime.now(UTC) <= timedelta(seconds=300)
    # The ID is the Sandbox's name, in the key's namespace; the lease is on it.
    body = e2b_target.sandbox(team.ns, sbx.sandbox_id)
    assert body is not None
    assert body["metadata"]["labels"]["sandbox.dev/e2b"] == "true"
    assert body["spec"]["lifecycle"]["onExpiry"] == "Delete"
    assert body["spec"]["env"] == [{"name": "GREETING", "value": "hello"}]

    for metadata in ({"suite": tag}, {"odd key": "a/b c"}, {"suite": tag, "odd key": "a/b c"}):
        found = Sandbox.list(query=SandboxQuery(metadata=metadata), **team.opts).next_items()
        assert [s.sandbox_id for s in found] == [sbx.sandbox_id], metadata
    none = Sandbox.list(query=SandboxQuery(metadata={"suite": "other"}), **team.opts)
    assert none.next_items() == []
    paused = SandboxQuery(metadata={"suite": tag}, state=[SandboxState.PAUSED])
    assert Sandbox.list(query=paused, **team.opts).next_items() == []

    # set_timeout moves the end either way: here, sooner.
    sbx.set_timeout(120)
    shorter = sbx.get_info().end_at
    assert shorter < info.end_at
    body = e2b_target.sandbox(team.ns, sbx.sandbox_id)
    assert body is not None
    assert body["spec"]["lifecycle"]["expiresAt"] == shorter.strftime("%Y-%m-%dT%H:%M:%SZ")

    metrics = sbx.get_metrics()
    assert len(metrics) == 1
    assert metrics[0].cpu_count >= 1
    assert metrics[0].mem_total > 0

    assert sbx.kill() is True
    assert Sandbox.kill(sbx.sandbox_id, **team.opts) is False
    with pytest.raises(e2b.NotFoundException):
        Sandbox.get_info(sbx.sandbox_id, **team.opts)
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": tag}), **team.opts).next_items() == []


def test_pages_of_the_list(e2b_target: E2BTarget) -> None:
    team = _team(e2b_target)
    tag = uuid.uuid4().hex
    first = Sandbox.create(e2b_target.template, timeout=300, metadata={"suite": tag}, **team.opts)
    second = Sandbox.create(e2b_target.template, timeout=300, metadata={"suite": tag}, **team.opts)
    paginator = Sandbox.list(query=SandboxQuery(metadata={"suite": tag}), limit=1, **team.opts)
    page = paginator.next_items()
    assert [s.sandbox_id for s in page] == [second.sandbox_id]  # newest first
    assert paginator.has_next
    page = paginator.next_items()
    assert [s.sandbox_id for s in page] == [first.sandbox_id]
    assert not paginator.has_next
    for sbx in (first, second):
        sbx.kill()


def test_pause_then_connect(e2b_target: E2BTarget) -> None:
    team = _team(e2b_target)
    sbx = Sandbox.create(e2b_target.template, timeout=120, **team.opts)
    assert sbx.is_running()
    assert sbx.pause() is True
    assert sbx.get_info().state == SandboxState.PAUSED
    assert Sandbox.pause(sbx.sandbox_id, **team.opts) is False  # 409: paused already
    listed = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED]), **team.opts)
    assert [s.sandbox_id for s in listed.next_items()] == [sbx.sandbox_id]
    assert not sbx.is_running()

    resumed = Sandbox.connect(sbx.sandbox_id, timeout=600, **team.opts)
    assert resumed.sandbox_id == sbx.sandbox_id
    info = resumed.get_info()
    assert info.state == SandboxState.RUNNING
    assert info.end_at - datetime.now(UTC) > timedelta(seconds=500)
    assert resumed.is_running()
    # Connecting to a running one never shortens its lease.
    Sandbox.connect(sbx.sandbox_id, timeout=10, **team.opts)
    assert resumed.get_info().end_at == info.end_at
    resumed.kill()


def test_the_lease_ends_with_a_pause_then_connect_resumes(e2b_target: E2BTarget) -> None:
    team = _team(e2b_target)
    sbx = Sandbox.create(
        e2b_target.template, timeout=5, lifecycle={"on_timeout": "pause"}, **team.opts
    )
    assert sbx.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
    wait_for(lambda: sbx.get_info().state == SandboxState.PAUSED, 30, "paused at the lease's end")
    assert not sbx.is_running()
    # The operator pauses it by itself (idlePausedAt), gateway or not.
    wait_for(
        lambda: ((e2b_target.sandbox(team.ns, sbx.sandbox_id) or {}).get("status") or {}).get(
            "idlePausedAt"
        ),
        120,
        "the operator's pause at the lease end",
    )
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=300, **team.opts)
    assert resumed.get_info().state == SandboxState.RUNNING
    assert resumed.is_running()
    resumed.kill()


def test_the_lease_ends_with_a_delete(e2b_target: E2BTarget) -> None:
    team = _team(e2b_target)
    sbx = Sandbox.create(e2b_target.template, timeout=30, **team.opts)
    sbx.set_timeout(1)
    time.sleep(2)
    # Over for E2B at once; deleted by the operator on its next pass.
    with pytest.raises(e2b.NotFoundException):
        sbx.get_info()
    assert not sbx.is_running()
    wait_for(lambda: sbx.sandbox_id not in e2b_target.sandboxes(team.ns), 120, "deleted")


def test_keys_and_namespaces(e2b_target: E2BTarget) -> None:
    team, other = _team(e2b_target), _team(e2b_target)
    sbx = Sandbox.create(e2b_target.template, timeout=300, **team.opts)

    # A wrong key: 401, whatever it names.
    for wrong in ("e2b_" + "0" * 40, "not-a-token"):
        with pytest.raises(e2b.AuthenticationException):
            Sandbox.list(**e2b_target.opts(wrong)).next_items()
        with pytest.raises(e2b.AuthenticationException):
            Sandbox.get_info(sbx.sandbox_id, **e2b_target.opts(wrong))

    # Another namespace's key: the sandbox does not exist there.
    with pytest.raises(e2b.NotFoundException):
        Sandbox.get_info(sbx.sandbox_id, **other.opts)
    assert Sandbox.kill(sbx.sandbox_id, **other.opts) is False
    with pytest.raises(e2b.NotFoundException):
        Sandbox.connect(sbx.sandbox_id, **other.opts)
    assert Sandbox.list(**other.opts).next_items() == []
    assert sbx.get_info().sandbox_id == sbx.sandbox_id

    # A ServiceAccount's own token is a key too, in its own namespace.
    token = e2b_target.token(team.ns, "worker")
    assert [s.sandbox_id for s in Sandbox.list(**e2b_target.opts(token)).next_items()] == [
        sbx.sandbox_id
    ]
    # RBAC decides: a ServiceAccount without the user role may not create.
    e2b_target.account(team.ns, "bystander", None)
    bystander = e2b_target.opts(e2b_target.token(team.ns, "bystander"))
    with pytest.raises(e2b.SandboxException, match="403"):
        Sandbox.create(e2b_target.template, **bystander)

    # Revoked: the key stops working (at once on the replica that revoked it,
    # within the gateway's e2b_key_seconds on the others).
    minter = e2b_target.token(team.ns, "keymaster")
    listed = httpx.get(
        f"{e2b_target.gateway}/v1/namespaces/{team.ns}/e2bkeys",
        headers={"Authorization": f"Bearer {minter}"},
    ).json()["items"]
    assert [k["serviceAccount"] for k in listed] == ["worker"]
    revoked = httpx.delete(
        f"{e2b_target.gateway}/v1/namespaces/{team.ns}/e2bkeys/{listed[0]['id']}",
        headers={"Authorization": f"Bearer {minter}"},
    )
    assert revoked.status_code == 204, revoked.text

    def refused() -> bool:
        try:
            Sandbox.list(**team.opts).next_items()
        except e2b.AuthenticationException:
            return True
        return False

    wait_for(refused, 30, "the revoked key refused")
    Sandbox.kill(sbx.sandbox_id, **e2b_target.opts(token))


def test_a_template_that_does_not_exist(e2b_target: E2BTarget) -> None:
    team = _team(e2b_target)
    with pytest.raises(e2b.SandboxException, match="not found") as caught:
        Sandbox.create("no-such-template", **team.opts)
    assert "404" in str(caught.value)
    with pytest.raises(e2b.SandboxException, match="400"):
        Sandbox.create(e2b_target.template, timeout=10**7, **team.opts)
    assert e2b_target.sandboxes(team.ns) == []
