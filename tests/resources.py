"""Namespaced access to the project's custom resources, shared by the test tiers
(Sandboxes, Executions and Snapshots build on it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from sandbox_operator.api.common import GROUP, VERSION
from tests.integration.harness import wait_for
from tests.kube import JSON, KubeJSON, api_path


class Resources:
    """Objects of one kind in one namespace."""

    kind: ClassVar[str]
    plural: ClassVar[str]

    def __init__(self, kube: KubeJSON, namespace: str) -> None:
        self.kube = kube
        self.namespace = namespace

    def path(self, name: str | None = None) -> str:
        return api_path(f"{GROUP}/{VERSION}", self.plural, self.namespace, name)

    def create_with(self, name: str, spec: JSON) -> JSON:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": self.kind,
            "metadata": {"name": name},
            "spec": spec,
        }
        return self.kube.create(self.path(), body)

    def get(self, name: str) -> JSON | None:
        return self.kube.get(self.path(name))

    def read(self, name: str) -> JSON:
        """The object; ApiError (404) when it does not exist."""
        return self.kube.read(self.path(name))

    def patch(self, name: str, body: JSON) -> None:
        self.kube.patch(self.path(name), body)

    def delete(self, name: str) -> None:
        self.kube.delete(self.path(name))

    def condition(self, name: str, kind: str) -> JSON | None:
        for cond in ((self.get(name) or {}).get("status") or {}).get("conditions", []):
            if cond["type"] == kind:
                found: JSON = cond
                return found
        return None

    def wait_object(
        self,
        name: str,
        what: str,
        test: Callable[[JSON], bool],
        timeout: float = 30,
        interval: float = 0.1,
    ) -> JSON:
        """The whole object once `test(status)` holds."""

        def reached() -> JSON | None:
            body = self.get(name)
            return body if body and test(body.get("status") or {}) else None

        where = f"{self.kind} {self.namespace}/{name}"
        return wait_for(reached, timeout, f"{where}: {what}", interval)

    def wait_gone(self, name: str, timeout: float, what: str) -> None:
        """Until the object is gone; on timeout the failure shows what holds it
        (deletion timestamp, finalizers, phase, conditions)."""
        last: JSON | None = None

        def gone() -> bool:
            nonlocal last
            last = self.get(name)
            return last is None

        try:
            wait_for(gone, timeout, what)
        except AssertionError as exc:
            meta = (last or {}).get("metadata") or {}
            status = (last or {}).get("status") or {}
            held = {
                "deletionTimestamp": meta.get("deletionTimestamp"),
                "finalizers": meta.get("finalizers"),
                "annotations": meta.get("annotations"),
                "phase": status.get("phase"),
                "conditions": status.get("conditions"),
            }
            where = f"{self.kind} {self.namespace}/{name}"
            raise AssertionError(f"{where} still there: {held}") from exc
