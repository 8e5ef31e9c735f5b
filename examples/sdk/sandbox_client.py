"""The SandboxClient flow: one sandbox through its whole life.

    python examples/sdk/sandbox_client.py

Create a sandbox with an exposed port, write files, run and stream commands,
change its environment, serve a port from a background job, pause and resume
it (the workspace stays), snapshot it with a tag, start a second sandbox from
that snapshot (and read its lineage), read the Events, destroy both.

Finds the cluster as kubectl does (or the pod's ServiceAccount); the namespace
is the context's, or $SANDBOX_NAMESPACE.
"""

from __future__ import annotations

import sys
import time

from sandbox_sdk import SandboxClient

client = SandboxClient()
print(client.describe())
runtimes = client.list_runtimes()
print("runtimes:", ", ".join(f"{r.name}{' (default)' if r.default else ''}" for r in runtimes))
assert "python" in {r.name for r in runtimes}

with client.create("python", env={"STAGE": "dev"}, ports=[8000]) as sandbox:
    print(f"created {sandbox.name}")
    sandbox.files.write_many(
        {
            "app/main.py": "import os\nprint('stage', os.environ['STAGE'])\n",
            "app/www/index.html": "<h1>hello from the sandbox</h1>\n",
        }
    )
    assert sandbox.execute("python3 app/main.py").stdout == "stage dev\n"

    # Output streams to callbacks (or files) while the command runs.
    lines: list[str] = []
    sandbox.execute(
        "for i in 1 2 3; do echo tick $i; sleep 0.2; done", stdout=lines.append, stderr=sys.stderr
    )
    assert "".join(lines) == "tick 1\ntick 2\ntick 3\n", lines
    for event in sandbox.stream("echo out; echo err >&2"):
        print(f"  [{event.kind}] {event.data or event.result}".rstrip())

    # New commands see the new environment; the pod stays.
    sandbox.set_env({"STAGE": "prod", "FEATURE": "on"})
    assert sandbox.execute('echo "$STAGE $FEATURE"').stdout == "prod on\n"

    # A background job serves the port; the gateway reaches it.
    server = sandbox.start("cd app/www && exec python3 -m http.server 8000")
    for _ in range(50):
        page = sandbox.port_request(8000, "/index.html")
        if page.status_code == 200:
            break
        time.sleep(0.2)
    assert "hello from the sandbox" in page.text, page.text
    print(f"port 8000 at {sandbox.url(8000).split('?')[0]}")
    server.kill()
    assert "GET /index.html" in server.logs()

    # Pause: the pod goes, the workspace stays; resume brings it back.
    sandbox.pause()
    sandbox.resume()
    assert sandbox.files.read("app/main.py").startswith("import os")

    # Snapshot with a tag, and a new sandbox from it.
    snapshot = sandbox.snapshot(tag="v1", description="app written")
    print(f"snapshot {snapshot.metadata.name} (tag v1)")
    with client.create("python", from_snapshot=snapshot.metadata.name) as copy:
        assert copy.files.read("app/www/index.html").startswith("<h1>")
        assert copy.lineage() == [snapshot.metadata.name], copy.lineage()
        print(f"{copy.name} started from {copy.lineage()}")

    reasons = [event.reason for event in sandbox.events()]
    print("events:", ", ".join(reasons))
    assert "Paused" in reasons, reasons
    assert "Resumed" in reasons, reasons
    client.delete_snapshot(snapshot.metadata.name or "")

print("destroyed; done")
