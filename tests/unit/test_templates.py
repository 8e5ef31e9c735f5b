"""Templates: the effective spec of a Sandbox, what it takes from a template,
the setup digest and build log, and the paused deadline. Pure functions."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sandbox_operator import effective
from sandbox_operator.api.sandbox import (
    EgressPolicy,
    OnIdle,
    SandboxSpec,
    SandboxStatus,
    TemplateKind,
    TemplateRef,
)
from sandbox_operator.api.template import SandboxTemplateSpec, SetupStep
from sandbox_operator.builders import template as build
from sandbox_operator.handlers.sandbox.lifecycle import paused_fields
from sandbox_operator.handlers.sandbox.template_use import use_of

JSON = dict[str, Any]

TEMPLATE = SandboxSpec.model_validate(
    {
        "runtime": "node",
        "resources": {"cpu": "250m", "memory": "256Mi"},
        "env": [{"name": "A", "value": "t"}, {"name": "B", "value": "t"}],
        "lifecycle": {"onIdle": "Pause", "idleTimeout": "10m"},
        "network": {"egress": "None"},
        "nodeSelector": {"tier": "a", "zone": "z1"},
        "podLabels": {"team": "x"},
        "workspace": {"size": "2Gi"},
    }
)


def own(spec: JSON) -> SandboxSpec:
    return SandboxSpec.model_validate({"templateRef": {"name": "t"}, **spec})


def test_unset_fields_come_from_the_template() -> None:
    # What the API server stores for a Sandbox that names only its template.
    spec = effective.effective_spec(
        TEMPLATE, own({"resources": {}, "workspace": {}, "lifecycle": {}, "network": {}})
    )
    assert spec.runtime == "node"
    assert spec.resources.cpu == "250m"
    assert spec.lifecycle.on_idle is OnIdle.PAUSE
    assert spec.lifecycle.idle_timeout == "10m"
    assert spec.network.egress is EgressPolicy.NONE
    assert spec.workspace.size == "2Gi"
    assert spec.template_ref == TemplateRef(name="t")


def test_set_fields_win_even_at_their_default_values() -> None:
    spec = effective.effective_spec(
        TEMPLATE,
        own(
            {
                "resources": {"memory": "1Gi"},
                "lifecycle": {"onIdle": "Delete"},
                "network": {"egress": "Internet"},
            }
        ),
    )
    assert spec.resources.memory == "1Gi"
    assert spec.resources.cpu == "250m"  # the sibling field still comes from the template
    assert spec.lifecycle.on_idle is OnIdle.DELETE
    assert spec.lifecycle.idle_timeout == "10m"
    assert spec.network.egress is EgressPolicy.INTERNET


def test_env_and_maps_merge_by_key() -> None:
    spec = effective.effective_spec(
        TEMPLATE,
        own(
            {
                "env": [{"name": "B", "value": "own"}, {"name": "C", "value": "own"}],
                "nodeSelector": {"zone": "z2"},
                "podLabels": {"app": "demo"},
            }
        ),
    )
    assert [(v.name, v.value) for v in spec.env] == [("A", "t"), ("B", "own"), ("C", "own")]
    assert spec.node_selector == {"tier": "a", "zone": "z2"}
    assert spec.pod_labels == {"team": "x", "app": "demo"}


def test_files_merge_by_path() -> None:
    defaults = TEMPLATE.model_copy(
        update={
            "files": own(
                {"files": [{"path": "a", "content": "t"}, {"path": "b", "content": "t"}]}
            ).files
        }
    )
    spec = effective.effective_spec(
        defaults, own({"files": [{"path": "b", "content": "own", "mode": 0o755}]})
    )
    assert [(f.path, f.content, f.mode) for f in spec.files] == [
        ("a", "t", None),
        ("b", "own", 0o755),
    ]
    assert [f.path for f in effective.effective_spec(defaults, own({})).files] == ["a", "b"]


def test_choosing_an_image_drops_the_template_runtime() -> None:
    spec = effective.effective_spec(TEMPLATE, own({"image": "python:3.12-slim"}))
    assert spec.image == "python:3.12-slim"
    assert spec.runtime is None
    assert effective.effective_spec(TEMPLATE, own({"runtime": "python"})).runtime == "python"


def body_with(template: JSON | None, spec: JSON) -> JSON:
    status: JSON = {"template": template} if template is not None else {}
    return {
        "metadata": {"name": "s"},
        "spec": {"templateRef": {"name": "t"}, **spec},
        "status": status,
    }


def test_sandbox_spec_reads_the_recorded_defaults_and_base_snapshot() -> None:
    recorded: JSON = {
        "kind": "SandboxTemplate",
        "name": "t",
        "baseSnapshot": "t-base-1",
        "defaults": TEMPLATE.to_wire(),
    }
    spec = effective.sandbox_spec(body_with(recorded, {}))
    assert spec.runtime == "node"
    assert spec.workspace.from_snapshot == "t-base-1"
    # The Sandbox's own snapshot, or an ephemeral workspace, wins over the base.
    mine = effective.sandbox_spec(body_with(recorded, {"workspace": {"fromSnapshot": "mine"}}))
    assert mine.workspace.from_snapshot == "mine"
    scratch = effective.sandbox_spec(body_with(recorded, {"workspace": {"ephemeral": True}}))
    assert scratch.workspace.from_snapshot is None
    # Not recorded yet: the Sandbox's own spec alone.
    assert effective.sandbox_spec(body_with(None, {})).runtime is None


def template(spec: JSON, status: JSON | None = None) -> JSON:
    return {"metadata": {"name": "t", "generation": 4}, "spec": spec, "status": status or {}}


def test_use_of_a_template_without_setup_needs_no_status() -> None:
    use, why = use_of(TemplateRef(name="t"), template({"sandbox": {"runtime": "node"}}))
    assert why == ""
    assert use is not None
    assert use.generation == 4
    assert use.base_snapshot is None
    assert use.defaults["runtime"] == "node"


def test_use_of_a_template_with_setup_waits_for_its_base() -> None:
    spec: JSON = {"setup": [{"name": "a", "script": "true"}]}
    digest = build.setup_hash(SandboxTemplateSpec.model_validate(spec))
    ref = TemplateRef(name="t")
    building = {
        "conditions": [
            {
                "type": "Ready",
                "status": "False",
                "reason": "Building",
                "message": "step a (1/1) running",
            }
        ],
    }
    use, why = use_of(ref, template(spec, building))
    assert use is None
    assert why == "its base snapshot is not ready: step a (1/1) running"
    ready = {
        "setupHash": digest,
        "baseSnapshot": "t-base-x",
        "conditions": [{"type": "Ready", "status": "True", "reason": "TemplateReady"}],
    }
    use, _ = use_of(ref, template(spec, ready))
    assert use is not None
    assert use.base_snapshot == "t-base-x"
    # A base built from older steps is not this template's base.
    stale, why = use_of(ref, template(spec, {**ready, "setupHash": "older"}))
    assert stale is None
    cluster, _ = use_of(TemplateRef(kind=TemplateKind.CLUSTER, name="t"), template({}))
    assert cluster is not None


def test_setup_hash_follows_the_steps_and_what_they_run_with() -> None:
    steps = [SetupStep(name="a", script="pip install x")]
    base = SandboxTemplateSpec(setup=steps)
    assert build.setup_hash(SandboxTemplateSpec()) is None
    assert build.setup_hash(base) == build.setup_hash(SandboxTemplateSpec(setup=steps))
    assert build.setup_hash(base) != build.setup_hash(
        SandboxTemplateSpec(setup=[SetupStep(name="a", script="pip install y")])
    )
    other_image = SandboxTemplateSpec(setup=steps, sandbox=SandboxSpec(runtime="node"))
    assert build.setup_hash(base) != build.setup_hash(other_image)
    described = SandboxTemplateSpec(setup=steps, description="now with words")
    assert build.setup_hash(base) == build.setup_hash(described)


def test_build_names_fit_a_sandbox_name() -> None:
    names = build.build_names("t" * 63, "0123456789abcdef")
    assert len(names["sandbox"]) <= 50
    assert names["sandbox"].endswith("-base-0123456789")


def test_build_log_names_each_step_and_keeps_the_tail() -> None:
    steps = [SetupStep(name="a", script="x"), SetupStep(name="b", script="y")]
    done = {"status": {"phase": "Succeeded", "stdout": "ok\n"}}
    running = {"status": {"phase": "Running", "stdout": "x" * 10000}}
    log = build.build_log(steps, [done, running])
    assert log is not None
    assert len(log) == build.LOG_TAIL
    assert log.endswith("x")
    assert build.build_log(steps, [done, None]) == "--- a (Succeeded) ---\nok"
    assert build.build_log(steps, [None]) is None


def test_paused_deadline_counts_from_the_start_of_the_pause() -> None:
    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    spec = SandboxSpec.model_validate({"lifecycle": {"pausedTimeout": "1h"}})
    fresh = paused_fields(SandboxStatus(), spec, True, now)
    assert fresh == {
        "paused_since": "2026-01-01T12:00:00Z",
        "paused_deadline": "2026-01-01T13:00:00Z",
    }
    later = datetime(2026, 1, 1, 12, 30, tzinfo=UTC)
    kept = paused_fields(SandboxStatus(paused_since="2026-01-01T12:00:00Z"), spec, True, later)
    assert kept == fresh
    by_idle = paused_fields(SandboxStatus(idle_paused_at="2026-01-01T11:00:00Z"), spec, True, now)
    assert by_idle["paused_deadline"] == "2026-01-01T12:00:00Z"
    assert paused_fields(SandboxStatus(paused_since="x"), spec, False, now) == {
        "paused_since": None,
        "paused_deadline": None,
    }
    assert paused_fields(SandboxStatus(), SandboxSpec(), True, now)["paused_deadline"] is None


def test_scalars_lists_and_lifecycle_subfields_of_the_sandbox_win() -> None:
    defaults = TEMPLATE.evolve(
        image_pull_policy="IfNotPresent",
        runtime_class_name="gvisor",
        tolerations=[{"key": "dedicated", "operator": "Exists"}],
        pod_annotations={"note": "t"},
    )
    spec = effective.effective_spec(
        SandboxSpec.model_validate(defaults.to_wire()),
        own(
            {
                "runtimeClassName": "runc",
                "tolerations": [{"key": "gpu", "operator": "Exists"}],
                "podAnnotations": {"extra": "1"},
                "lifecycle": {"pausedTimeout": "1h", "snapshotOnIdle": True},
                "network": {"exposedPorts": [{"name": "web", "port": 8080}]},
            }
        ),
    )
    assert spec.runtime_class_name == "runc"
    assert spec.image_pull_policy == "IfNotPresent"
    assert [t.key for t in spec.tolerations] == ["gpu"]  # a list is replaced whole
    assert spec.pod_annotations == {"note": "t", "extra": "1"}
    lifecycle = spec.lifecycle
    assert (lifecycle.on_idle, lifecycle.idle_timeout) == (OnIdle.PAUSE, "10m")
    assert (lifecycle.paused_timeout, lifecycle.snapshot_on_idle) == ("1h", True)
    assert spec.network.egress is EgressPolicy.NONE
    assert [p.port for p in spec.network.exposed_ports] == [8080]
    # The pull policy went with the template's image choice.
    assert effective.effective_spec(defaults, own({"image": "x:1"})).image_pull_policy is None


def test_no_template_defaults_leave_the_operator_defaults() -> None:
    assert effective.effective_spec(SandboxSpec(), SandboxSpec()) == SandboxSpec()


def test_setup_hash_covers_env_resources_workspace_and_timeouts() -> None:
    steps = [SetupStep(name="a", script="true")]
    variants = [
        SandboxTemplateSpec(setup=steps),
        SandboxTemplateSpec(setup=[SetupStep(name="a", script="true", timeout="1m")]),
        SandboxTemplateSpec(setup=steps, sandbox=own({"env": [{"name": "X", "value": "1"}]})),
        SandboxTemplateSpec(setup=steps, sandbox=own({"resources": {"memory": "1Gi"}})),
        SandboxTemplateSpec(setup=steps, sandbox=own({"workspace": {"size": "4Gi"}})),
    ]
    digests = {build.setup_hash(v) for v in variants}
    assert len(digests) == len(variants)
    idle = SandboxTemplateSpec(setup=steps, sandbox=own({"lifecycle": {"idleTimeout": "5m"}}))
    assert build.setup_hash(idle) == build.setup_hash(variants[0])


def test_use_of_a_failed_or_invalid_template_says_why() -> None:
    spec: JSON = {"setup": [{"name": "a", "script": "false"}]}
    failed = {
        "setupHash": build.setup_hash(SandboxTemplateSpec.model_validate(spec)),
        "conditions": [
            {
                "type": "Ready",
                "status": "False",
                "reason": "SetupFailed",
                "message": "step a (1/1) failed (exit code 1)",
            }
        ],
    }
    use, why = use_of(TemplateRef(name="t"), template(spec, failed))
    assert use is None
    assert why == "its base snapshot is not ready: step a (1/1) failed (exit code 1)"
    use, why = use_of(TemplateRef(name="t"), template({"sandbox": {"runtime": "Not A Label"}}))
    assert use is None
    assert why.startswith("its spec is invalid")


def _snapshot(name: str, created: str, phase: str = "Ready") -> JSON:
    return {"metadata": {"name": name, "creationTimestamp": created}, "status": {"phase": phase}}


def test_the_current_base_and_the_newest_other_ready_one_are_kept() -> None:
    listed = [
        _snapshot("t-base-1", "2026-01-01T10:00:00Z"),
        _snapshot("t-base-2", "2026-01-01T11:00:00Z"),
        _snapshot("t-base-3", "2026-01-01T12:00:00Z", phase="Failed"),
        _snapshot("t-base-4", "2026-01-01T13:00:00Z"),
    ]
    assert build.bases_to_keep("t-base-4", listed) == {"t-base-4", "t-base-2"}
    assert build.bases_to_keep("t-base-1", listed[:1]) == {"t-base-1"}
