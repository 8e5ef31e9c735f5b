"""Count the walk of one Sandbox through one reconcile: stops and modules entered.

    python hack/reconcile_walk.py                 # a private control plane, stopped at the end
    python hack/reconcile_walk.py --cluster dev   # a running devcluster (`python -m devcluster up`)
    python hack/reconcile_walk.py --detail        # also each function entered, by count
    python hack/reconcile_walk.py --json          # the figures as JSON

Run from the repository root with the operator, the agent and the SDK on
PYTHONPATH (as for the tests):
`PYTHONPATH=sandbox-agent/src:operator:sandbox-sdk/src:. .venv/bin/python hack/reconcile_walk.py`.

What it does: starts a control plane as the integration tier does (etcd,
kube-apiserver, kube-controller-manager; `devcluster`), applies the CRDs,
and creates one Sandbox (`runtime: python`) in a fresh namespace. The
operator's own Kopf handlers (`sandbox_operator.main.sandbox_changed` and
`sandbox_due`, the pass the clock starts when its time comes) are then called
in this process, with the chart's RBAC rules as the operator's credentials
and with indexes built by the operator's own index functions from what the
API server lists (what Kopf would hold), the way Kopf calls them. No
kubelet: the tool plays the node for the pod, with a real agent process, as
the integration tier's `live_sandbox` fixture does.

Two passes are measured:
- "create": the creation handler of the new Sandbox (its children made);
- "periodic": the timer's pass over the Sandbox once it is Running (the
  steady state: the operator already knows its token and environment, and
  the pass comes as long after the one before as the idle and limit checks
  need to do their work).

A stop is one call of a function defined in the `sandbox_operator` package
(`sys.setprofile`), in the handler's own task: a coroutine counts once
however often it is resumed, comprehensions and generator expressions are
parts of an expression, not stops, and Events posted in the background are
the recorder's tasks, not the pass. A module is entered when one of its
functions is.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
import os
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from devcluster.controlplane import ControlPlane  # noqa: E402
from tests.integration.conftest import OPERATOR_ENV  # noqa: E402
from tests.integration.harness import (  # noqa: E402
    OPERATOR_NAMESPACE,
    AgentProcess,
    Node,
    next_pod_ip,
    operator_credentials,
    secret_token,
    wait_for,
)
from tests.kube import ApiError, KubeJSON, api_path, core_path  # noqa: E402
from tests.sandboxes import Sandboxes  # noqa: E402

JSON = dict[str, Any]
SANDBOX = "walk"
# The operator's ServiceAccount and ClusterRole (tests.integration.harness).
OPERATOR = "sandbox-operator"
RBAC = "rbac.authorization.k8s.io/v1"
# Not stops: the parts of one expression.
_EXPRESSIONS = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}
_RESUMABLE = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR


@dataclass
class Walk:
    """The stops of one pass: calls by (module, function)."""

    calls: Counter[tuple[str, str]] = field(default_factory=Counter)

    @property
    def stops(self) -> int:
        return sum(self.calls.values())

    def by_module(self) -> Counter[str]:
        modules: Counter[str] = Counter()
        for (module, _), count in self.calls.items():
            modules[module] += count
        return modules

    def summary(self) -> JSON:
        return {
            "stops": self.stops,
            "modules": len(self.by_module()),
            "by_module": dict(self.by_module().most_common()),
        }


@contextmanager
def walking(walk: Walk, package: str) -> Iterator[None]:
    """Count, into `walk`, the stops of the current asyncio task in `package`'s
    files until the block ends."""
    root = str(Path(package).resolve()) + os.sep
    task = asyncio.current_task()
    # Strong references: a resumed coroutine is told apart by its frame, and a
    # frame freed and reallocated must not look like one seen before.
    resumable: dict[int, FrameType] = {}

    def profile(frame: FrameType, event: str, _: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(root) or code.co_name in _EXPRESSIONS:
            return
        if asyncio.current_task() is not task:
            return
        if code.co_flags & _RESUMABLE:
            if id(frame) in resumable:
                return
            resumable[id(frame)] = frame
        module = str(frame.f_globals.get("__name__", "?"))
        walk.calls[(module, code.co_qualname)] += 1

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)


async def measured(package: str, call: Callable[[], Awaitable[None]]) -> Walk:
    """One handler call, walked, in a task of its own (as Kopf runs handlers).
    A pass that ends in a retry (Kopf's TemporaryError) is walked all the same."""
    import kopf

    async def run() -> Walk:
        walk = Walk()
        with walking(walk, package), suppress(kopf.TemporaryError):
            await call()
        return walk

    return await asyncio.create_task(run())


class Operator:
    """The operator's handlers, called in this process as Kopf calls them."""

    def __init__(self, kubeconfig: Path) -> None:
        os.environ.update(OPERATOR_ENV)
        os.environ["KUBECONFIG"] = str(kubeconfig)
        import kopf

        from sandbox_operator import main

        # Any: Kopf types its decorated handlers by what Kopf passes, not as declared.
        self.main: Any = main
        self.memo = kopf.Memo()
        self.logger = logging.getLogger("reconcile-walk")

    async def start(self) -> None:
        from sandbox_operator.agent_client import AgentClient
        from sandbox_operator.context import OperatorContext
        from sandbox_operator.events import EventRecorder
        from sandbox_operator.handlers import execution
        from sandbox_operator.kube import Kube

        settings = self.main.SETTINGS
        kube = Kube.from_environment(connections=settings.api_connections)
        self.memo.events = EventRecorder(kube)
        self.memo.ctx = OperatorContext(
            settings=settings,
            kube=kube,
            agents=AgentClient(timeout=settings.agent_timeout_seconds),
            post=self.memo.events.post,
            post_once=self.memo.events.post_once,
        )
        self.memo.scheduler = execution.Scheduler()

    async def close(self) -> None:
        await self.memo.events.drain()
        await self.memo.ctx.kube.close()
        await self.memo.ctx.agents.close()

    async def indexes(self, kube: KubeJSON, namespace: str) -> JSON:
        """Every index the handlers take, as Kopf would hold it now: each object
        the API server lists, through the operator's own index function."""
        from sandbox_operator.resources import (
            CLAIMS,
            EXECUTIONS,
            LABEL_MANAGED_BY,
            MANAGED_BY,
            PODS,
            SANDBOX_POOLS,
            SANDBOX_QUOTAS,
            SANDBOXES,
        )

        main, own = self.main, f"{LABEL_MANAGED_BY}={MANAGED_BY}"
        sources: list[tuple[Any, str, str | None]] = [
            (main.sandbox_bodies, SANDBOXES.path(namespace), None),
            (main.sandbox_pool_links, SANDBOXES.path(namespace), None),
            (main.sandbox_pods, PODS.path(namespace), own),
            (main.sandbox_claims, CLAIMS.path(namespace), own),
            (main.sandbox_quotas, SANDBOX_QUOTAS.path(namespace), None),
            (main.sandbox_pools, SANDBOX_POOLS.path(namespace), None),
            (main.execution_slots, EXECUTIONS.path(namespace), None),
        ]
        indexes: JSON = {}
        for function, path, selector in sources:
            index: dict[Any, list[Any]] = {}
            for body in kube.list(path, label_selector=selector):
                meta = body["metadata"]
                entry = await function(
                    namespace=meta.get("namespace"),
                    name=meta["name"],
                    labels=meta.get("labels") or {},
                    body=body,
                    memo=self.memo,
                )
                for key, value in (entry or {}).items():
                    index.setdefault(key, []).append(value)
            indexes[function.__name__] = index
        return indexes

    async def created(self, body: JSON, indexes: JSON) -> None:
        await self.main.sandbox_changed(
            body=body, memo=self.memo, logger=self.logger, reason="create", retry=0, **indexes
        )

    async def tick(self, body: JSON, indexes: JSON) -> None:
        await self.main.sandbox_due(body, self.memo, self.logger, self.main._indexes(indexes))


async def walk_sandbox(cp: ControlPlane, work: Path) -> dict[str, Walk]:
    """Create a Sandbox, walk its creation, play the node, walk a periodic pass."""
    walks: dict[str, Walk] = {}
    import sandbox_operator
    from sandbox_operator.handlers.sandbox.lifecycle import LIMITS_MIN_INTERVAL_SECONDS

    # The package as imported (PYTHONPATH): another checkout's is walked just as well.
    package = str(Path(sandbox_operator.__file__).parent)
    with KubeJSON(cp.kubeconfig) as kube:
        # A cluster used before (--cluster) has the operator's account: made again.
        for path in (
            core_path("serviceaccounts", OPERATOR_NAMESPACE, OPERATOR),
            api_path(RBAC, "clusterroles", name=OPERATOR),
            api_path(RBAC, "clusterrolebindings", name=OPERATOR),
        ):
            with suppress(ApiError):
                kube.delete(path)
        kubeconfig = operator_credentials(cp, kube, REPO, work / "operator-kubeconfig")
        namespace = f"walk-{uuid.uuid4().hex[:8]}"
        kube.create(
            core_path("namespaces"),
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        )
        wait_for(
            lambda: kube.get(core_path("serviceaccounts", namespace, "default")),
            60,
            f"the default ServiceAccount of {namespace}",
        )
        sandboxes = Sandboxes(kube, namespace)
        sandboxes.create(SANDBOX, {"runtime": "python"})
        operator = Operator(kubeconfig)
        await operator.start()
        agent: AgentProcess | None = None
        try:

            def body() -> JSON:
                return sandboxes.read(SANDBOX)

            new = body()
            indexes = await operator.indexes(kube, namespace)
            walks["create"] = await measured(package, lambda: operator.created(new, indexes))
            token = secret_token(kube, namespace, SANDBOX)
            agent = AgentProcess(work / "agent", next_pod_ip(), 8080, token)
            agent.start()
            Node(kube).run_pod(namespace, SANDBOX, agent.ip)
            # Unmeasured passes until it is Running and one more: the operator
            # then holds what a long-running one does (token, environment).
            for _ in range(20):
                await operator.tick(body(), await operator.indexes(kube, namespace))
                if (body().get("status") or {}).get("phase") == "Running":
                    break
                await asyncio.sleep(0.5)
            await operator.tick(body(), await operator.indexes(kube, namespace))
            # As far apart as periodic passes are: Ready is older than this pass
            # (timestamps are in seconds), and the cgroup counters are compared
            # with the last look's (at most every LIMITS_MIN_INTERVAL_SECONDS).
            await asyncio.sleep(LIMITS_MIN_INTERVAL_SECONDS + 1)
            running = body()
            phase = (running.get("status") or {}).get("phase")
            if phase != "Running":
                raise SystemExit(f"the Sandbox did not get to Running: {running.get('status')}")
            indexes = await operator.indexes(kube, namespace)
            walks["periodic"] = await measured(package, lambda: operator.tick(running, indexes))
        finally:
            await operator.close()
            if agent is not None:
                agent.stop()
            kube.delete(core_path("namespaces", name=namespace))
    return walks


def report(walks: dict[str, Walk], detail: bool) -> str:
    lines = []
    for name, walk in walks.items():
        modules = walk.by_module()
        lines.append(f"{name}: {walk.stops} stops in {len(modules)} modules")
        for module, count in modules.most_common():
            lines.append(f"  {count:4d}  {module}")
        if detail:
            for (module, function), count in walk.calls.most_common():
                lines.append(f"        {count:4d}  {module}.{function}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", help="a running devcluster to use (left running)")
    parser.add_argument("--detail", action="store_true", help="each function, by count")
    parser.add_argument("--json", action="store_true", help="the figures as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    own = args.cluster is None
    cp = ControlPlane(args.cluster or f"walk-{os.getpid()}", die_with_parent=own)
    if own or not cp.is_healthy():
        cp.start()
    try:
        applied = cp.kubectl_command("apply", "-f", str(REPO / "crds"))
        subprocess.run(applied, check=True, capture_output=True, timeout=120)
        established = cp.kubectl_command(
            "wait", "--for=condition=Established", "crd", "--all", "--timeout=60s"
        )
        subprocess.run(established, check=True, capture_output=True, timeout=120)
        with tempfile.TemporaryDirectory() as work:
            walks = asyncio.run(walk_sandbox(cp, Path(work)))
    finally:
        if own:
            cp.stop(remove_state=True)
    if args.json:
        print(json.dumps({name: walk.summary() for name, walk in walks.items()}, indent=2))
    else:
        print(report(walks, args.detail))


if __name__ == "__main__":
    main()
