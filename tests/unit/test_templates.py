"""Templates: the effective spec of a Sandbox (template defaults under its own
fields), the setup digest and build names, what a Sandbox takes from a
template, and the pausedTimeout deadline. Pure functions."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from sandbox_operator.api.sandbox import (
    EgressPolicy,
    OnIdle,
    SandboxSpec,
    SandboxStatus,
    TemplateKind,
    TemplateRef,
)
from sandbox_operator.api.template import SandboxTemplateSpec, SetupStep
from sandbox_operator.builders.template import (
    LOG_TAIL,
    build_log,
    build_names,
    effective_spec,
    sandbox_spec,
    setup_hash,
)
from sandbox_operator.handlers.sandbox.lifecycle import paused_fields
from sandbox_operator.handlers.sandbox.template import use_of

JSON = dict[str, Any]

TEMPLATE_DEFAULTS: JSON = {
    "runtime": "python",
    "imagePullPolicy": "IfNotPresent",
    "resources": {"cpu": "1", "memory": "1Gi"},
    "env": [{"name": "A", "value": "template"}, {"name": "B", "value": "template"}],
    "workspace": {"size": "2Gi", "storageClassName": "fast"},
    "lifecycle": {"idleTimeout": "1h", "onIdle": "Pause", "pausedTimeout": "24h"},
    "network": {"egress": "None"},
    "runtimeClassName": "gvisor",
    "nodeSelector": {"pool": "sandboxes", "zone": "a"},
    "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
    "podLabels": {"team": "ml", "tier": "batch"},
    "podAnnotations": {"note": "template"},
}


def _merged(own: JSON, defaults: JSON | None = None) -> SandboxSpec:
    return effective_spec(
        SandboxSpec.model_validate(TEMPLATE_DEFAULTS if defaults is None else defaults),
        SandboxSpec.model_validate(own),
    )


def test_a_sandbox_that_sets_nothing_takes_every_template_field() -> None:
    spec = _merged({"templateRef": {"name": "t"}})
    assert spec.runtime == "python"
    assert spec.image_pull_policy == "IfNotPresent"
    assert (spec.resources.cpu, spec.resources.memory) == ("1", "1Gi")
    assert [(v.name, v.value) for v in spec.env] == [("A", "template"), ("B", "template")]
    assert (spec.workspace.size, spec.workspace.storage_class_name) == ("2Gi", "fast")
    assert spec.lifecycle.idle_timeout == "1h"
    assert spec.lifecycle.on_idle is OnIdle.PAUSE
    assert spec.lifecycle.paused_timeout == "24h"
    assert spec.network.egress is EgressPolicy.NONE
    assert spec.runtime_class_name == "gvisor"
    assert spec.node_selector == {"pool": "sandboxes", "zone": "a"}
    assert [t.key for t in spec.tolerations] == ["dedicated"]
    assert spec.pod_labels == {"team": "ml", "tier": "batch"}
    assert spec.pod_annotations == {"note": "template"}
    assert spec.template_ref == TemplateRef(name="t")


@pytest.mark.parametrize(
    ("own", "field", "expected"),
    [
        ({"runtimeClassName": "runc"}, "runtime_class_name", "runc"),
        ({"imagePullPolicy": "Always"}, "image_pull_policy", "Always"),
        ({"paused": True}, "paused", True),
    ],
)
def test_a_scalar_the_sandbox_sets_wins(own: JSON, field: str, expected: object) -> None:
    assert getattr(_merged(own), field) == expected


def test_choosing_an_image_replaces_the_templates_runtime_and_pull_policy() -> None:
    spec = _merged({"image": "example.org/tools:1"})
    assert (spec.image, spec.runtime) == ("example.org/tools:1", None)
    # The pull policy belonged to the template's image, not to this one.
    assert spec.image_pull_policy is None
    spec = _merged({"runtime": "node"})
    assert (spec.runtime, spec.image) == ("node", None)
    spec = _merged({"image": "example.org/tools:1"}, {"image": "example.org/base:2"})
    assert spec.image == "example.org/tools:1"


def test_nested_objects_merge_field_by_field() -> None:
    spec = _merged(
        {
            "resources": {"memory": "4Gi"},
            "workspace": {"size": "8Gi"},
            "lifecycle": {"onIdle": "Delete", "snapshotOnIdle": True},
            "network": {"exposedPorts": [{"name": "web", "port": 8080}]},
        }
    )
    assert (spec.resources.cpu, spec.resources.memory) == ("1", "4Gi")
    assert (spec.workspace.size, spec.workspace.storage_class_name) == ("8Gi", "fast")
    lifecycle = spec.lifecycle
    assert (lifecycle.idle_timeout, lifecycle.paused_timeout) == ("1h", "24h")
    assert (lifecycle.on_idle, lifecycle.snapshot_on_idle) == (OnIdle.DELETE, True)
    assert spec.network.egress is EgressPolicy.NONE
    assert [p.port for p in spec.network.exposed_ports] == [8080]


def test_a_field_set_to_its_default_value_still_overrides_the_template() -> None:
    """Explicit `egress: Internet` / `onIdle: Delete` are choices, not absences."""
    spec = _merged({"network": {"egress": "Internet"}, "lifecycle": {"onIdle": "Delete"}})
    assert spec.network.egress is EgressPolicy.INTERNET
    assert spec.lifecycle.on_idle is OnIdle.DELETE
    assert spec.lifecycle.idle_timeout == "1h"


def test_env_merges_by_name_the_sandbox_winning() -> None:
    spec = _merged({"env": [{"name": "B", "value": "mine"}, {"name": "C", "value": "mine"}]})
    assert [(v.name, v.value) for v in spec.env] == [
        ("A", "template"),
        ("B", "mine"),
        ("C", "mine"),
    ]


def test_maps_merge_by_key_the_sandbox_winning() -> None:
    spec = _merged(
        {
            "nodeSelector": {"zone": "b"},
            "podLabels": {"tier": "interactive", "owner": "ana"},
            "podAnnotations": {"extra": "1"},
        }
    )
    assert spec.node_selector == {"pool": "sandboxes", "zone": "b"}
    assert spec.pod_labels == {"team": "ml", "tier": "interactive", "owner": "ana"}
    assert spec.pod_annotations == {"note": "template", "extra": "1"}


def test_tolerations_of_the_sandbox_replace_the_templates() -> None:
    spec = _merged({"tolerations": [{"key": "gpu", "operator": "Exists"}]})
    assert [t.key for t in spec.tolerations] == ["gpu"]
    assert [t.key for t in _merged({"tolerations": []}).tolerations] == []


def test_without_a_template_the_operator_defaults_apply_as_before() -> None:
    spec = _merged({}, defaults={})
    assert spec.lifecycle.on_idle is OnIdle.DELETE
    assert spec.network.egress is EgressPolicy.INTERNET
    assert spec.workspace.ephemeral is False
    assert spec == SandboxSpec()


def _body(spec: JSON, template: JSON | None) -> JSON:
    return {"spec": spec, "status": {"template": template} if template else {}}


def _use(base: str | None = "t-base-0123456789") -> JSON:
    return {
        "kind": "SandboxTemplate",
        "name": "t",
        "generation": 2,
        "baseSnapshot": base,
        "defaults": {"runtime": "python", "lifecycle": {"idleTimeout": "1h"}},
    }


def test_sandbox_spec_reads_the_recorded_defaults_and_starts_from_the_base() -> None:
    spec = sandbox_spec(_body({"templateRef": {"name": "t"}}, _use()))
    assert spec.runtime == "python"
    assert spec.lifecycle.idle_timeout == "1h"
    assert spec.workspace.from_snapshot == "t-base-0123456789"


def test_sandbox_spec_keeps_the_sandboxs_own_snapshot_and_ephemeral_workspaces() -> None:
    own: JSON = {"templateRef": {"name": "t"}, "workspace": {"fromSnapshot": "mine"}}
    assert sandbox_spec(_body(own, _use())).workspace.from_snapshot == "mine"
    own = {"templateRef": {"name": "t"}, "workspace": {"ephemeral": True}}
    assert sandbox_spec(_body(own, _use())).workspace.from_snapshot is None
    own = {"templateRef": {"name": "t"}}
    assert sandbox_spec(_body(own, _use(base=None))).workspace.from_snapshot is None


def test_sandbox_spec_waits_for_the_record_and_ignores_one_without_a_ref() -> None:
    """Before the template is read there are no defaults to apply; a Sandbox without
    templateRef is exactly its own spec."""
    assert sandbox_spec(_body({"templateRef": {"name": "t"}}, None)).runtime is None
    assert sandbox_spec(_body({"image": "x:1"}, _use())).runtime is None


def _template(spec: JSON, status: JSON | None = None, kind: str = "SandboxTemplate") -> JSON:
    return {
        "kind": kind,
        "metadata": {"name": "t", "generation": 4},
        "spec": spec,
        **({"status": status} if status else {}),
    }


STEPS: JSON = {"setup": [{"name": "venv", "script": "python3 -m venv /workspace/.venv"}]}


def test_setup_hash_follows_the_steps_and_the_fields_they_run_with() -> None:
    def digest(spec: JSON) -> str | None:
        return setup_hash(SandboxTemplateSpec.model_validate(spec))

    assert digest({"description": "no steps"}) is None
    first = digest(STEPS)
    assert first is not None
    assert digest({**STEPS, "description": "other words"}) == first
    assert digest({**STEPS, "sandbox": {"lifecycle": {"idleTimeout": "5m"}}}) == first
    changed = [
        {"setup": [{"name": "venv", "script": "python3 -m venv /workspace/env"}]},
        {"setup": [{"name": "venv", "script": STEPS["setup"][0]["script"], "timeout": "1m"}]},
        {**STEPS, "sandbox": {"image": "example.org/py:3.12"}},
        {**STEPS, "sandbox": {"env": [{"name": "PIP_INDEX_URL", "value": "http://mirror"}]}},
        {**STEPS, "sandbox": {"resources": {"memory": "2Gi"}}},
        {**STEPS, "sandbox": {"workspace": {"size": "4Gi"}}},
    ]
    digests = [digest(spec) for spec in changed]
    assert first not in digests
    assert len(set(digests)) == len(digests)


def test_build_names_fit_a_sandbox_name_and_name_the_digest() -> None:
    names = build_names("a" * 63, "0123456789abcdef")
    assert names["sandbox"] == names["snapshot"]
    assert len(names["sandbox"]) <= 50
    assert names["sandbox"].endswith("-base-0123456789")
    assert build_names("py", "0123456789")["sandbox"] == "py-base-0123456789"


def test_build_log_names_each_step_and_keeps_the_tail() -> None:
    steps = [SetupStep(name="one", script="true"), SetupStep(name="two", script="false")]
    done = {"status": {"phase": "Succeeded", "stdout": "installed\n"}}
    failed = {"status": {"phase": "Failed", "stdout": "no such file\n"}}
    assert build_log(steps, []) is None
    log = build_log(steps, [done, failed])
    assert log == "--- one (Succeeded) ---\ninstalled\n--- two (Failed) ---\nno such file"
    assert build_log(steps, [done, None]) == "--- one (Succeeded) ---\ninstalled"
    noisy = {"status": {"phase": "Succeeded", "stdout": "x" * (3 * LOG_TAIL) + "END"}}
    tail = build_log(steps, [noisy])
    assert tail is not None
    assert len(tail) == LOG_TAIL
    assert tail.endswith("END")


def test_use_of_a_template_without_setup_takes_its_fields() -> None:
    ref = TemplateRef(name="t")
    use, why = use_of(ref, _template({"sandbox": {"runtime": "node"}}))
    assert why == ""
    assert use is not None
    assert (use.kind, use.name, use.generation) == (TemplateKind.NAMESPACED, "t", 4)
    assert SandboxSpec.model_validate(use.defaults).runtime == "node"
    assert use.base_snapshot is None


def _ready(status: str, reason: str, message: str, digest: str | None, base: str | None) -> JSON:
    cond = {"type": "Ready", "status": status, "reason": reason, "message": message}
    return {"conditions": [cond], "setupHash": digest, "baseSnapshot": base}


def test_use_of_a_template_with_setup_waits_for_its_current_base() -> None:
    ref = TemplateRef(name="t")
    digest = setup_hash(SandboxTemplateSpec.model_validate(STEPS))
    assert digest is not None

    use, why = use_of(ref, _template(STEPS))
    assert use is None
    assert "not built yet" in why

    building = _ready("False", "Building", "step venv (1/1) running", digest, None)
    use, why = use_of(ref, _template(STEPS, building))
    assert use is None
    assert "step venv (1/1) running" in why

    failed = _ready("False", "SetupFailed", "step venv (1/1) failed (exit code 2)", digest, None)
    use, why = use_of(ref, _template(STEPS, failed))
    assert use is None
    assert "exit code 2" in why

    # Ready, but for older steps: the base of the current ones is not built yet.
    stale = _ready("True", "TemplateReady", "base snapshot old is ready", "0000000000", "old")
    use, why = use_of(ref, _template(STEPS, stale))
    assert use is None
    assert "not ready" in why

    ready = _ready("True", "TemplateReady", "ready", digest, "t-base-x")
    use, why = use_of(ref, _template(STEPS, ready))
    assert use is not None, why
    assert use.base_snapshot == "t-base-x"


def test_use_of_an_invalid_template_says_why() -> None:
    use, why = use_of(TemplateRef(name="t"), _template({"sandbox": {"runtime": "Not A Label"}}))
    assert use is None
    assert why.startswith("its spec is invalid")


NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def test_paused_deadline_counts_from_the_start_of_the_pause() -> None:
    spec = SandboxSpec.model_validate({"lifecycle": {"pausedTimeout": "2h"}})
    fresh = paused_fields(SandboxStatus(), spec, paused=True, now=NOW)
    assert fresh == {
        "paused_since": "2026-01-02T03:04:05Z",
        "paused_deadline": "2026-01-02T05:04:05Z",
    }
    # A later pass keeps the start (the deadline does not move).
    old = SandboxStatus(paused_since="2026-01-01T00:00:00Z")
    later = paused_fields(old, spec, paused=True, now=NOW)
    assert later["paused_deadline"] == "2026-01-01T02:00:00Z"
    # Paused by the idle policy: counted from then.
    idle = SandboxStatus(idle_paused_at="2026-01-02T00:00:00Z")
    assert paused_fields(idle, spec, paused=True, now=NOW)["paused_since"] == "2026-01-02T00:00:00Z"


def test_no_paused_deadline_without_a_timeout_or_a_pause() -> None:
    untimed = paused_fields(SandboxStatus(), SandboxSpec(), paused=True, now=NOW)
    assert untimed["paused_deadline"] is None
    spec = SandboxSpec.model_validate({"lifecycle": {"pausedTimeout": "2h"}})
    old = SandboxStatus(paused_since="2026-01-01T00:00:00Z", paused_deadline="2026-01-01T02:00:00Z")
    assert paused_fields(old, spec, paused=False, now=NOW) == {
        "paused_since": None,
        "paused_deadline": None,
    }
