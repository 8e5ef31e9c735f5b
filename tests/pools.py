"""Create and read SandboxPools, and play the node for their members: shared by the
test tiers."""

from __future__ import annotations

import threading
from collections.abc import Callable

from tests.kube import JSON, ApiError, KubeJSON, core_path
from tests.resources import Resources


class Pools(Resources):
    """SandboxPools of one namespace."""

    kind = "SandboxPool"
    plural = "sandboxpools"

    def create(self, name: str, spec: JSON) -> JSON:
        return self.create_with(name, spec)

    def wait_counts(
        self, name: str, ready: int, replicas: int | None = None, timeout: float = 60
    ) -> JSON:
        def reached(status: JSON) -> bool:
            return status.get("ready") == ready and (
                replicas is None or status.get("replicas") == replicas
            )

        return self.wait_object(name, f"{ready} ready", reached, timeout, interval=0.2)

    def wait_reason(self, name: str, reason: str, timeout: float = 60) -> JSON:
        def has(status: JSON) -> bool:
            conds = status.get("conditions", [])
            return any(c["type"] == "Ready" and c["reason"] == reason for c in conds)

        return self.wait_object(name, f"Ready reason {reason}", has, timeout, interval=0.2)


def members(kube: KubeJSON, namespace: str, pool: str) -> list[JSON]:
    """The pool's waiting (unclaimed) members."""
    from tests.sandboxes import Sandboxes

    return kube.list(Sandboxes(kube, namespace).path(), f"sandbox.dev/pool={pool}")


def controller(body: JSON) -> JSON | None:
    return next(
        (o for o in body["metadata"].get("ownerReferences") or [] if o.get("controller")), None
    )


class Kubelet:
    """Runs every new pod of a namespace, as a node would: `start(namespace, pod)`
    gives the pod's IP (and may start a real agent for it). A thread, so a test
    can create objects while pods come up."""

    def __init__(self, kube: KubeJSON, namespace: str, start: Callable[[str, str], str]) -> None:
        self.kube = kube
        self.namespace = namespace
        self.start = start
        self.seen: set[str] = set()
        self.paused = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Kubelet:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            if self.paused.is_set():
                continue
            try:
                pods = self.kube.list(core_path("pods", self.namespace))
            except ApiError:
                continue
            for pod in pods:
                meta = pod["metadata"]
                if meta["uid"] in self.seen or meta.get("deletionTimestamp"):
                    continue
                self.seen.add(meta["uid"])
                try:
                    self.start(self.namespace, meta["name"])
                except ApiError:
                    self.seen.discard(meta["uid"])  # not there yet (its Secret, say): next round
