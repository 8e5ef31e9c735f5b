"""E2B's sandbox metrics, from what the cluster can tell now.

One sample per call, taken when asked (nothing is recorded between calls):
the workspace's filesystem from the sandbox's agent (`/v1/info`); CPU and
memory use from the cluster's metrics API (metrics.k8s.io, metrics-server)
when it has one, else 0; the CPU count and memory total from the Sandbox's
limits. A sample stands for the SAMPLE_SECONDS before it, which a time range
must overlap.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

import aiohttp

from sandbox_operator.api.common import quantity_value
from sandbox_operator.gateway.e2b import shapes
from sandbox_operator.gateway.e2b.core import Adapter, E2BError, Target
from sandbox_operator.identity import SANDBOX_CONTAINER
from sandbox_operator.kube import KubeError

JSON = dict[str, Any]
SAMPLE_SECONDS = 5
POD_METRICS = "/apis/metrics.k8s.io/v1beta1/namespaces/{namespace}/pods/{pod}"


def overlaps(taken: int, start: int | None, end: int | None) -> bool:
    """Whether a sample taken at `taken` (epoch seconds) falls in [start, end]."""
    return (start is None or taken >= start) and (end is None or taken - SAMPLE_SECONDS <= end)


def _number(value: Any) -> Decimal:
    try:
        return quantity_value(str(value)) if value is not None else Decimal(0)
    except (InvalidOperation, ValueError, TypeError):
        return Decimal(0)


def usage_of(pod_metrics: JSON | None) -> tuple[float, int]:
    """(CPU cores, memory bytes) the sandbox container uses, per metrics.k8s.io."""
    for container in (pod_metrics or {}).get("containers") or []:
        if container.get("name") == SANDBOX_CONTAINER:
            use = container.get("usage") or {}
            return float(_number(use.get("cpu"))), int(_number(use.get("memory")))
    return 0.0, 0


def sample(view: shapes.View, info: JSON | None, pod_metrics: JSON | None, taken: int) -> JSON:
    """E2B's SandboxMetric."""
    workspace = (info or {}).get("workspaceUsage") or {}
    cores, memory = usage_of(pod_metrics)
    return {
        "timestamp": datetime.fromtimestamp(taken, UTC).isoformat().replace("+00:00", "Z"),
        "timestampUnix": taken,
        "cpuCount": view.cpu_count,
        "cpuUsedPct": round(100.0 * cores / max(view.cpu_count, 1), 2),
        "memUsed": memory,
        "memTotal": view.memory_mb << 20,
        "memCache": 0,
        "diskUsed": int(workspace.get("usedBytes") or 0),
        "diskTotal": int(workspace.get("totalBytes") or 0),
    }


async def measure(adapter: Adapter, view: shapes.View) -> JSON | None:
    """A sample of a running sandbox now; None when it is paused (no pod, no use)."""
    if view.state != shapes.RUNNING:
        return None
    taken = int(time.time())
    table = adapter.gateway.table
    route = table.get(view.namespace, view.id)
    token = table.token(route) if route is not None else None
    info = None
    if route is not None and route.uid == view.uid and route.ready and token is not None:
        try:
            async with await adapter.agent(Target(view.id, route, token), "GET", "info") as answer:
                if answer.status == 200:
                    info = await answer.json()
        except (E2BError, aiohttp.ClientError, ValueError):
            info = None
    pod_metrics = None
    if view.pod:
        try:
            path = POD_METRICS.format(namespace=view.namespace, pod=view.pod)
            pod_metrics = await adapter.gateway.kube.get(path)
        except KubeError:
            pod_metrics = None  # no metrics API here, or no permission for it
    return sample(view, info, pod_metrics, taken)
