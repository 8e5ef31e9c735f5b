"""Models parse what users write and refuse what they must not."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import ValidationError

from sandbox_operator import config
from sandbox_operator.api.common import parse_duration, quantity_value
from sandbox_operator.api.execution import ExecutionSpec
from sandbox_operator.api.sandbox import SandboxSpec


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("1h30m", 5400), ("250ms", 0.25), ("2h", 7200)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "10", "5d", "-1m", "1.5h", "m"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


def test_quantities_accept_integers_and_strings() -> None:
    spec = SandboxSpec.model_validate({"resources": {"cpu": 2, "memory": "512Mi"}})
    assert spec.resources.cpu == "2"
    assert quantity_value(spec.resources.memory or "") == 512 * 1024 * 1024


@pytest.mark.parametrize("bad", ["-1", "1 Gi", "lots", True])
def test_bad_quantities(bad: object) -> None:
    with pytest.raises(ValidationError):
        SandboxSpec.model_validate({"resources": {"memory": bad}})


def test_spec_round_trips_in_camel_case() -> None:
    wire = {
        "runtime": "python",
        "workspace": {"size": "2Gi", "storageClassName": "fast"},
        "lifecycle": {"idleTimeout": "10m", "onIdle": "Pause"},
        "network": {"egress": "None", "exposedPorts": [{"name": "web", "port": 8000}]},
    }
    spec = SandboxSpec.model_validate(wire)
    out = spec.to_wire()
    assert out["workspace"] == {"ephemeral": False, "size": "2Gi", "storageClassName": "fast"}
    assert out["lifecycle"]["onIdle"] == "Pause"
    assert out["network"]["exposedPorts"][0] == {
        "name": "web",
        "port": 8000,
        "protocol": "TCP",
        "public": False,
    }


def test_unknown_fields_are_refused_in_code() -> None:
    with pytest.raises(ValidationError, match="extra"):
        SandboxSpec.model_validate({"runtim": "python"})


def test_execution_defaults() -> None:
    spec = ExecutionSpec.model_validate({"sandboxRef": {"name": "a"}, "command": ["true"]})
    assert spec.timeout == "3m"
    assert spec.cancel is False


def test_settings_from_file_and_environment(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "settings.yaml"
    path.write_text("agent_image: agent:1\nruntimes:\n  py: {image: 'py:3'}\ndefault_runtime: py\n")
    settings = config.load(
        {
            "SANDBOX_OPERATOR_CONFIG": str(path),
            "SANDBOX_OPERATOR_RECONCILE_INTERVAL_SECONDS": "2.5",
            "SANDBOX_OPERATOR_DEFAULT_IDLE_TIMEOUT": "null",
        }
    )
    assert settings.agent_image == "agent:1"
    assert settings.runtimes["py"].image == "py:3"
    assert settings.reconcile_interval_seconds == 2.5
    assert settings.default_idle_timeout is None


def test_settings_refuse_typos(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "settings.yaml"
    path.write_text("agent_imag: x\n")
    with pytest.raises(ValidationError, match="agent_imag"):
        config.load({"SANDBOX_OPERATOR_CONFIG": str(path)})
