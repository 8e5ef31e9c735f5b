"""Sandbox operator: Kopf handlers reconciling Sandbox, Execution and Snapshot.

`kopf run -m sandbox_operator.main` registers the handlers (main.py). Importing
the package or its models (`sandbox_operator.api`) registers nothing and reads
no settings.
"""
