"""Code inside a real sandbox pod attacks its own agent: a pipelining flood over
the pod's loopback, a directory swapped for a symlink to the agent's own files
while the agent searches, and connections held before auth. The agent stays
up (never restarted by its probes), inside its memory limit, the operator's
Executions get through, and nothing outside the workspace is ever returned."""

from __future__ import annotations

import json
import time
from urllib.parse import urlsplit

import pytest

from tests.e2e.agent import Agent
from tests.e2e.conftest import E2E
from tests.executions import Executions
from tests.kube import KubeJSON, core_path
from tests.sandboxes import Sandboxes

pytestmark = pytest.mark.timeout(900)

# Run inside the sandbox container (python3 is the runner's requirement).
FLOOD = """
import json, socket, sys, time
port = int(sys.argv[1])
req = b"GET /v1/info HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n"
batch = req * 1000
total = 0
for _ in range(4):
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(2.0)
    sent = 0
    try:
        while sent < len(req) * 150000:
            sent += s.send(batch[sent % len(batch):])
    except (TimeoutError, OSError):
        pass
    total += sent // len(req)
print(json.dumps({"accepted": total}))
"""

# Connections without the token that announce a body and trickle it, as many
# as the agent's cap and more, held for `seconds`.
HOLD = """
import socket, sys, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
held = []
for _ in range(140):
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"PUT /v1/files/content?path=x HTTP/1.1\\r\\nHost: x\\r\\n"
                  b"Content-Length: 100000000\\r\\n\\r\\n" + b"y" * 100)
        held.append(s)
    except OSError:
        pass
end = time.monotonic() + seconds
while time.monotonic() < end:
    for i, s in enumerate(held):
        try:
            s.send(b"y")
        except OSError:  # closed by the agent: open another
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"PUT /v1/files/content?path=x HTTP/1.1\\r\\nHost: x\\r\\n"
                          b"Content-Length: 100000000\\r\\n\\r\\n")
                held[i] = s
            except OSError:
                pass
    time.sleep(0.2)
print(len(held))
"""

SWAP = """
import os, shutil, sys, time
os.chdir(sys.argv[1])
end = time.monotonic() + 120
while time.monotonic() < end:
    try:
        os.mkdir("d.new")
        with open("d.new/f.txt", "w") as f:
            f.write("inside\\n")
        os.rename("d.new", "d.tmp")
        if os.path.islink("d"):
            os.unlink("d")
        os.rename("d.tmp", "d")
        os.symlink(sys.argv[2], "l.tmp")
        shutil.rmtree("d")
        os.rename("l.tmp", "d")
    except OSError:
        for junk in ("d.new", "d.tmp", "l.tmp"):
            if os.path.islink(junk):
                os.unlink(junk)
            elif os.path.isdir(junk):
                shutil.rmtree(junk, ignore_errors=True)
"""


def _agent_container(kube: KubeJSON, ns: str, pod: str) -> dict[str, object]:
    body = kube.read(core_path("pods", ns, pod))
    statuses = body["status"].get("containerStatuses") or []
    return next(s for s in statuses if s["name"] == "agent")


def _rss(agent: Agent) -> float:
    r = agent._http.get("/metrics")
    assert r.status_code == 200, r.text
    for line in r.text.splitlines():
        if line.startswith("process_resident_memory_bytes "):
            return float(line.split()[1])
    raise AssertionError("no process_resident_memory_bytes in /metrics")


def test_the_agent_survives_its_own_sandbox(e2e: E2E) -> None:
    ns = e2e.namespace()
    sandboxes = Sandboxes(e2e.kube, ns)
    sandboxes.create("target", {"workspace": {"ephemeral": True}})
    body = sandboxes.wait_ready("target")
    agent = Agent.of(e2e.kube, ns, "target")
    port = urlsplit(body["status"]["agentEndpoint"]).port or 8080
    token = agent._http.headers["Authorization"].split(" ", 1)[1]
    limit = 256 << 20

    # 1. The pipelining flood, from inside the pod, unauthenticated.
    agent.write("flood.py", FLOOD)
    flood = agent.run(shell=f"python3 flood.py {port}", timeoutSeconds=120)
    assert flood["exitCode"] == 0, flood
    assert json.loads(flood["stdout"])["accepted"] < 600_000
    assert agent.run(["true"])["exitCode"] == 0
    assert _rss(agent) < limit / 2

    # 2. A directory swapped for a symlink to the agent's token directory
    # (in the agent's mount namespace) while the agent searches and lists.
    agent.write("race/swap.py", SWAP)
    swapper = agent.start("cd race && exec python3 swap.py . /var/run/sandbox-agent/token")
    leaks: list[str] = []
    for _ in range(150):
        r = agent._http.post("/v1/files/search", json={"pattern": token[:16], "path": "race"})
        assert r.status_code == 200, r.text
        if r.json()["matches"]:
            leaks.append("search")
        r = agent._http.get("/v1/files/list", params={"path": "race", "depth": 3})
        assert r.status_code == 200, r.text
        if any(e["name"] == "token" for e in r.json()["entries"]):
            leaks.append("list")
        r = agent._http.get("/v1/files/content", params={"path": "race/d/token"})
        if r.status_code == 200:
            leaks.append("read")
    agent._http.post(f"/v1/executions/{swapper['id']}/cancel")
    assert leaks == []

    # 3. Connections held before auth cannot lock out the kubelet's probes or
    # the operator: an Execution completes meanwhile, and the kubelet never
    # restarts the agent (its probes kept being answered).
    agent.write("hold.py", HOLD)
    holder = agent.start(f"exec python3 hold.py {port} 45")
    executions = Executions(e2e.kube, ns)
    time.sleep(3)  # the connections are held
    executions.run("during-hold", "target", "echo operator got through")
    done = executions.wait_done("during-hold", timeout=60)
    assert done["phase"] == "Succeeded", done
    time.sleep(20)  # a few liveness and readiness periods under the hold
    agent._http.post(f"/v1/executions/{holder['id']}/cancel")

    # The agent never restarted (no OOM kill), and is within its limit.
    container = _agent_container(e2e.kube, ns, "target")
    assert container.get("restartCount", 0) == 0, container
    assert _rss(agent) < limit / 2
    agent.close()
