"""The chart's Argo CD health script, run by gopher-lua (the interpreter Argo CD
embeds, devcluster/lua) against objects captured from a real node in every
phase (tests/e2e/test_health_e2e.py writes them with SANDBOX_HEALTH_CAPTURE=1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from devcluster import luahealth
from tests import health


def test_every_case_has_a_captured_object() -> None:
    captured = {path.stem for path in health.FIXTURES.glob("*.json")}
    assert captured == set(health.EXPECTED)


@pytest.mark.parametrize("case", sorted(health.EXPECTED))
def test_captured_object_health(case: str) -> None:
    body = health.load(case)
    assert body["kind"] == health.kind_of(case)
    [result] = luahealth.evaluate([body])
    assert result.status == health.EXPECTED[case], result
    assert result.message


def test_status_of_an_older_generation_is_progressing() -> None:
    body = health.load("sandbox-running")
    body["metadata"]["generation"] = body["status"]["observedGeneration"] + 1
    [result] = luahealth.evaluate([body])
    assert result.status == "Progressing"
    assert "observe generation" in result.message


def test_objects_without_status_are_progressing() -> None:
    for kind in ("Sandbox", "Execution", "Snapshot"):
        body = {"kind": kind, "metadata": {"name": "x", "generation": 1}}
        assert luahealth.evaluate([body])[0].status == "Progressing"


def test_a_failed_phase_without_stalled_is_degraded() -> None:
    """Statuses written by operators before Stalled existed."""
    body = health.load("execution-failed")
    body["status"]["conditions"] = [
        c for c in body["status"]["conditions"] if c["type"] != "Stalled"
    ]
    assert luahealth.evaluate([body])[0].status == "Degraded"


def test_the_runner_has_argo_cds_libraries_only(tmp_path: Path) -> None:
    """Argo CD opens base, table and package for argocd-cm scripts: a script
    that leans on the string library must fail here as it would there."""
    uses_string = tmp_path / "string.lua"
    uses_string.write_text('return {status = string.upper("healthy")}\n')
    with pytest.raises(RuntimeError, match="non-table object"):
        luahealth.evaluate([{}], uses_string)
    plain = tmp_path / "plain.lua"
    plain.write_text(
        'local t = {} table.insert(t, "ok") return {status = "Healthy", message = t[1]}\n'
    )
    assert luahealth.evaluate([{}], plain) == [luahealth.Health("Healthy", "ok")]
    invalid = tmp_path / "invalid.lua"
    invalid.write_text('return {status = "Fine"}\n')
    with pytest.raises(RuntimeError, match="invalid health status"):
        luahealth.evaluate([{}], invalid)
