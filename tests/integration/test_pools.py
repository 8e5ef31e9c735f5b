"""SandboxPools against a real API server, with the node played by the test (pods
get a loopback IP; where commands run, a real agent serves them): fill, claim,
refill, scale, concurrent claims, an operator killed mid-claim, a member whose
pod died, a template change, claim-time env, and the conditions of bad input."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from devcluster.controlplane import ControlPlane
from sandbox_operator.bookkeeping import DIGEST_KEY
from sandbox_operator.resources import FINALIZER, KOPF_PREFIX
from tests.grants import audit_events, service_account, writes
from tests.integration.conftest import kubectl
from tests.integration.harness import (
    OPERATOR_NAMESPACE,
    AgentProcess,
    Node,
    OperatorProcess,
    next_pod_ip,
    secret_token,
    wait_for,
)
from tests.kube import JSON, ApiError, KubeJSON, core_path
from tests.pools import Kubelet, Pools, controller, members
from tests.sandboxes import Sandboxes
from tests.templates import Templates

TEMPLATE: JSON = {
    "description": "python, ephemeral",
    "sandbox": {"runtime": "python", "workspace": {"ephemeral": True}},
}


@pytest.fixture
def templates(kube: KubeJSON, ns: str) -> Templates:
    return Templates(kube, ns)


@pytest.fixture
def pools(kube: KubeJSON, ns: str) -> Pools:
    return Pools(kube, ns)


@pytest.fixture
def kubelet(kube: KubeJSON, ns: str, node: Node) -> Iterator[Kubelet]:
    """Runs every pod of the namespace (no agent behind it)."""

    def start(namespace: str, pod: str) -> str:
        ip = next_pod_ip()
        node.run_pod(namespace, pod, ip)
        return ip

    with Kubelet(kube, ns, start) as running:
        yield running


def pool_use(sandboxes: Sandboxes, name: str, timeout: float = 30) -> JSON:
    """status.pool once the Sandbox's pool outcome is decided."""
    body = sandboxes.wait_object(
        name, "a pool outcome", lambda s: bool((s.get("pool") or {}).get("outcome")), timeout
    )
    use: JSON = body["status"]["pool"]
    return use


def claimers_of(kube: KubeJSON, ns: str) -> dict[str, list[str]]:
    """Every Sandbox owned by another Sandbox (a claimed member), with its owners."""
    owned: dict[str, list[str]] = {}
    for body in kube.list(Sandboxes(kube, ns).path()):
        owners = [o["name"] for o in body["metadata"].get("ownerReferences") or []]
        if any(o.get("kind") == "Sandbox" for o in body["metadata"].get("ownerReferences") or []):
            owned[body["metadata"]["name"]] = owners
    return owned


def test_pool_fills_serves_a_claim_refills_and_scales(
    kube: KubeJSON,
    ns: str,
    running_operator: OperatorProcess,
    control_plane: ControlPlane,
    sandboxes: Sandboxes,
    templates: Templates,
    pools: Pools,
    kubelet: Kubelet,
) -> None:
    templates.create("py", TEMPLATE)
    pools.create("warm", {"templateRef": {"name": "py"}, "replicas": 3})
    filled = pools.wait_counts("warm", ready=3, replicas=3)
    ready = next(c for c in filled["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "PoolFull"), ready
    assert filled["status"]["selector"] == "sandbox.dev/pool=warm"
    waiting = {m["metadata"]["name"] for m in members(kube, ns, "warm")}
    assert len(waiting) == 3

    since = time.time()
    sandboxes.create("agent-1", {"poolRef": {"name": "warm"}})
    body = sandboxes.wait_ready("agent-1", timeout=20)
    use = body["status"]["pool"]
    assert use["outcome"] == "Claimed", use
    member = use["member"]
    assert member in waiting
    # The claimed member serves it: its pod, its endpoint, its workspace.
    assert body["status"]["podName"] == member
    claimed = sandboxes.read(member)
    owner = controller(claimed)
    assert owner is not None
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "Sandbox",
        "agent-1",
        body["metadata"]["uid"],
    )
    assert "sandbox.dev/pool" not in (claimed["metadata"].get("labels") or {})

    # The claim converged the claimer: Kopf's finalizer and diff base arrive in
    # one patch, and no creation handler runs after it (no more writes).
    def finalized() -> JSON | None:
        body = sandboxes.read("agent-1")
        return body if body["metadata"].get("finalizers") else None

    marked = wait_for(finalized, 20, "Kopf's finalizer on agent-1")
    until = time.time()
    assert marked["metadata"]["finalizers"] == [FINALIZER]
    assert f"{KOPF_PREFIX}/{DIGEST_KEY}" in marked["metadata"]["annotations"]
    # Three writes, none refused: the claim, the finalizer with the diff base
    # (tested against agent-1's resourceVersion as it arrived), then the status.
    operator = service_account(OPERATOR_NAMESPACE, "sandbox-operator")

    def claim_writes() -> list[str]:
        events = audit_events(control_plane.audit_logs)
        return writes(events, operator, ns, ("agent-1", member), since, until)

    wait_for(lambda: len(claim_writes()) >= 3, 10, "the claim's writes in the audit log")
    found = claim_writes()
    # The claim and the claimer's finalizer go at the same time, in either order.
    together = sorted([f"patch sandboxes {member} 200", "patch sandboxes agent-1 200"])
    assert sorted(found[:2]) == together, found
    assert found[2:] == ["patch sandboxes/status agent-1 200"], found
    # The event handler claimed (Kopf's per-event success lines are not logged:
    # its metric counts it), and Kopf ran no creation handler for agent-1.
    claims = 'sandbox_operator_reconciles_total{kind="Sandbox",result="ok",trigger="claim"}'
    assert any(
        line.startswith(claims) and float(line.split()[-1]) >= 1
        for line in running_operator.metrics().splitlines()
    )
    handled = [line for line in running_operator.log_lines() if f"[{ns}/agent-1]" in line]
    assert not any("Creation is processed" in line for line in handled), handled
    assert not any("sandbox_changed" in line for line in handled), handled

    # The pool makes a new member in its place; the claimed one never comes back.
    refilled = pools.wait_counts("warm", ready=3, replicas=3)
    assert refilled["status"]["claimed"] == 1
    assert member not in {m["metadata"]["name"] for m in members(kube, ns, "warm")}

    # `kubectl scale` through the scale subresource.
    scaled = kubectl(control_plane, "-n", ns, "scale", "sandboxpool/warm", "--replicas=1")
    assert scaled.returncode == 0, scaled.stderr
    pools.wait_counts("warm", ready=1, replicas=1)
    wait_for(lambda: len(members(kube, ns, "warm")) == 1, 30, "surplus members deleted")
    listed = kubectl(control_plane, "-n", ns, "get", "sandboxpools")
    assert "warm" in listed.stdout, listed.stdout
    assert "PoolFull" in listed.stdout, listed.stdout

    # Deleting the claimer takes its member with it (owner reference), not the pool's.
    sandboxes.delete("agent-1")
    wait_for(lambda: sandboxes.get(member) is None, 60, f"member {member} deleted")
    assert len(members(kube, ns, "warm")) == 1
    wait_for(
        lambda: pools.read("warm")["status"].get("claimed") == 0, 10, "the pool's claimed count 0"
    )


def test_fifty_concurrent_claims_on_a_pool_of_twenty(
    kube: KubeJSON,
    ns: str,
    sandboxes: Sandboxes,
    templates: Templates,
    pools: Pools,
    control_plane: ControlPlane,
    kubelet: Kubelet,
) -> None:
    templates.create("py", TEMPLATE)
    pools.create("warm", {"templateRef": {"name": "py"}, "replicas": 20, "maxCreating": 20})
    pools.wait_counts("warm", ready=20, replicas=20, timeout=120)
    # New members do not get ready during the burst: the 30 that find no ready
    # member must start cold.
    kubelet.paused.set()
    names = [f"burst-{i:02d}" for i in range(50)]

    def create(names: list[str]) -> None:
        # A client per thread (as in test_quotas): one shared client's TLS
        # handshakes, started from ten threads at once, fail now and then under
        # load (alert decode error, CI run 19).
        with KubeJSON(control_plane.kubeconfig) as own:
            for name in names:
                Sandboxes(own, sandboxes.namespace).create(name, {"poolRef": {"name": "warm"}})

    with ThreadPoolExecutor(max_workers=10) as pool:
        list(pool.map(create, [names[i::10] for i in range(10)]))
    uses = {n: pool_use(sandboxes, n, timeout=120) for n in names}
    claimed = {n: u["member"] for n, u in uses.items() if u["outcome"] == "Claimed"}
    cold = [n for n, u in uses.items() if u["outcome"] == "ColdStart"]
    assert len(claimed) == 20, uses
    assert len(cold) == 30, uses
    assert len(set(claimed.values())) == 20, "a member was claimed twice"
    owners = claimers_of(kube, ns)
    for sandbox, member in claimed.items():
        assert owners[member] == [sandbox], (member, owners[member])
    assert len(owners) == 20
    for name in cold:
        assert "no ready member" in uses[name]["message"], uses[name]

    # One Event per cold start, on the Sandbox and on the pool, however many
    # passes saw it (two did: the arrival and the creation handler).
    def cold_events() -> list[JSON] | None:
        # Posted in the background: wait for both kinds of each cold start.
        events = kube.list(core_path("events", ns))
        kinds = [e for e in events if e.get("reason") in ("PoolColdStart", "ColdStart")]
        return events if len(kinds) >= 2 * len(cold) else None

    events = wait_for(cold_events, 30, "an Event for each cold start")
    time.sleep(2)  # a duplicate would come as soon as the first
    events = kube.list(core_path("events", ns))
    announced = [e for e in events if e.get("reason") == "PoolColdStart"]
    assert sorted(e["involvedObject"]["name"] for e in announced) == sorted(cold)
    assert {e.get("count", 1) for e in announced} == {1}, announced
    on_pool = [e for e in events if e.get("reason") == "ColdStart"]
    assert sorted(e["message"].split(":")[0] for e in on_pool) == sorted(cold)
    kubelet.paused.clear()
    for name in names:
        sandboxes.wait_ready(name, timeout=120)


def test_operator_killed_in_the_middle_of_claims(
    kube: KubeJSON,
    ns: str,
    sandboxes: Sandboxes,
    templates: Templates,
    pools: Pools,
    kubelet: Kubelet,
    running_operator: OperatorProcess,
) -> None:
    templates.create("py", TEMPLATE)
    pools.create("warm", {"templateRef": {"name": "py"}, "replicas": 10, "maxCreating": 10})
    pools.wait_counts("warm", ready=10, replicas=10, timeout=90)
    kubelet.paused.set()  # refilled members stay unready: only the first ten can be claimed
    names = [f"claim-{i}" for i in range(10)]
    with ThreadPoolExecutor(max_workers=10) as pool:
        list(pool.map(lambda n: sandboxes.create(n, {"poolRef": {"name": "warm"}}), names))
    # Some claims are done, some not started: the operator dies with them in flight.
    wait_for(lambda: claimers_of(kube, ns), 30, "a first claim", interval=0.01)
    running_operator.kill()
    before = claimers_of(kube, ns)
    running_operator.start()
    uses = {n: pool_use(sandboxes, n, timeout=60) for n in names}
    owners = claimers_of(kube, ns)
    claimed = {n: u["member"] for n, u in uses.items() if u["outcome"] == "Claimed"}
    # Every member claimed before the kill still serves the Sandbox that claimed it.
    for member, owner in before.items():
        assert owners[member] == owner
        assert claimed[owner[0]] == member, (owner, uses[owner[0]])
    # No member has two claimers; no claimed member is unaccounted for.
    assert len(set(claimed.values())) == len(claimed)
    assert {m: [s] for s, m in claimed.items()} == owners
    assert len(claimed) == 10, uses
    kubelet.paused.clear()
    for name in names:
        sandboxes.wait_ready(name, timeout=60)


def test_an_empty_pool_that_waits_then_serves(
    ns: str, sandboxes: Sandboxes, templates: Templates, pools: Pools, kubelet: Kubelet
) -> None:
    templates.create("py", TEMPLATE)
    # Named before the pool exists: it waits for the pool, then for a member, and its
    # status says which at each step.
    sandboxes.create("patient", {"poolRef": {"name": "slow"}})
    sandboxes.wait_object(
        "patient",
        "waiting for the pool to exist",
        lambda s: any(c.get("reason") == "PoolNotFound" for c in s.get("conditions", [])),
    )
    # Marked handled beside the claim it tried; no claim happened, so the mark
    # is taken back and the change handlers retry (not only the timer).
    digest = f"{KOPF_PREFIX}/{DIGEST_KEY}"
    wait_for(
        lambda: digest not in (sandboxes.read("patient")["metadata"].get("annotations") or {}),
        10,
        "the claim handler's mark taken back",
    )
    pools.create("slow", {"templateRef": {"name": "py"}, "replicas": 0, "whenEmpty": "Wait"})
    body = sandboxes.wait_object(
        "patient",
        "waiting for the pool",
        lambda s: any(c.get("reason") == "PoolEmpty" for c in s.get("conditions", [])),
    )
    assert body["status"]["pool"]["outcome"] == "Waiting"
    assert sandboxes.get("patient-workspace") is None
    assert not [p for p in [sandboxes.kube.get(core_path("pods", ns, "patient"))] if p]
    pools.patch("slow", {"spec": {"replicas": 1}})
    ready = sandboxes.wait_ready("patient", timeout=30)
    assert ready["status"]["pool"]["outcome"] == "Claimed"


def test_a_claim_skips_a_member_whose_pod_died(
    kube: KubeJSON,
    ns: str,
    sandboxes: Sandboxes,
    templates: Templates,
    pools: Pools,
    kubelet: Kubelet,
) -> None:
    templates.create("py", TEMPLATE)
    pools.create("warm", {"templateRef": {"name": "py"}, "replicas": 2})
    pools.wait_counts("warm", ready=2)
    oldest = sorted(
        members(kube, ns, "warm"),
        key=lambda m: (m["metadata"]["creationTimestamp"], m["metadata"]["name"]),
    )[0]["metadata"]["name"]
    # The node stops running new pods, and the oldest member's pod dies: its
    # Sandbox makes a new pod that stays Pending.
    kubelet.paused.set()
    kube.delete(core_path("pods", ns, oldest))
    wait_for(
        lambda: (
            (kube.get(core_path("pods", ns, oldest)) or {}).get("status", {}).get("phase")
            in (None, "Pending")
        ),
        20,
        "the replacement pod",
    )
    sandboxes.create("lucky", {"poolRef": {"name": "warm"}})
    use = pool_use(sandboxes, "lucky")
    assert use["outcome"] == "Claimed"
    assert use["member"] != oldest
    kubelet.paused.clear()
    sandboxes.wait_ready("lucky", timeout=20)


def test_template_change_rolls_waiting_members(
    kube: KubeJSON,
    ns: str,
    sandboxes: Sandboxes,
    templates: Templates,
    pools: Pools,
    kubelet: Kubelet,
) -> None:
    templates.create("py", TEMPLATE)
    pools.create("warm", {"templateRef": {"name": "py"}, "replicas": 2})
    pools.wait_counts("warm", ready=2)
    old = {m["metadata"]["name"] for m in members(kube, ns, "warm")}
    templates.patch("py", {"spec": {"sandbox": {"env": [{"name": "V", "value": "2"}]}}})

    def rolled() -> bool:
        now = {m["metadata"]["name"] for m in members(kube, ns, "warm")}
        return len(now) == 2 and not (now & old)

    wait_for(rolled, 60, "members of the new template generation")
    pools.wait_counts("warm", ready=2, replicas=2)
    sandboxes.create("fresh", {"poolRef": {"name": "warm"}})
    use = pool_use(sandboxes, "fresh")
    assert use["outcome"] == "Claimed"
    pod = kube.read(core_path("pods", ns, use["member"]))
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env", [])}
    assert env.get("V") == "2"


def test_claim_time_env_and_files_reach_the_member_before_ready(
    kube: KubeJSON,
    ns: str,
    node: Node,
    sandboxes: Sandboxes,
    templates: Templates,
    pools: Pools,
    agents: Callable[[str], AgentProcess],
) -> None:
    by_pod: dict[str, AgentProcess] = {}

    def start(namespace: str, pod: str) -> str:
        agent = agents(secret_token(kube, namespace, pod))
        by_pod[pod] = agent
        node.run_pod(namespace, pod, agent.ip)
        return agent.ip

    templates.create("py", TEMPLATE)
    with Kubelet(kube, ns, start):
        pools.create("warm", {"templateRef": {"name": "py"}, "replicas": 1})
        pools.wait_counts("warm", ready=1, timeout=60)
        sandboxes.create(
            "tuned",
            {
                "poolRef": {"name": "warm"},
                "env": [{"name": "GREETING", "value": "claimed"}],
                "files": [
                    {"path": "task/prompt.md", "content": "# turn 1\n"},
                    {"path": "run.sh", "content": "echo hi\n", "mode": 0o750},
                ],
            },
        )
        body = sandboxes.wait_ready("tuned", timeout=20)
    use = body["status"]["pool"]
    assert use["outcome"] == "Claimed"
    # Ready means the member's agent already holds the env and the files (no
    # second look needed).
    member = by_pod[use["member"]]
    current = member.call("GET", "/v1/environment")
    assert current["env"] == {"GREETING": "claimed"}, current
    assert (member.workspace / "task/prompt.md").read_text() == "# turn 1\n"
    assert (member.workspace / "run.sh").stat().st_mode & 0o777 == 0o750
    assert body["status"]["filesWritten"]


def test_what_a_pool_cannot_do_is_named(
    ns: str,
    sandboxes: Sandboxes,
    templates: Templates,
    pools: Pools,
    node: Node,
    kube: KubeJSON,
) -> None:
    sandboxes.create("orphan", {"poolRef": {"name": "nope"}})
    body = sandboxes.wait_object(
        "orphan",
        "PoolNotFound",
        lambda s: any(c.get("reason") == "PoolNotFound" for c in s.get("conditions", [])),
    )
    ready = next(c for c in body["status"]["conditions"] if c["type"] == "Ready")
    assert "SandboxPool nope does not exist" in ready["message"]

    pools.create("lost", {"templateRef": {"name": "missing"}, "replicas": 1})
    cond = pools.wait_reason("lost", "TemplateNotFound")
    assert "missing" in str(cond["status"]["conditions"])

    # A template no Sandbox of which can run here says so itself, and its pool
    # makes no members (each would only fail the same way).
    templates.create("cobol", {"sandbox": {"runtime": "cobol"}})
    invalid = templates.wait_reason("cobol", "InvalidSpec", timeout=30)
    message = next(c for c in invalid["status"]["conditions"] if c["type"] == "Ready")["message"]
    assert message.startswith("spec.sandbox.runtime: unknown runtime 'cobol'"), message
    pools.create("cobol", {"templateRef": {"name": "cobol"}, "replicas": 2})
    cond = pools.wait_reason("cobol", "TemplateInvalid")
    assert "unknown runtime 'cobol'" in str(cond["status"]["conditions"])
    assert members(kube, ns, "cobol") == []

    # A template whose image has no python3: its member's runtime cannot start.
    templates.create("bare", {"sandbox": {"image": "busybox:1", "workspace": {"ephemeral": True}}})
    pools.create("bare", {"templateRef": {"name": "bare"}, "replicas": 1})
    member = wait_for(lambda: members(kube, ns, "bare"), 30, "a member")[0]["metadata"]["name"]
    wait_for(lambda: kube.get(core_path("pods", ns, member)), 20, "its pod")
    node.crash_runtime(ns, member, 'exec: "python3": executable file not found in $PATH')
    failed = pools.wait_reason("bare", "TemplateWithoutPython")
    message = next(c for c in failed["status"]["conditions"] if c["type"] == "Ready")["message"]
    assert "python3" in message, message
    assert "bare" in message, message

    # A Sandbox asking for what only a new pod gives starts cold, and says why.
    templates.create("py", TEMPLATE)
    pools.create("warm", {"templateRef": {"name": "py"}, "replicas": 1})
    member = wait_for(lambda: members(kube, ns, "warm"), 30, "a member")[0]["metadata"]["name"]
    wait_for(lambda: kube.get(core_path("pods", ns, member)), 20, "its pod")
    node.run_pod(ns, member, next_pod_ip())
    pools.wait_counts("warm", ready=1)
    sandboxes.create("big", {"poolRef": {"name": "warm"}, "resources": {"memory": "2Gi"}})
    use = pool_use(sandboxes, "big")
    assert use["outcome"] == "ColdStart"
    assert "spec.resources differs" in use["message"], use
    with pytest.raises(ApiError) as refused:
        sandboxes.create("both", {"poolRef": {"name": "warm"}, "templateRef": {"name": "py"}})
    assert "at most one of poolRef or templateRef" in str(refused.value)
    sandboxes.create("fixed", {"poolRef": {"name": "warm"}})
    with pytest.raises(ApiError) as immutable:
        sandboxes.patch("fixed", {"spec": {"poolRef": {"name": "other"}}})
    assert "poolRef is immutable" in str(immutable.value)


def test_a_template_default_pool(
    ns: str, sandboxes: Sandboxes, templates: Templates, pools: Pools, kubelet: Kubelet
) -> None:
    templates.create("py", {**TEMPLATE, "defaultPool": "py-warm"})
    pools.create("py-warm", {"templateRef": {"name": "py"}, "replicas": 1})
    pools.wait_counts("py-warm", ready=1)
    sandboxes.create("by-template", {"templateRef": {"name": "py"}})
    use = pool_use(sandboxes, "by-template")
    assert use["outcome"] == "Claimed", use
    sandboxes.wait_ready("by-template", timeout=20)
    # A template whose default pool this namespace lacks starts cold, as if it had none.
    templates.create("lonely", {**TEMPLATE, "defaultPool": "absent"})
    sandboxes.create("cold", {"templateRef": {"name": "lonely"}})
    body = sandboxes.wait_ready("cold", timeout=20)
    assert "pool" not in body["status"]


def test_pool_members_are_paced(
    ns: str, kube: KubeJSON, templates: Templates, pools: Pools
) -> None:
    """No node: members never get ready, so no more than maxCreating exist."""
    templates.create("py", TEMPLATE)
    pools.create("paced", {"templateRef": {"name": "py"}, "replicas": 10, "maxCreating": 3})
    pools.wait_object("paced", "3 creating", lambda s: s.get("creating") == 3)
    time.sleep(2)
    assert len(members(kube, ns, "paced")) == 3


def test_a_cold_start_its_stopped_operator_decided_is_announced_by_the_next(
    kube: KubeJSON,
    ns: str,
    sandboxes: Sandboxes,
    templates: Templates,
    pools: Pools,
    running_operator: OperatorProcess,
) -> None:
    """An operator that recorded a cold start and stopped before its Event went
    out (Events are posted in the background): the next one posts it, once."""
    templates.create("py", TEMPLATE)
    pools.create("empty", {"templateRef": {"name": "py"}, "replicas": 0})
    message = "SandboxPool empty had no ready member: starting a new pod"
    running_operator.kill()
    try:
        sandboxes.create("late", {"poolRef": {"name": "empty"}})
        use = {
            "name": "empty",
            "outcome": "ColdStart",
            "templateRef": {"kind": "SandboxTemplate", "name": "py"},
            "message": message,
        }
        kube.patch(sandboxes.path("late") + "/status", {"status": {"pool": use}})
    finally:
        running_operator.start()

    def announced() -> list[JSON]:
        return [
            e
            for e in kube.list(core_path("events", ns))
            if e.get("reason") == "PoolColdStart" and e["involvedObject"]["name"] == "late"
        ]

    events = wait_for(announced, 60, "the PoolColdStart Event")
    assert events[0]["message"] == message
    assert events[0].get("count", 1) == 1
