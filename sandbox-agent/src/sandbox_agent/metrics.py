"""Prometheus metrics, on a registry of our own (no default process collectors mixed in)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.process_collector import ProcessCollector

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)

EXECUTIONS = Counter(
    "sandbox_agent_executions",
    "Finished executions by outcome (completed, timed_out, cancelled, failed, lost)",
    ["outcome"],
    registry=REGISTRY,
)
DURATION = Histogram(
    "sandbox_agent_execution_duration_seconds",
    "Wall time of finished executions",
    buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 180, 600, 1800, 3600),
    registry=REGISTRY,
)
ACTIVE = Gauge("sandbox_agent_active_executions", "Executions running now", registry=REGISTRY)
EXEC_OUTPUT_BYTES = Counter(
    "sandbox_agent_exec_output_bytes",
    "Bytes of command output received from the runner",
    ["stream"],
    registry=REGISTRY,
)
FILE_OPS = Counter(
    "sandbox_agent_file_operations",
    "File API calls by operation and result",
    ["op", "result"],
    registry=REGISTRY,
)
FILE_BYTES = Counter(
    "sandbox_agent_file_bytes",
    "File content bytes moved by the file API (in: uploads, out: downloads)",
    ["direction"],
    registry=REGISTRY,
)
RUNNER_CONNECTED = Gauge(
    "sandbox_agent_runner_connected", "1 while the runner socket is connected", registry=REGISTRY
)
RUNTIME_RESTART_REQUESTED = Gauge(
    "sandbox_agent_runtime_restart_requested",
    "1 while the agent asks for the sandbox container to be restarted (GET /livez/runtime: 503)",
    registry=REGISTRY,
)
RUNTIME_RESTARTS = Counter(
    "sandbox_agent_runtime_restart_requests",
    "Restarts of the sandbox container requested, by reason",
    ["reason"],
    registry=REGISTRY,
)
TERMINALS = Gauge("sandbox_agent_terminals", "Terminals running now", registry=REGISTRY)
TERMINAL_OUTPUT_BYTES = Counter(
    "sandbox_agent_terminal_output_bytes",
    "Bytes terminals wrote (kept in each terminal's ring for viewers)",
    registry=REGISTRY,
)
CONTEXTS = Gauge("sandbox_agent_contexts", "Code contexts whose kernel runs now", registry=REGISTRY)
CONTEXT_RUNS = Counter("sandbox_agent_context_runs", "Code runs started", registry=REGISTRY)
WATCHES = Gauge("sandbox_agent_watches", "Directory watch streams open now", registry=REGISTRY)
WATCH_EVENTS = Counter(
    "sandbox_agent_watch_events",
    "Directory watch events sent, by type (overflow: a stream dropped changes)",
    ["type"],
    registry=REGISTRY,
)
