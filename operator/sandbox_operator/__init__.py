"""Sandbox operator: Kopf handlers reconciling Sandbox, Execution and Snapshot.

`kopf run -m sandbox_operator` imports this package, which registers the
handlers (see main.py). Importing only `sandbox_operator.api` for the models
is cheap apart from that registration, which has no side effects beyond
reading the settings.
"""

from sandbox_operator import main as _registration  # noqa: F401
