"""SandboxTemplates and ClusterSandboxTemplates against a real API server: defaults
and overrides, a missing template, the catalog, admission rules, a failing setup
step, and lifecycle.pausedTimeout.

A successful setup (base snapshot, restore) needs CSI snapshots: it is in
test_snapshot_storage.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from tests.integration.harness import AgentProcess, Node, secret_token, wait_for
from tests.kube import JSON, ApiError, KubeJSON, core_path
from tests.sandboxes import Sandboxes
from tests.snapshots import Snapshots
from tests.templates import Templates, cluster_template_path, create_cluster_template

NODE_IMAGE = "sandbox-runtime-node:dev"


def pod_of(kube: KubeJSON, ns: str, name: str, timeout: float = 20) -> JSON:
    return wait_for(lambda: kube.get(core_path("pods", ns, name)), timeout, f"pod {name}")


def sandbox_container(pod: JSON) -> JSON:
    found: JSON = next(c for c in pod["spec"]["containers"] if c["name"] == "sandbox")
    return found


def env_of(pod: JSON) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in sandbox_container(pod).get("env", [])}


def ready_reason(sandboxes: Sandboxes, name: str) -> str:
    return str((sandboxes.condition(name, "Ready") or {}).get("reason"))


@pytest.fixture
def templates(kube: KubeJSON, ns: str) -> Templates:
    return Templates(kube, ns)


@pytest.fixture
def cluster_templates(kube: KubeJSON) -> Iterator[Callable[[str, JSON], str]]:
    made: list[str] = []

    def create(stem: str, spec: JSON) -> str:
        name = f"{stem}-{os.urandom(3).hex()}"
        create_cluster_template(kube, name, spec)
        made.append(name)
        return name

    yield create
    for name in made:
        kube.delete(cluster_template_path(name))


def test_template_defaults_then_the_sandbox_own_fields_win(
    kube: KubeJSON, ns: str, sandboxes: Sandboxes, templates: Templates
) -> None:
    templates.create(
        "small",
        {
            "description": "node, small, labelled",
            "sandbox": {
                "runtime": "node",
                "resources": {"cpu": "250m", "memory": "256Mi"},
                "env": [{"name": "A", "value": "from-template"}, {"name": "B", "value": "t"}],
                "nodeSelector": {"tier": "a"},
                "podLabels": {"team": "x"},
                "podAnnotations": {"example.com/owner": "team-x"},
                "tolerations": [{"key": "sandboxes", "operator": "Exists"}],
                "lifecycle": {"onIdle": "Pause", "pausedTimeout": "1h"},
            },
        },
    )
    sandboxes.create(
        "mine",
        {
            "templateRef": {"name": "small"},
            "resources": {"memory": "512Mi"},
            "env": [{"name": "B", "value": "own"}],
            "podLabels": {"app": "demo"},
        },
    )
    pod = pod_of(kube, ns, "mine")
    container = sandbox_container(pod)
    assert container["image"] == NODE_IMAGE
    assert container["resources"]["limits"]["memory"] == "512Mi"
    assert container["resources"]["limits"]["cpu"] == "250m"
    assert env_of(pod)["A"] == "from-template"
    assert env_of(pod)["B"] == "own"
    assert pod["spec"]["nodeSelector"] == {"tier": "a"}
    assert pod["spec"]["tolerations"][0]["key"] == "sandboxes"
    labels = pod["metadata"]["labels"]
    assert labels["team"] == "x"
    assert labels["app"] == "demo"
    assert labels["sandbox.dev/sandbox"] == "mine"
    assert pod["metadata"]["annotations"]["example.com/owner"] == "team-x"

    body = sandboxes.read("mine")
    used = body["status"]["template"]
    assert used["kind"] == "SandboxTemplate"
    assert used["name"] == "small"
    assert used["defaults"]["lifecycle"].get("onIdle") == "Pause", used
    # The user's object is left as written: the defaults live in status.
    assert "runtime" not in body["spec"]
    assert body["spec"]["lifecycle"] == {}

    # A later template edit reaches new Sandboxes, never a running one.
    templates.patch("small", {"spec": {"sandbox": {"resources": {"cpu": "500m"}}}})
    sandboxes.create("newer", {"templateRef": {"name": "small"}})
    newer = pod_of(kube, ns, "newer")
    assert sandbox_container(newer)["resources"]["limits"]["cpu"] == "500m"
    again = kube.read(core_path("pods", ns, "mine"))
    assert again["metadata"]["uid"] == pod["metadata"]["uid"]
    assert sandbox_container(again)["resources"]["limits"]["cpu"] == "250m"


def test_a_missing_template_holds_only_its_sandbox_until_it_exists(
    kube: KubeJSON, ns: str, sandboxes: Sandboxes, templates: Templates
) -> None:
    sandboxes.create("waiting", {"templateRef": {"name": "later"}})
    wait_for(
        lambda: ready_reason(sandboxes, "waiting") == "TemplateNotFound", 20, "TemplateNotFound"
    )
    cond = sandboxes.condition("waiting", "Ready") or {}
    assert cond["message"] == f"SandboxTemplate later in namespace {ns} does not exist", cond
    assert kube.get(core_path("pods", ns, "waiting")) is None
    assert kube.get(core_path("secrets", ns, "waiting-agent-token")) is None

    # Nothing else waits with it.
    sandboxes.create("plain", {"runtime": "python"})
    pod_of(kube, ns, "plain")

    templates.create("later", {"sandbox": {"runtime": "node"}})
    pod = pod_of(kube, ns, "waiting", timeout=30)
    assert sandbox_container(pod)["image"] == NODE_IMAGE
    templates.wait_reason("later", "NoSetup", timeout=30)


def test_cluster_templates_are_the_catalog(
    kube: KubeJSON,
    ns: str,
    sandboxes: Sandboxes,
    cluster_templates: Callable[[str, JSON], str],
) -> None:
    name = cluster_templates(
        "node", {"description": "Node.js for everyone", "sandbox": {"runtime": "node"}}
    )
    listed = {t["metadata"]["name"]: t for t in kube.list(cluster_template_path())}
    assert listed[name]["spec"]["description"] == "Node.js for everyone"

    sandboxes.create(
        "from-catalog", {"templateRef": {"kind": "ClusterSandboxTemplate", "name": name}}
    )
    assert sandbox_container(pod_of(kube, ns, "from-catalog"))["image"] == NODE_IMAGE
    used = sandboxes.read("from-catalog")["status"]["template"]
    assert used == {**used, "kind": "ClusterSandboxTemplate", "name": name}

    # A Sandbox naming a missing cluster template says which.
    sandboxes.create("nowhere", {"templateRef": {"kind": "ClusterSandboxTemplate", "name": "nope"}})
    wait_for(
        lambda: ready_reason(sandboxes, "nowhere") == "TemplateNotFound", 20, "TemplateNotFound"
    )
    assert (sandboxes.condition("nowhere", "Ready") or {})["message"] == (
        "ClusterSandboxTemplate nope does not exist"
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"sandbox": {"paused": True}},
            "sandbox.templateRef, sandbox.poolRef and sandbox.paused cannot be set",
        ),
        (
            {"sandbox": {"workspace": {"fromSnapshot": "x"}}},
            "fromSnapshot cannot be set in a template",
        ),
        (
            {"setup": [{"name": "a", "script": "true"}, {"name": "a", "script": "false"}]},
            "Duplicate value",
        ),
        ({"sandbox": {"podLabels": {"sandbox.dev/sandbox": "x"}}}, "are the operator's"),
        (
            {
                "sandbox": {"workspace": {"ephemeral": True}},
                "setup": [{"name": "a", "script": "x"}],
            },
            "setup steps need a persistent workspace",
        ),
        ({"sandbox": {"runtime": "node", "image": "x"}}, "set at most one of runtime or image"),
    ],
)
def test_bad_templates_are_refused_at_admission(
    templates: Templates, spec: JSON, message: str
) -> None:
    with pytest.raises(ApiError) as refused:
        templates.create("bad", spec)
    assert refused.value.status == 422
    assert message in str(refused.value), refused.value


def test_cluster_templates_take_no_setup(kube: KubeJSON) -> None:
    with pytest.raises(ApiError) as refused:
        create_cluster_template(
            kube, f"setup-{os.urandom(3).hex()}", {"setup": [{"name": "a", "script": "true"}]}
        )
    assert "setup needs a namespaced SandboxTemplate" in str(refused.value)


def test_a_failing_setup_step_is_named_and_holds_its_sandboxes(
    kube: KubeJSON,
    ns: str,
    sandboxes: Sandboxes,
    templates: Templates,
    node: Node,
    agents: Callable[[str], AgentProcess],
) -> None:
    templates.create(
        "broken",
        {
            "sandbox": {"runtime": "python"},
            "setup": [
                {"name": "fine", "script": "echo first > done.txt; echo prepared"},
                {"name": "install", "script": "echo 'no such package' >&2; exit 3"},
                {"name": "never", "script": "echo unreachable > never.txt"},
            ],
        },
    )
    status = templates.wait_reason("broken", "Building")["status"]
    build = wait_for(
        lambda: (templates.get("broken") or {}).get("status", {}).get("buildSandbox"),
        20,
        "build sandbox",
    )
    assert build.startswith("broken-base-"), status
    pod_of(kube, ns, build)
    agent = agents(secret_token(kube, ns, build))
    node.run_pod(ns, build, agent.ip)
    sandboxes.create("of-broken", {"templateRef": {"name": "broken"}})

    body = templates.wait_reason("broken", "SetupFailed", timeout=60)
    cond = next(c for c in body["status"]["conditions"] if c["type"] == "Ready")
    assert cond["message"].startswith("step install (2/3) failed (exit code 3)"), cond
    log = body["status"]["buildLog"]
    assert "--- fine (Succeeded) ---\nprepared" in log, log
    assert "no such package" in log, log
    assert (agent.workspace / "done.txt").exists()
    assert not (agent.workspace / "never.txt").exists()
    # The build sandbox is removed; the failure stays until the setup changes.
    wait_for(lambda: sandboxes.get(build) is None, 30, "build sandbox deleted")

    # Held from the start (the build was queued); the message follows the build
    # within the Sandbox's retry delay.
    wait_for(
        lambda: (
            "step install (2/3) failed"
            in (sandboxes.condition("of-broken", "Ready") or {}).get("message", "")
        ),
        20,
        "the failed step named",
    )
    assert ready_reason(sandboxes, "of-broken") == "TemplateNotReady"
    assert kube.get(core_path("pods", ns, "of-broken")) is None

    # A fixed setup builds again (a new digest, a new build sandbox).
    templates.patch("broken", {"spec": {"setup": [{"name": "install", "script": "echo fixed"}]}})
    rebuilt = wait_for(
        lambda: (templates.get("broken") or {}).get("status", {}).get("buildSandbox"),
        20,
        "a new build sandbox",
    )
    assert rebuilt != build


def test_paused_timeout_deletes_only_after_a_snapshot(
    kube: KubeJSON, ns: str, sandboxes: Sandboxes
) -> None:
    """With snapshotOnIdle, pausedTimeout deletes once a Snapshot is Ready (the
    e2e tier's test_paused_timeout_deletes_after_its_snapshot); this tier has no
    snapshots, so the sandbox stays paused and says so, once."""
    sandboxes.create(
        "parked",
        {"paused": True, "lifecycle": {"pausedTimeout": "3s", "snapshotOnIdle": True}},
    )
    body = sandboxes.wait_phase("parked", "Paused")
    assert body["status"]["pausedDeadline"] > body["status"]["pausedSince"], body["status"]
    snapshots = Snapshots(kube, ns)

    def failed() -> list[str]:
        events = kube.list(core_path("events", ns))
        return [
            e["message"]
            for e in events
            if e.get("reason") == "IdleSnapshotFailed" and e["involvedObject"]["name"] == "parked"
        ]

    [message] = wait_for(failed, 60, "an IdleSnapshotFailed Event for parked")
    assert "kept paused instead of deleted after pausedTimeout 3s" in message, message
    taken = snapshots.kube.list(snapshots.path(), "sandbox.dev/sandbox=parked")
    assert [s["spec"]["sandboxRef"]["name"] for s in taken] == ["parked"], taken
    assert sandboxes.read("parked")["status"]["phase"] == "Paused"

    # Without snapshotOnIdle nothing is taken; a sandbox running is not counted.
    sandboxes.create("brief", {"paused": True, "lifecycle": {"pausedTimeout": "2s"}})
    sandboxes.create("running", {"lifecycle": {"pausedTimeout": "1s"}})
    sandboxes.wait_gone("brief", 60, "deleted after pausedTimeout")
    assert sandboxes.get("running") is not None
    assert (sandboxes.read("running").get("status") or {}).get("pausedDeadline") is None
