"""checkpointd, the node component of a pause that keeps memory, against the
real API server: who may call it (TokenReview of a service account token for
its audience, then its allow list), what it answers to bad requests, and the
images it takes, describes and deletes in a checkpoint store. runsc is the
stand-in of tests/sandbox_node.py (the real one under the real shim is the
node tier's); the pod it checkpoints was "created" through sandbox-runsc,
which records which gVisor sandbox runs a pod, as on a node."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devcluster import gvisor
from devcluster.controlplane import ControlPlane
from tests.integration.harness import (
    free_port,
    log_tail,
    service_account_token,
    wait_for_start,
)
from tests.kube import KubeJSON, api_path, core_path
from tests.sandbox_node import UID, Node, binaries, make_node, sandbox_annotations

AUDIENCE = "sandbox-checkpointd"


class Checkpointd:
    def __init__(
        self, cp: ControlPlane, node: Node, own_token: str, allow: str, **env: str
    ) -> None:
        self.port = free_port()
        self.log = node.tmp / "checkpointd.log"
        token_file = node.tmp / "own-token"
        token_file.write_text(own_token)
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    str(binaries()[gvisor.CHECKPOINTD]),
                    f"--listen=127.0.0.1:{self.port}",
                    f"--runsc={node.runsc}",
                    f"--root={node.root}",
                    f"--store={node.store}",
                    f"--api-server={cp.server}",
                    f"--token-file={token_file}",
                    f"--ca-file={cp.ca_cert}",
                    f"--allow={allow}",
                ],
                env=node.env(**env),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)
        wait_for_start(self._healthy, "checkpointd", self.log)

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"checkpointd exited:\n{log_tail(self.log)}")
        try:
            return self.http.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False

    def call(self, method: str, path: str, token: str | None, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        return self.http.request(method, path, headers=headers, **kw)

    def stop(self) -> None:
        self.http.close()
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def accounts(kube: KubeJSON) -> Iterator[str]:
    """A namespace with the service accounts: checkpointd (may review
    tokens), operator (allowed to call), intruder (not allowed)."""
    ns = f"ckd-{uuid.uuid4().hex[:6]}"
    kube.create(core_path("namespaces"), {"metadata": {"name": ns}})
    for name in ("checkpointd", "operator", "intruder", "gone"):
        kube.create(core_path("serviceaccounts", ns), {"metadata": {"name": name}})
    rbac = "rbac.authorization.k8s.io/v1"
    kube.create(
        api_path(rbac, "clusterroles"),
        {
            "metadata": {"name": ns},
            "rules": [
                {
                    "apiGroups": ["authentication.k8s.io"],
                    "resources": ["tokenreviews"],
                    "verbs": ["create"],
                }
            ],
        },
    )
    kube.create(
        api_path(rbac, "clusterrolebindings"),
        {
            "metadata": {"name": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ns},
            "subjects": [{"kind": "ServiceAccount", "name": "checkpointd", "namespace": ns}],
        },
    )
    yield ns
    kube.delete(api_path(rbac, "clusterrolebindings", name=ns))
    kube.delete(api_path(rbac, "clusterroles", name=ns))
    kube.delete(core_path("namespaces", name=ns))


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return make_node(tmp_path)


@pytest.fixture
def daemon(
    control_plane: ControlPlane, kube: KubeJSON, accounts: str, node: Node
) -> Iterator[Checkpointd]:
    own = service_account_token(kube, accounts, "checkpointd", seconds=3600)
    started = Checkpointd(control_plane, node, own, f"system:serviceaccount:{accounts}:operator")
    yield started
    started.stop()


def _token(kube: KubeJSON, ns: str, account: str, audience: str = AUDIENCE) -> str:
    return service_account_token(kube, ns, account, seconds=3600, audiences=[audience])


def _error(response: httpx.Response) -> tuple[int, str]:
    code: str = response.json()["error"]["code"]
    return response.status_code, code


def test_only_the_allowed_account_with_a_token_for_checkpointd_gets_in(
    kube: KubeJSON, accounts: str, daemon: Checkpointd
) -> None:
    path = "/v1/checkpoints/team-a/k1"
    assert _error(daemon.call("GET", path, None)) == (401, "unauthenticated")
    basic = daemon.http.get(path, headers={"Authorization": "Basic b3BlcmF0b3I6eA=="})
    assert _error(basic) == (401, "unauthenticated")
    assert _error(daemon.call("GET", path, "not-a-token")) == (401, "unauthenticated")
    # A token of the right account for another audience (the API server's).
    for_api = service_account_token(kube, accounts, "operator", seconds=3600)
    assert _error(daemon.call("GET", path, for_api)) == (401, "unauthenticated")
    # A valid token of an account that is not allowed.
    refused = daemon.call("GET", path, _token(kube, accounts, "intruder"))
    assert _error(refused) == (403, "forbidden")
    assert f"system:serviceaccount:{accounts}:intruder" in refused.json()["error"]["message"]
    # The token of an account deleted since it was issued.
    orphan = _token(kube, accounts, "gone")
    kube.delete(core_path("serviceaccounts", accounts, "gone"))
    assert _error(daemon.call("GET", path, orphan)) == (401, "unauthenticated")
    # The allowed account: through to the store (no such image yet).
    allowed = daemon.call("GET", path, _token(kube, accounts, "operator"))
    assert _error(allowed) == (404, "not_found")
    assert daemon.http.get("/healthz").text == "ok\n"


def test_it_takes_describes_and_deletes_an_image(
    kube: KubeJSON, accounts: str, daemon: Checkpointd, node: Node
) -> None:
    token = _token(kube, accounts, "operator")
    assert node.create("pod1", sandbox_annotations()).returncode == 0
    body = {"namespace": "team-a", "podUID": UID, "key": "k1"}
    taken = daemon.call("POST", "/v1/checkpoints", token, json=body)
    assert taken.status_code == 200, taken.text
    assert taken.json()["bytes"] > 0
    assert node.passed_on()[-3:] == [
        "checkpoint",
        f"--image-path={node.store / 'team-a' / '.k1.partial'}",
        "pod1",
    ]
    described = daemon.call("GET", "/v1/checkpoints/team-a/k1", token)
    assert described.status_code == 200, described.text
    assert described.json() == {
        "namespace": "team-a",
        "key": "k1",
        "bytes": taken.json()["bytes"],
        "build": node.build,
        "restorable": True,
    }
    # The pod is ended: taken once, it is not there to take again.
    assert node.create("pod2", sandbox_annotations()).returncode == 1
    assert daemon.call("DELETE", "/v1/checkpoints/team-a/k1", token).status_code == 204
    assert not (node.store / "team-a" / "k1").exists()
    gone = daemon.call("DELETE", "/v1/checkpoints/team-a/k1", token)
    assert _error(gone) == (404, "not_found")


def test_bad_requests_get_a_reason_and_change_nothing(
    kube: KubeJSON, accounts: str, daemon: Checkpointd, node: Node
) -> None:
    token = _token(kube, accounts, "operator")
    assert node.create("pod1", sandbox_annotations()).returncode == 0
    node.record.unlink()
    for body, expected in (
        ({"namespace": "team-a", "podUID": UID}, (400, "invalid")),  # no key
        ({"namespace": "../etc", "podUID": UID, "key": "k1"}, (400, "invalid")),
        ({"namespace": "team-a", "podUID": UID, "key": "a/b"}, (400, "invalid")),
        ({"namespace": "team-a", "podUID": UID, "key": "k1", "x": 1}, (400, "invalid")),
        ({"namespace": "team-a", "podUID": str(uuid.uuid4()), "key": "k1"}, (404, "not_found")),
        ({"namespace": "team-a", "podUID": "../../x", "key": "k1"}, (404, "not_found")),
    ):
        answer = daemon.call("POST", "/v1/checkpoints", token, json=body)
        assert _error(answer) == expected, (body, answer.text)
    not_json = daemon.call("POST", "/v1/checkpoints", token, content=b"{")
    assert _error(not_json) == (400, "invalid")
    for path in ("/v1/checkpoints/Team_A/k1", "/v1/checkpoints/team-a/a%2Fb"):
        assert _error(daemon.call("GET", path, token)) == (400, "invalid"), path
    kept = node.image("team-a", "kept")
    for path in ("/v1/checkpoints/team-a/%2e%2e", "/v1/checkpoints/team-a/..%2Fteam-a"):
        assert daemon.call("DELETE", path, token).status_code != 204, path
    # Nothing reached runsc, the store is as it was, the pod may start again.
    assert not node.record.exists()
    assert [p.name for p in node.store.glob("*/*")] == ["kept"]
    assert kept.is_dir()
    assert node.create("pod2", sandbox_annotations()).returncode == 0


def test_a_failed_checkpoint_says_why(
    kube: KubeJSON, accounts: str, control_plane: ControlPlane, node: Node
) -> None:
    own = service_account_token(kube, accounts, "checkpointd", seconds=3600)
    allow = f"system:serviceaccount:{accounts}:operator"
    daemon = Checkpointd(control_plane, node, own, allow, FAIL="1")  # its runsc fails
    try:
        assert node.create("pod1", sandbox_annotations()).returncode == 0
        body = {"namespace": "team-a", "podUID": UID, "key": "k1"}
        token = _token(kube, accounts, "operator")
        failed = daemon.call("POST", "/v1/checkpoints", token, json=body)
        assert _error(failed) == (500, "checkpoint_failed")
        assert "cannot save endpoint" in failed.json()["error"]["message"]
        assert not any(node.store.glob("team-a/*"))
        # The pod was not marked ended: it runs on.
        assert node.create("pod2", sandbox_annotations()).returncode == 0
    finally:
        daemon.stop()
