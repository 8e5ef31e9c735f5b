"""The Sandbox controller: one package, a module per concern.

reconcile.py  the entry points (reconcile, teardown) and the order of things
workspace.py  the claim, restores and rollbacks, the other children
pod.py        what to do with the pod, and doing it
environment.py  env of new commands, through the agent
lifecycle.py  idleness and lifetime
status.py     the status model, written only when it changed
"""

from sandbox_operator.handlers.sandbox.reconcile import Children, reconcile, refused, teardown

__all__ = ["Children", "reconcile", "refused", "teardown"]
