"""Prometheus metrics of the operator, served on settings.metrics_port."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import REGISTRY, GaugeMetricFamily
from prometheus_client.registry import Collector

RECONCILES = Counter(
    "sandbox_operator_reconciles_total",
    "Reconciliations by kind, trigger and result.",
    ["kind", "trigger", "result"],
)
RECONCILE_SECONDS = Histogram(
    "sandbox_operator_reconcile_duration_seconds",
    "Time spent in one reconciliation.",
    ["kind", "trigger"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
WORKSPACE_FULL = Counter(
    "sandbox_operator_workspace_full_total",
    "Times a sandbox's workspace was found full (under 1% free: writes fail with ENOSPC).",
)
LIMIT_REACHED = Counter(
    "sandbox_operator_limit_reached_total",
    "Times a sandbox was found at a resource limit: pids (forks refused), cpu (throttled).",
    ["limit"],
)
POD_RECREATIONS = Counter(
    "sandbox_operator_pod_recreations_total",
    "Sandbox pods recreated after failing, eviction or deletion.",
)
TEARDOWNS = Counter(
    "sandbox_operator_lifecycle_actions_total",
    "Automatic lifecycle actions (idle delete, idle pause, max lifetime).",
    ["action"],
)
MEMORY_SAVES = Counter(
    "sandbox_operator_memory_saves_total",
    "Saves of a pausing pod (pauseMode Memory), by result: ok, CheckpointFailed,"
    " CheckpointerUnavailable.",
    ["result"],
)
MEMORY_RESUMES = Counter(
    "sandbox_operator_memory_resumes_total",
    "Resumes of a pod saved whole, by result: restored, lost (started from the workspace).",
    ["result"],
)
EXECUTIONS = Counter(
    "sandbox_operator_executions_total",
    "Executions that reached a terminal phase, by phase and reason.",
    ["phase", "reason"],
)
EXECUTION_SECONDS = Histogram(
    "sandbox_operator_execution_seconds",
    "Time from an Execution's creation to its terminal phase (queueing included).",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800),
)
SNAPSHOTS = Counter(
    "sandbox_operator_snapshots_total",
    "Snapshots that reached a final phase, by result (ready, failed).",
    ["result"],
)
SNAPSHOT_SECONDS = Histogram(
    "sandbox_operator_snapshot_ready_seconds",
    "Time from a Snapshot's creation to its being ready to restore.",
    buckets=(1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
)
RESTORES = Counter(
    "sandbox_operator_workspace_restores_total",
    "Workspace claims made from a Snapshot, by kind (restore: a new claim; rollback:"
    " a claim replaced).",
    ["kind"],
)
TEMPLATE_BUILDS = Counter(
    "sandbox_operator_template_builds_total",
    "Base snapshot builds of SandboxTemplates, by event (started, succeeded, failed).",
    ["event"],
)
TEMPLATE_BUILD_SECONDS = Histogram(
    "sandbox_operator_template_build_seconds",
    "Time from a base build's start (its build Sandbox's creation) to its base snapshot"
    " being ready.",
    buckets=(5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200),
)
POOL_CLAIMS = Counter(
    "sandbox_operator_pool_claims_total",
    "Sandboxes naming a SandboxPool, by outcome (claimed a member, cold: started a new"
    " pod, waited: the pool was empty and waits).",
    ["outcome"],
)
POOL_CLAIM_CONFLICTS = Counter(
    "sandbox_operator_pool_claim_conflicts_total",
    "Claims that lost a member to a concurrent claim (or write) and tried another.",
)
POOL_MEMBERS = Counter(
    "sandbox_operator_pool_members_total",
    "Pool members created and deleted by SandboxPools, by event (created, deleted).",
    ["event"],
)
AGENT_ERRORS = Counter(
    "sandbox_operator_agent_errors_total",
    "Failed calls from the operator to sandbox agents.",
)


class PhaseCollector(Collector):
    """Sandboxes by phase, from the phases the operator last wrote."""

    def __init__(self) -> None:
        self.phases: dict[tuple[str, str], str] = {}

    def set(self, namespace: str, name: str, phase: str) -> None:
        self.phases[(namespace, name)] = phase

    def forget(self, namespace: str, name: str) -> None:
        self.phases.pop((namespace, name), None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "sandbox_operator_sandboxes", "Sandboxes by phase.", labels=["phase"]
        )
        counts: dict[str, int] = {}
        for phase in self.phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        for phase, count in sorted(counts.items()):
            family.add_metric([phase], count)
        yield family


PHASES = PhaseCollector()
REGISTRY.register(PHASES)


class QuotaCollector(Collector):
    """Each SandboxQuota's limits and its namespace's usage, as its status last said."""

    def __init__(self) -> None:
        # (namespace, quota) -> resource -> (hard, used)
        self.quotas: dict[tuple[str, str], dict[str, tuple[float, float]]] = {}

    def set(self, namespace: str, name: str, values: dict[str, tuple[float, float]]) -> None:
        self.quotas[(namespace, name)] = values

    def forget(self, namespace: str, name: str) -> None:
        self.quotas.pop((namespace, name), None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["namespace", "quota", "resource"]
        hard = GaugeMetricFamily(
            "sandbox_operator_quota_hard",
            "SandboxQuota limits (cores, bytes, counts).",
            labels=labels,
        )
        used = GaugeMetricFamily(
            "sandbox_operator_quota_used",
            "Usage counted against SandboxQuota limits (cores, bytes, counts).",
            labels=labels,
        )
        for (namespace, name), values in sorted(self.quotas.items()):
            for resource, (limit, current) in sorted(values.items()):
                hard.add_metric([namespace, name, resource], limit)
                used.add_metric([namespace, name, resource], current)
        yield hard
        yield used


QUOTAS = QuotaCollector()
REGISTRY.register(QUOTAS)
FORGOTTEN_AFTER_PAUSE = Counter(
    "sandbox_operator_forgotten_after_pause_total",
    "Objects deleted while this replica was paused by peering (no event of it), dropped"
    " from its indexes when the pause ended, by kind (plural).",
    ["kind"],
)
