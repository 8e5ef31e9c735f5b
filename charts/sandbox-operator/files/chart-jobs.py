"""The chart's two jobs, run by python3 in the operator's image with nothing but
the standard library and the pod's ServiceAccount:

- `crds DIR`: server-side apply of the CRDs in DIR (JSON files), the
  pre-upgrade hook that brings the CRDs to the chart's version (helm installs
  crds/ once and never updates them);
- `test NAMESPACE NAME`: `helm test`: a Sandbox and an Execution named NAME,
  the command run in the sandbox, both deleted again.
"""

from __future__ import annotations

import json
import ssl
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
API = "https://kubernetes.default.svc"
MANAGER = "sandbox-operator-chart"
GROUP = "/apis/sandbox.dev/v1alpha1"


def call(method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
    """One API request; None for 404, the error's text in RuntimeError otherwise."""
    context = ssl.create_default_context(cafile=str(ACCOUNT / "ca.crt"))
    token = (ACCOUNT / "token").read_text().strip()
    request = urllib.request.Request(
        API + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": content_type},
    )
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as response:
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise RuntimeError(f"{method} {path}: {error.code} {error.read().decode()}") from None


def apply_crds(directory: Path) -> None:
    for path in sorted(directory.glob("*.json")):
        crd = json.loads(path.read_text())
        name = crd["metadata"]["name"]
        call(
            "PATCH",
            f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
            f"?fieldManager={MANAGER}&force=true",
            crd,
            "application/apply-patch+yaml",
        )
        print(f"applied {name}", flush=True)


def wait(what: str, path: str, done: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        body = call("GET", path) or {}
        if done(body.get("status") or {}):
            return body
        time.sleep(1)
    raise RuntimeError(f"{what} not reached in {timeout:.0f}s: {json.dumps(body.get('status'))}")


def ready(status: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def ended(status: dict[str, Any]) -> bool:
    return status.get("phase") in ("Succeeded", "Failed", "TimedOut", "Cancelled")


def test(namespace: str, name: str) -> None:
    sandboxes = f"{GROUP}/namespaces/{namespace}/sandboxes"
    executions = f"{GROUP}/namespaces/{namespace}/executions"
    for path in (f"{executions}/{name}", f"{sandboxes}/{name}"):
        call("DELETE", path)  # a previous run's leftovers
        deadline = time.monotonic() + 120
        while call("GET", path) is not None and time.monotonic() < deadline:
            time.sleep(1)
    try:
        call(
            "POST",
            sandboxes,
            {
                "apiVersion": "sandbox.dev/v1alpha1",
                "kind": "Sandbox",
                "metadata": {"name": name},
                "spec": {"workspace": {"ephemeral": True}},
            },
        )
        wait(f"Sandbox {name} Ready", f"{sandboxes}/{name}", ready, 300)
        print(f"sandbox {namespace}/{name} is ready", flush=True)
        call(
            "POST",
            executions,
            {
                "apiVersion": "sandbox.dev/v1alpha1",
                "kind": "Execution",
                "metadata": {"name": name},
                "spec": {
                    "sandboxRef": {"name": name},
                    "command": ["python3", "-c", "print(6 * 7)"],
                },
            },
        )
        body = wait(f"Execution {name} done", f"{executions}/{name}", ended, 120)
        status = body["status"]
        if (status.get("phase"), status.get("stdout")) != ("Succeeded", "42\n"):
            raise RuntimeError(f"the command did not run as expected: {json.dumps(status)}")
        print("command ran: python3 -c 'print(6 * 7)' -> 42", flush=True)
    finally:
        call("DELETE", f"{executions}/{name}")
        call("DELETE", f"{sandboxes}/{name}")


def main() -> None:
    command, *args = sys.argv[1:]
    if command == "crds":
        apply_crds(Path(args[0]))
    elif command == "test":
        test(args[0], args[1])
    else:
        sys.exit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
