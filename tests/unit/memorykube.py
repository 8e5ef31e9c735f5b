"""An in-memory stand-in for the operator's small `Api` interface (kube.Api), for
unit tests of the controllers' decisions. The integration tier proves the same
decisions against the real API server; this one makes them fast to explore.

It keeps objects by path and answers as the API server would for the few calls
the controllers make: get (404 -> None), create (409 -> None), merge patch,
delete (with a UID precondition), and list with a field selector on Events.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

from sandbox_operator.kube import MERGE_PATCH

JSON = dict[str, Any]
_uids = itertools.count(1)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class MemoryKube:
    def __init__(self) -> None:
        self.objects: dict[str, JSON] = {}
        self.calls: list[tuple[str, str]] = []

    def put(self, path: str, obj: JSON) -> JSON:
        """Store `obj` at `path` as if it had been created (a UID is added)."""
        stored = copy.deepcopy(obj)
        stored.setdefault("metadata", {}).setdefault("uid", f"uid-{next(_uids)}")
        self.objects[path] = stored
        return stored

    async def get(self, path: str, params: dict[str, str] | None = None) -> JSON | None:
        self.calls.append(("GET", path))
        if path in self.objects:
            return copy.deepcopy(self.objects[path])
        children = [
            copy.deepcopy(obj)
            for key, obj in self.objects.items()
            if key.rpartition("/")[0] == path
        ]
        if children or path.endswith("/events"):
            selector = (params or {}).get("fieldSelector", "")
            wanted = dict(part.split("=", 1) for part in selector.split(",") if part)
            return {"items": [c for c in children if _selected(c, wanted)]}
        return None

    async def create(self, path: str, body: JSON) -> JSON | None:
        self.calls.append(("POST", path))
        full = f"{path}/{body['metadata']['name']}"
        if full in self.objects:
            return None
        return copy.deepcopy(self.put(full, body))

    async def patch(self, path: str, body: Any, content_type: str = MERGE_PATCH) -> JSON | None:
        self.calls.append(("PATCH", path))
        target = path.removesuffix("/status")
        if target not in self.objects:
            return None
        self.objects[target] = merge_patch(self.objects[target], body)
        return copy.deepcopy(self.objects[target])

    async def delete(
        self,
        path: str,
        *,
        grace_seconds: int | None = None,
        propagation: str = "Background",
        uid: str | None = None,
        resource_version: str | None = None,
    ) -> bool:
        self.calls.append(("DELETE", path))
        obj = self.objects.get(path)
        if obj is None or (uid is not None and obj["metadata"]["uid"] != uid):
            return False
        del self.objects[path]
        return True

    async def close(self) -> None:
        pass

    def writes(self) -> list[tuple[str, str]]:
        return [call for call in self.calls if call[0] != "GET"]


def _selected(obj: JSON, wanted: dict[str, str]) -> bool:
    for field, value in wanted.items():
        current: Any = obj
        for part in field.split("."):
            current = (current or {}).get(part) if isinstance(current, dict) else None
        if current != value:
            return False
    return True
