"""One sandbox's code against the node's limits: what it meets, and that the agent,
the node and a neighbouring sandbox do not notice."""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import httpx
import pytest

from devcluster.cluster import POD_PIDS_LIMIT
from tests.e2e.agent import Agent
from tests.e2e.conftest import E2E
from tests.integration.harness import wait_for
from tests.kube import JSON, core_path
from tests.sandboxes import Sandboxes

pytestmark = pytest.mark.timeout(900)

# A fork bomb bounded in time: every process forks as fast as it can until the
# kernel refuses, for BOMB_SECONDS, then all exit. The first process reports how
# many children it made and what refused the next one.
BOMB_SECONDS = 24
BOMB = f"""
import errno, json, os, time
deadline = time.time() + {BOMB_SECONDS}
made, refused = 0, None
first = os.getpid()
while time.time() < deadline:
    try:
        pid = os.fork()
    except OSError as error:
        if os.getpid() == first and refused is None:
            refused = errno.errorcode.get(error.errno, str(error.errno))
            print(json.dumps({{"made": made, "refused": refused}}), flush=True)
        time.sleep(0.05)
        continue
    if pid == 0:
        made = 0
    elif os.getpid() == first:
        made += 1
if os.getpid() != first:
    os._exit(0)
"""


def _node_ready(e2e: E2E) -> bool:
    node = e2e.kube.read(core_path("nodes", name=e2e.cluster.node_name))
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    return bool(ready["status"] == "True")


def _events(cgroup: Path) -> dict[str, str]:
    return dict(line.split() for line in (cgroup / "pids.events").read_text().splitlines())


def _restarts(pod: JSON) -> dict[str, int]:
    return {s["name"]: s.get("restartCount", 0) for s in pod["status"]["containerStatuses"]}


def _container_cgroup(e2e: E2E, pod: JSON, controller: str, container: str) -> Path:
    status = next(s for s in pod["status"]["containerStatuses"] if s["name"] == container)
    container_id = str(status["containerID"]).split("://", 1)[1]
    return e2e.cluster.pod_cgroup(controller, pod["metadata"]["uid"]) / container_id


def test_a_fork_bomb_meets_the_pid_limit_and_nobody_else_notices(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    dense = {"resources": {"profile": "dense"}}
    for name in ("bomb", "neighbour"):
        sandboxes.create(name, dense)
    for name in ("bomb", "neighbour"):
        sandboxes.wait_ready(name)
    bomb, neighbour = Agent.of(e2e.kube, ns, "bomb"), Agent.of(e2e.kube, ns, "neighbour")
    before = {n: _restarts(e2e.kube.read(core_path("pods", ns, n))) for n in ("bomb", "neighbour")}

    started = bomb.start(f"python3 -c '{BOMB}'")
    pids = e2e.cluster.pod_cgroup(
        "pids", e2e.kube.read(core_path("pods", ns, "bomb"))["metadata"]["uid"]
    )
    # Until every PID of the pod is taken: how fast depends on the node's load, so
    # the peak is watched for (most of the bomb's span) rather than read once.
    in_use, watch_until = 0, time.monotonic() + BOMB_SECONDS * 2 / 3
    while in_use < POD_PIDS_LIMIT - 16 and time.monotonic() < watch_until:
        in_use = max(in_use, int((pids / "pids.current").read_text()))
        time.sleep(0.1)
    next_door = neighbour.run(["echo", "next door"], timeoutSeconds=10)
    node_ready = _node_ready(e2e)
    # The bomb's own agent still answers (it forks nothing to answer): a command
    # it cannot start is an error reply, not a hang.
    try:
        reply = bomb.post("/v1/executions", {"argv": ["true"], "timeoutSeconds": 5}, timeout=30)
        record = reply.json()
        answer = f"{reply.status_code} {record.get('status')}: {record.get('error')}"
    except httpx.HTTPError as error:
        answer = f"no answer: {error!r}"
    print(
        f"\nduring the fork bomb: pod pids.current {in_use}; neighbour {next_door};"
        f" node ready {node_ready}; the bomb's agent: {answer}"
    )
    assert in_use >= POD_PIDS_LIMIT - 16, in_use
    assert (next_door["exitCode"], next_door["stdout"]) == (0, "next door\n"), next_door
    assert node_ready
    assert not answer.startswith("no answer"), answer

    def finished() -> JSON | None:
        record = bomb.execution(started["id"])
        return record if record["status"] != "running" else None

    record = wait_for(finished, BOMB_SECONDS + 60, "the fork bomb's end")
    report = json.loads(record["stdout"].splitlines()[0])
    print(f"fork bomb: {report}, execution {record['status']} exit {record.get('exitCode')}")
    assert report["refused"] == "EAGAIN", report
    # Refused by the pod's PID limit: this kernel counts a refusal in pids.events
    # of the cgroup the fork came from (the container's), not the limit's.
    refused = {
        str(cgroup.relative_to(pids)): int(_events(cgroup)["max"])
        for cgroup in [pids, *(d.parent for d in pids.rglob("pids.events"))]
    }
    assert sum(refused.values()) > 0, refused

    # Afterwards: the agent runs commands again, nothing restarted, the node is Ready.
    wait_for(lambda: bomb.run(["echo", "after"], timeoutSeconds=10)["exitCode"] == 0, 60, "exec")
    for name in ("bomb", "neighbour"):
        assert _restarts(e2e.kube.read(core_path("pods", ns, name))) == before[name], name
        # Ready again: the bomb's pod may have missed a readiness probe while every
        # PID was taken, and the kubelet says it is ready at its next probe.
        wait_for(partial(_ready, sandboxes, name), 60, f"{name} Ready again")
    assert _node_ready(e2e)


def _ready(sandboxes: Sandboxes, name: str) -> bool:
    condition = sandboxes.condition(name, "Ready") or {}
    if condition.get("status") != "True":
        print(f"{name} Ready: {condition}")  # the last one is in the failure's output
    return condition.get("status") == "True"


def test_a_cpu_limit_throttles_and_the_counters_say_so(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    spec = {"resources": {"profile": "dense", "cpu": "200m"}}
    sandboxes.create("busy", spec)
    sandboxes.wait_ready("busy")
    agent = Agent.of(e2e.kube, ns, "busy")
    pod = e2e.kube.read(core_path("pods", ns, "busy"))
    stat = _container_cgroup(e2e, pod, "cpu", "sandbox") / "cpu.stat"

    def counters() -> dict[str, int]:
        return {k: int(v) for k, v in (line.split() for line in stat.read_text().splitlines())}

    before = counters()
    # Four processes spin for 3 s of wall time: at most 0.2 CPU between them.
    spin = (
        "import multiprocessing as m, time\n"
        "def spin():\n"
        "    end = time.time() + 3\n"
        "    while time.time() < end: pass\n"
        "ps = [m.Process(target=spin) for _ in range(4)]\n"
        "[p.start() for p in ps]; [p.join() for p in ps]\n"
        "import resource; u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "print(u.ru_utime + u.ru_stime)\n"
    )
    result = agent.run(["python3", "-c", spin], timeoutSeconds=60)
    assert result["exitCode"] == 0, result
    used = float(result["stdout"].strip())
    after = counters()
    print(
        f"\n4 spinners for 3 s under a 200m limit: {used:.2f} CPU-s; cpu.stat {before} -> {after}"
    )
    assert used < 1.5, f"{used} CPU-seconds in 3 s: the 200m limit did not hold"
    assert after["nr_throttled"] > before["nr_throttled"], (before, after)
    assert after["throttled_time"] > before["throttled_time"], (before, after)


# Takes every PID the pod has left with sleeping threads, lets them go, and
# again, for `seconds`: refused forks without a CPU-eating bomb.
PID_HOG = """
import threading, time
end = time.time() + {seconds}
while time.time() < end:
    release = threading.Event()
    held = []
    try:
        while len(held) < 100000:
            t = threading.Thread(target=release.wait, daemon=True)
            t.start()
            held.append(t)
    except RuntimeError:
        pass
    release.set()
    for t in held:
        t.join()
    time.sleep(2)
"""
SPIN = """
import multiprocessing as m, time
end = time.time() + {seconds}
def spin():
    while time.time() < end:
        pass
ps = [m.Process(target=spin) for _ in range(2)]
[p.start() for p in ps]
[p.join() for p in ps]
"""


def test_pid_and_cpu_limits_show_in_status_and_events(e2e: E2E) -> None:
    """The operator reads the sandbox container's counters through the agent on
    each periodic pass: PidLimitReached and CpuThrottled come while a limit
    bites and go after it, each with Events."""
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("pressed", {"resources": {"profile": "dense", "cpu": "200m"}})
    sandboxes.wait_ready("pressed")
    agent = Agent.of(e2e.kube, ns, "pressed")
    # Long enough for two passes that compare counters (at least 10 s apart): a
    # baseline and a change.
    # The spinners first: once the hog holds the PIDs, nothing new starts.
    spin = agent.start(f"python3 -c '{SPIN.format(seconds=100)}'")
    time.sleep(1)
    hog = agent.start(f"python3 -c '{PID_HOG.format(seconds=100)}'")

    def both() -> tuple[JSON, JSON] | None:
        pids = sandboxes.condition("pressed", "PidLimitReached")
        cpu = sandboxes.condition("pressed", "CpuThrottled")
        return (pids, cpu) if pids and cpu else None

    pids, cpu = wait_for(both, 100, "PidLimitReached and CpuThrottled")
    assert (pids["status"], pids["reason"]) == ("True", "ForkRefused"), pids
    assert (cpu["status"], cpu["reason"]) == ("True", "CpuLimit"), cpu
    assert "200m" in cpu["message"], cpu
    # Events are posted in the background, after the status patch that shows the
    # condition: wait for them as for the conditions.
    refused = _wait_event(e2e, ns, "pressed", "PidLimitReached")
    throttled = _wait_event(e2e, ns, "pressed", "CpuThrottled")
    assert refused["type"] == "Warning", refused
    assert "refused by the pod's PID limit" in refused["message"], refused
    assert "CPU periods" in throttled["message"], throttled
    assert (sandboxes.condition("pressed", "Ready") or {}).get("status") == "True"

    for started in (hog, spin):
        agent.post(f"/v1/executions/{started['id']}/cancel", {})
    wait_for(
        lambda: (
            not sandboxes.condition("pressed", "PidLimitReached")
            and not sandboxes.condition("pressed", "CpuThrottled")
        ),
        100,
        "both conditions gone once the limits stop biting",
    )
    _wait_event(e2e, ns, "pressed", "CpuThrottleEnded")


def _wait_event(e2e: E2E, ns: str, name: str, reason: str) -> JSON:
    found: JSON = wait_for(
        lambda: _sandbox_event(e2e, ns, name, reason), 30, f"the {reason} Event on {name}"
    )
    return found


def _sandbox_event(e2e: E2E, ns: str, name: str, reason: str) -> JSON | None:
    selector = f"involvedObject.kind=Sandbox,involvedObject.name={name},reason={reason}"
    listed = e2e.kube.get(core_path("events", ns) + f"?fieldSelector={selector}") or {}
    items: list[JSON] = listed.get("items") or []
    return items[0] if items else None


def test_a_full_workspace_says_enospc_and_the_sandbox_stays_ready(e2e: E2E) -> None:
    """The workspace is a filesystem of spec.workspace.size (the local CSI driver
    enforces it like a block-backed one): filling it fails the writer with
    ENOSPC, the agent answers a file write with its no_space error, the Sandbox
    stays Ready and says WorkspaceFull (condition and Event) until space is freed."""
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("full", {"resources": {"profile": "dense"}, "workspace": {"size": "64Mi"}})
    sandboxes.wait_ready("full")
    agent = Agent.of(e2e.kube, ns, "full")
    restarts = _restarts(e2e.kube.read(core_path("pods", ns, "full")))

    df = agent.run(["df", "-P", "-k", "."], timeoutSeconds=10)
    total_kib = int(df["stdout"].splitlines()[1].split()[1])
    assert 48 * 1024 <= total_kib <= 64 * 1024, df["stdout"]

    fill = agent.run(shell="head -c 200M /dev/zero > fill.bin", timeoutSeconds=60)
    print(f"\nfilling a 64Mi workspace: exit {fill['exitCode']}, {fill['stderr'].strip()}")
    assert fill["exitCode"] != 0, fill
    assert "No space left on device" in fill["stderr"], fill
    reply = agent.post("/v1/files/write", {"path": "more.txt", "content": "x" * 65536})
    print(f"a file write into the full workspace: {reply.status_code} {reply.text}")
    assert reply.status_code == 507, reply.text
    assert reply.json()["error"]["code"] == "no_space", reply.text

    def full() -> JSON | None:
        cond = sandboxes.condition("full", "WorkspaceFull")
        return cond if cond and cond["status"] == "True" else None

    # The operator asks the agent on its periodic pass (30 s by default, 5 s here).
    cond = wait_for(full, 120, "WorkspaceFull on the Sandbox")
    assert cond["reason"] == "NoSpaceLeft", cond
    warning = _wait_event(e2e, ns, "full", "WorkspaceFull")
    assert warning["type"] == "Warning", warning
    print(f"condition: {cond['message']}; Event: {warning['type']} {warning['message']}")
    assert (sandboxes.condition("full", "Ready") or {}).get("status") == "True"
    assert agent.run(["echo", "still here"], timeoutSeconds=10)["exitCode"] == 0

    assert agent.run(["rm", "fill.bin"], timeoutSeconds=10)["exitCode"] == 0
    wait_for(
        lambda: sandboxes.condition("full", "WorkspaceFull") is None, 120, "WorkspaceFull gone"
    )
    freed = _wait_event(e2e, ns, "full", "WorkspaceSpaceFreed")
    print(f"after rm: Event {freed['reason']}: {freed['message']}")
    agent.write("more.txt", "fits again\n")
    assert _restarts(e2e.kube.read(core_path("pods", ns, "full"))) == restarts
    assert (sandboxes.condition("full", "Ready") or {}).get("status") == "True"
