"""What the SDK generates stays in step with its sources: the models with crds/
and the agent's OpenAPI document, the sync client with the async one, the
reference with the docstrings. Each check fails with the command that fixes it."""

from __future__ import annotations

from sandbox_sdk import _codegen, _docs, _unasync
from sandbox_sdk.models import agent, resources


def test_models_match_the_crds_and_the_agent_api() -> None:
    assert _codegen.main(["--check"]) == 0, "run `make sdk-generate`"


def test_the_sync_client_is_generated_from_the_async_one() -> None:
    assert _unasync.main(["--check"]) == 0, "run `make sdk-generate`"


def test_the_reference_is_generated_from_the_docstrings() -> None:
    assert _docs.main(["--check"]) == 0, "run `make sdk-generate`"


def test_models_read_what_the_server_writes_and_write_what_it_reads() -> None:
    body = {
        "apiVersion": "sandbox.dev/v1alpha1",
        "kind": "Sandbox",
        "metadata": {"name": "x", "uid": "u1"},
        "spec": {"runtime": "python", "env": [{"name": "A", "value": "1"}]},
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.7",
            "conditions": [{"type": "Ready", "status": "True", "reason": "SandboxReady"}],
            # A field a later operator may add: kept, not refused.
            "somethingNew": {"x": 1},
        },
    }
    sandbox = resources.Sandbox.model_validate(body)
    assert sandbox.status is not None
    assert sandbox.status.pod_ip == "10.0.0.7"
    assert sandbox.spec.env is not None
    assert sandbox.spec.env[0].value == "1"
    assert sandbox.to_wire() == body
    # Built in code with Python names, sent with the server's.
    spec = resources.SandboxSpec(runtime="python", image_pull_policy="Never")
    assert spec.to_wire() == {"runtime": "python", "imagePullPolicy": "Never"}
    # The agent's shapes: defaults of the agent's own, unknown statuses accepted.
    execution = agent.Execution.model_validate(
        {
            "id": "e1",
            "status": "a-status-from-the-future",
            "argv": ["sh"],
            "background": False,
            "createdAt": "now",
            "cwd": ".",
            "stdinOpen": False,
            "timeoutSeconds": 1,
        }
    )
    assert (execution.oom_killed, execution.output_cursor) == (False, 0)
