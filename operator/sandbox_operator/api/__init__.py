"""Typed models of the project's custom resources: the single source of truth.

`crds/*.yaml` and the chart's CRD copies are generated from these models
(`python -m sandbox_operator.api.generate`), and the operator parses every
spec it reconciles through them.
"""

from sandbox_operator.api.common import GROUP, VERSION
from sandbox_operator.api.execution import ExecutionSpec
from sandbox_operator.api.sandbox import SandboxSpec
from sandbox_operator.api.snapshot import SnapshotSpec

__all__ = ["GROUP", "VERSION", "ExecutionSpec", "SandboxSpec", "SnapshotSpec"]
