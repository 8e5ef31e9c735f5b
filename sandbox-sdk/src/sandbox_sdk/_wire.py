"""What goes over the wire to the gateway, shared by the clients and the CLI's
one-request `exec` (`sandbox_sdk._oneshot`): standard library only, so that the
CLI can use it without importing httpx or pydantic.

Pure functions: the body of a command, the event of one line of its output
stream, and where the gateway's Service is.
"""

from __future__ import annotations

import base64
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from sandbox_sdk.errors import ConfigError, Invalid
from sandbox_sdk.types import CommandResult, OutputEvent

JSON = dict[str, Any]
FileContent = str | bytes
Service = tuple[str, str, int]  # namespace, name, port

MAX_TIMEOUT = 1800.0  # what execute() admits (the agent allows up to its own maximum)

GATEWAY_LABEL = "app.kubernetes.io/name=sandbox-gateway"
DEFAULT_SERVICE: Service = ("sandbox-system", "sandbox-operator-gateway", 80)
# Through the API server's service proxy the API server keeps `Authorization`
# for itself: the gateway token travels in this header.
PROXIED_AUTHORIZATION = "X-Sandbox-Authorization"
# The ServiceAccount whose token the gateway gets for a certificate-only kubeconfig.
SDK_ACCOUNT = "sandbox-sdk"


def timeout_seconds(timeout: float, maximum: float) -> int:
    if not 0 < timeout <= maximum:
        raise Invalid(f"timeout must be more than 0 and at most {maximum:.0f} seconds")
    return max(1, math.ceil(timeout))


def exec_body(
    command: str | Sequence[str],
    *,
    env: Mapping[str, str] | None,
    cwd: str | None,
    stdin: FileContent | None,
    timeout: int,
    combined_output: bool,
    background: bool = False,
    stdin_open: bool = False,
) -> JSON:
    # A fresh idempotency key per call: every retry of this request carries it,
    # so the agent runs the command at most once whatever the network does.
    # 128 random bits, as uuid4 has (whose module costs `exec` a few ms to import).
    body: JSON = {"idempotencyKey": os.urandom(16).hex(), "timeoutSeconds": timeout}
    if isinstance(command, str):
        body["command"] = command
    else:
        body["argv"] = list(command)
    if env:
        body["env"] = dict(env)
    if cwd:
        body["cwd"] = cwd
    if isinstance(stdin, bytes):
        body["stdinBase64"] = base64.b64encode(stdin).decode()
    elif stdin is not None:
        body["stdin"] = stdin
    if combined_output:
        body["combinedOutput"] = True
    if background:
        body["background"] = True
    if stdin_open:
        body["stdinOpen"] = True
    return body


def event_of(raw: JSON) -> tuple[str, OutputEvent | None, str | None]:
    """The event of one line of the agent's stream, and the execution's id when
    it names it. The record stays JSON (`CommandResult.of` takes it as is)."""
    kind = raw.get("type")
    if kind == "output":
        stream: Literal["stdout", "stderr"] = (
            "stderr" if raw.get("stream") == "stderr" else "stdout"
        )
        data = raw.get("data")
        if data is None and raw.get("dataBase64"):
            data = base64.b64decode(raw["dataBase64"]).decode(errors="replace")
        return "output", OutputEvent(stream, data or "", raw.get("cursor")), None
    execution: JSON | None = raw.get("execution") or None
    execution_id = str(execution["id"]) if execution else None
    if kind == "finished" and execution is not None:
        return "finished", OutputEvent("exit", result=CommandResult.of(execution)), execution_id
    return str(kind), None, execution_id


def service_env() -> Service | None:
    """`$SANDBOX_GATEWAY_SERVICE` (namespace/name[:port]), if set."""
    value = os.environ.get("SANDBOX_GATEWAY_SERVICE")
    if not value:
        return None
    ns, _, rest = value.partition("/")
    name, _, port = rest.partition(":")
    if not ns or not name:
        raise ConfigError(f"SANDBOX_GATEWAY_SERVICE={value!r}: expected namespace/name[:port]")
    return ns, name, int(port or 80)


def service_of(found: list[JSON]) -> tuple[Service, str | None] | None:
    """The gateway's Service among those labelled as it, and its Helm release."""
    if not found:
        return None
    meta = found[0]["metadata"]
    ports = (found[0].get("spec") or {}).get("ports") or [{"port": 80}]
    release = (meta.get("labels") or {}).get("app.kubernetes.io/instance")
    return (meta["namespace"], meta["name"], int(ports[0]["port"])), release


def proxy_base(service: Service) -> str:
    """The API server path that proxies to the gateway's Service."""
    ns, name, port = service
    return f"/api/v1/namespaces/{ns}/services/http:{name}:{port}/proxy"


def dns_base(service: Service) -> str:
    ns, name, port = service
    return f"http://{name}.{ns}.svc:{port}"
