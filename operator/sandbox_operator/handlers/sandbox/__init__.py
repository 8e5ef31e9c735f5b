"""The Sandbox controller: one package, a module per concern.

reconcile.py     the entry points (reconcile, teardown) and the order of things
view.py          what one pass reads of its Sandbox, read once (SandboxView)
workspace.py     the workspace claim, restores and rollbacks, the other children
pod.py           what to do with the pod, and doing it
template_use.py  the template a Sandbox takes, read once and recorded (status.template)
admission.py     admission against the namespace's SandboxQuotas
pool_claim.py    taking a warm member of a SandboxPool (status.pool)
arrival.py       a new Sandbox's pool claim, ahead of Kopf's change handlers
environment.py   env of new commands and spec.files, through the agent
lifecycle.py     idleness and lifetime
status.py        the status model, written only when it changed; Blocked, how a
                 pass that cannot go on stops (its status written once)
"""

from sandbox_operator.handlers.sandbox.arrival import claim_on_arrival
from sandbox_operator.handlers.sandbox.reconcile import (
    Children,
    forget,
    reconcile,
    refused,
    teardown,
)

__all__ = ["Children", "claim_on_arrival", "forget", "reconcile", "refused", "teardown"]
