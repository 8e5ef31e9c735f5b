"""Sandbox operator: Kopf handlers reconciling Sandbox, Execution and Snapshot."""
