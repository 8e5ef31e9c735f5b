"""Who a Sandbox's objects are: its reference, the names and labels of its
children, whose they are, and the names inside them (containers, the token's
key). Pure: no I/O, no clock.

Builders make children under these names; controllers, the process context
and the gateway find them by the same names without building anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sandbox_operator.resources import LABEL_MANAGED_BY, LABEL_SANDBOX, MANAGED_BY

JSON = dict[str, Any]

# The key of the agent's token in its Secret.
TOKEN_KEY = "token"
# The pod's two containers: the agent and the user's runtime.
AGENT_CONTAINER = "agent"
SANDBOX_CONTAINER = "sandbox"


@dataclass(frozen=True)
class SandboxRef:
    """A Sandbox object: what its children are named after and owned by."""

    name: str
    namespace: str
    uid: str


def ref_of(body: JSON) -> SandboxRef:
    meta = body["metadata"]
    return SandboxRef(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def children_ref(body: JSON) -> SandboxRef:
    """The Sandbox whose children (pod, workspace claim, token, policy, service) serve
    this one: a pool member it claimed (status.pool), or itself. A claim moves no
    child: the member keeps owning them, and this Sandbox owns the member."""
    pool = (body.get("status") or {}).get("pool") or {}
    if pool.get("member") and pool.get("memberUid"):
        return SandboxRef(
            name=pool["member"], namespace=body["metadata"]["namespace"], uid=pool["memberUid"]
        )
    return ref_of(body)


def names(sandbox: str) -> dict[str, str]:
    """Deterministic child names; the CRD caps sandbox names so these stay valid."""
    return {
        "pod": sandbox,
        "claim": f"{sandbox}-workspace",
        "secret": f"{sandbox}-agent-token",
        "service": sandbox,
        "network_policy": sandbox,
    }


def labels(sandbox: str) -> dict[str, str]:
    return {LABEL_SANDBOX: sandbox, LABEL_MANAGED_BY: MANAGED_BY}


def controlled_by(obj: JSON, ref: SandboxRef) -> bool:
    """The object's controller is this Sandbox (its UID, not only its name:
    labels and names can be copied by anyone who may create pods)."""
    return any(
        owner.get("controller") and owner.get("uid") == ref.uid
        for owner in obj["metadata"].get("ownerReferences") or []
    )


def left_by_namesake(obj: JSON, ref: SandboxRef) -> bool:
    """Controlled by an earlier Sandbox of this name (another UID). A name is held by
    one Sandbox at a time, so that one is gone and the garbage collector is removing
    the object: taken for this Sandbox's own, it would vanish under it (a pod bound
    to a claim that is deleted a moment later stays unschedulable for good)."""
    return any(
        owner.get("controller")
        and owner.get("kind") == "Sandbox"
        and owner.get("name") == ref.name
        and owner.get("uid") != ref.uid
        for owner in obj["metadata"].get("ownerReferences") or []
    )
