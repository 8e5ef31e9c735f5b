# One entry point for every task. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CLUSTER ?= dev
# The tiers `make test` runs, in four lanes at the same time (devcluster/lanes.py),
# each its own pytest session with its own clusters: the plain processes' (a
# control plane, agents on loopback; the integration tier whole, as its
# least-privilege test reads the audit log of all of it), lint and the node's
# own tier, and two lanes of end-to-end files (kubelet, containerd, images).
# Three lanes left a third of both cores idle over a 26-minute run; with four
# (five, the integration tier split, were tried: no faster) both are busy.
PROCESS_TIERS ?= tests/unit tests/integration sandbox-sdk/tests
NODE_TIERS ?= tests/devcluster tests/e2e
# The agent's own tests need no cluster: two pytest sessions of their own,
# shared jobs that whichever lane ends first takes (devcluster/lanes.py), not
# at the start (cold, their CPU slowed the node's builds, which every node test
# waits on), so the lanes end close together on a cold cache as on a warm one.
# AGENT_SECOND: the hostile tier in a real 256 MiB memory cgroup (root) and the
# longest files.
# --rootdir=.: their test ids and rows in .ci/run's table read sandbox-agent/tests.
AGENT_SECOND ?= sandbox-agent/tests/hostile sandbox-agent/tests/test_http_limits.py \
	sandbox-agent/tests/test_contract.py
AGENT_TIERS ?= sandbox-agent/tests $(addprefix --ignore=,$(AGENT_SECOND))
# The e2e files of the second e2e lane; every other e2e file runs in the first.
E2E_SECOND ?= tests/e2e/test_isolation_e2e.py tests/e2e/test_sandbox_e2e.py \
	tests/e2e/test_snapshot_e2e.py tests/e2e/test_running_sandbox_e2e.py \
	tests/e2e/test_sdk_e2e.py tests/e2e/test_quota_e2e.py tests/e2e/test_mcp_e2e.py
TEST_TIERS ?= $(PROCESS_TIERS) $(AGENT_TIERS) $(NODE_TIERS)

.DEFAULT_GOAL := help

.PHONY: help
help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(VENV)/.installed: pyproject.toml sandbox-agent/pyproject.toml sandbox-sdk/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[dev]' -e './sandbox-agent[dev]' -e './sandbox-sdk[dev,mcp]'
	touch $@

.PHONY: install
install: $(VENV)/.installed ## Create .venv with the operator, the agent, the SDK (kubectl-sandbox) and dev tools

.PHONY: crds
crds: install ## Regenerate crds/, the chart's CRD copies and values.schema.json from the models
	$(PY) -m sandbox_operator.api.generate

.PHONY: lint
lint: install ## ruff (lint + format check), mypy --strict, gofmt, and the generated API documents up to date
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy operator devcluster tests sandbox-agent/src benchmarks hack
	$(VENV)/bin/mypy sandbox-sdk/src sandbox-sdk/tests examples/sdk
	@$(PY) -m sandbox_agent.openapi | cmp -s - sandbox-agent/openapi.json \
	  || { echo "sandbox-agent/openapi.json is stale: run make openapi"; exit 1; }
	$(PY) -m sandbox_operator.gateway.operations --check
	@unformatted="$$(gofmt -l sandbox-node devcluster/csi)"; \
	  if [ -n "$$unformatted" ]; then echo "gofmt -w these: $$unformatted"; exit 1; fi

.PHONY: binaries
binaries: install ## Build (or reuse) the pinned Kubernetes, etcd, helm and gopher-lua binaries
	$(PY) -m devcluster.build
	$(PY) -m devcluster.helm
	$(PY) -m devcluster.luahealth

.PHONY: test
# The binaries are built in the processes lane, not before the lanes: the node
# lanes meanwhile build their own (kubelet, kube-proxy...) and the images, whose
# downloads and unpacking overlap the compiles (builds of one thing are locked,
# so a lane needing what another builds waits for it before its first test).
test: install ## Lint and every test tier, in four lanes side by side (e2e / e2e-second / node / processes; the agent tiers go to whichever ends first)
	$(PY) -m devcluster.lanes \
		"e2e=$(PY) -m pytest -p devcluster.pytest_plugin tests/e2e $(addprefix --ignore=,$(E2E_SECOND))" \
		"e2e-second=$(PY) -m pytest -p devcluster.pytest_plugin $(E2E_SECOND)" \
		"node=$(PY) -m devcluster.phases run lint -- make --no-print-directory lint; \
			lint=\$$?; $(PY) -m pytest -p devcluster.pytest_plugin tests/devcluster && exit \$$lint" \
		"processes=make --no-print-directory binaries || exit \$$?; \
			$(PY) -m pytest -p devcluster.pytest_plugin $(PROCESS_TIERS)" \
		"+agent=$(PY) -m pytest -p devcluster.pytest_plugin --rootdir=. $(AGENT_TIERS)" \
		"+agent-second=$(PY) -m pytest -p devcluster.pytest_plugin --rootdir=. $(AGENT_SECOND)"

.PHONY: test-unit
test-unit: install ## Fast tests: models, builders, conditions, CRD freshness
	$(PY) -m pytest tests/unit

.PHONY: test-integration
test-integration: install binaries ## Operator against a real control plane
	$(PY) -m pytest -p devcluster.pytest_plugin tests/integration tests/devcluster

.PHONY: test-e2e
test-e2e: install binaries ## End to end on a private single-node cluster (root)
	$(PY) -m pytest -p devcluster.pytest_plugin tests/e2e

.PHONY: test-agent
test-agent: install ## The sandbox agent and runner as real processes
	$(PY) -m pytest sandbox-agent/tests

.PHONY: sdk-generate
sdk-generate: install ## Regenerate the SDK's models (from crds/, the agent's OpenAPI) and its sync code
	$(PY) -m sandbox_sdk._codegen
	$(PY) -m sandbox_sdk._unasync
	$(PY) -m sandbox_sdk._docs

.PHONY: test-sdk
test-sdk: install binaries ## The SDK: freshness checks, then against the integration tier
	$(PY) -m pytest sandbox-sdk/tests
	$(PY) -m pytest -p devcluster.pytest_plugin tests/integration/test_sdk.py

.PHONY: openapi
openapi: install ## Regenerate sandbox-agent/openapi.json and the gateway's operation table from it (tests fail when stale)
	$(PY) -m sandbox_agent.openapi > sandbox-agent/openapi.json
	$(PY) -m sandbox_operator.gateway.operations

.PHONY: cluster-up
cluster-up: install ## Start a local control plane (etcd, apiserver, controller-manager)
	$(PY) -m devcluster up --name $(CLUSTER)

.PHONY: cluster-down
cluster-down: install ## Stop the local control plane and remove its state
	$(PY) -m devcluster down --name $(CLUSTER)

KUBECTL = $$($(PY) -c 'from devcluster import build; print(build.kubernetes_binaries()["kubectl"])')

.PHONY: run
run: install ## Run the operator locally against the cluster-up cluster
	export KUBECONFIG=$$($(PY) -m devcluster kubeconfig --name $(CLUSTER)) && \
	$(KUBECTL) apply -f crds/ && \
	$(VENV)/bin/kopf run -m sandbox_operator.main --all-namespaces --standalone

.PHONY: bench
bench: install binaries ## Benchmarks: agent vs subprocess; agent memory under attack in a 256 MiB cgroup; 1,000, 3,000 and 10,000 Sandboxes; node cold start and exec; runc vs gVisor, which gVisor platforms run here and gVisor's checkpoint/restore by resident memory; a pause that keeps memory vs one that keeps the workspace; Executions vs Jobs; snapshots vs tar; resume vs a pod start; pool claims vs cold starts; idle sandboxes a node holds by resource profile; gateway vs direct; the SDK vs raw HTTP; kubectl sandbox exec vs kubectl exec; a terminal's key echo vs kubectl exec -it; a file watch's event vs inotify over kubectl exec (runc, gVisor); run_code vs a command and a local kernel; MCP vs the SDK; E2B's SDK vs ours on the same sandbox (commands, files, run_code, create from a warm pool); chaos (operator kills, an API server restart) with invariants checked
	$(PY) benchmarks/agent_bench.py
	$(PY) benchmarks/agent_memory_bench.py
	$(PY) benchmarks/sandbox_scale.py
	$(PY) benchmarks/node_bench.py
	$(PY) benchmarks/runtime_bench.py
	$(PY) benchmarks/gvisor_platforms.py
	$(PY) benchmarks/gvisor_checkpoint.py
	$(PY) benchmarks/memory_pause_bench.py
	$(PY) benchmarks/execution_bench.py
	$(PY) benchmarks/snapshot_bench.py
	$(PY) benchmarks/resume_bench.py
	$(PY) benchmarks/pool_bench.py
	$(PY) benchmarks/density_bench.py
	$(PY) benchmarks/gateway_bench.py
	$(PY) benchmarks/sdk_bench.py
	$(PY) benchmarks/cli_bench.py
	$(PY) benchmarks/terminal_bench.py
	$(PY) benchmarks/code_bench.py
	$(PY) benchmarks/watch_bench.py
	$(PY) benchmarks/mcp_bench.py
	$(PY) benchmarks/e2b_bench.py
	$(PY) benchmarks/chaos_bench.py

.PHONY: clean
clean: ## Remove the virtualenv and caches inside the repo (not the binary cache)
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

.PHONY: up
up: install ## Main job: single-node cluster, the chart, examples/, a command in a sandbox
	$(PY) hack/up.py up

.PHONY: down
down: install ## Remove everything `make up` started (processes, mounts, interfaces, iptables, state)
	$(PY) hack/up.py down
