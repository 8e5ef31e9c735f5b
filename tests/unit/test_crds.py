"""The CRD files are generated from the models and must never drift."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sandbox_operator.api import generate
from sandbox_operator.api.crd import KINDS, all_crds


def test_checked_in_crds_match_the_models(repo: Path) -> None:
    stale = generate.stale_files(repo)
    assert stale == [], f"run `make crds`; stale: {stale}"


def test_stale_detection_notices_a_hand_edit(tmp_path: Path) -> None:
    generate.write(tmp_path)
    assert generate.stale_files(tmp_path) == []
    victim = tmp_path / "charts/sandbox-operator/crds/sandboxes.sandbox.dev.yaml"
    victim.write_text(victim.read_text().replace("maxLength: 63", "maxLength: 64"))
    assert generate.stale_files(tmp_path) == [victim]


def _walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, schema)]
    for name, sub in (schema.get("properties") or {}).items():
        found += _walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        found += _walk(schema["items"], f"{path}[]")
    return found


@pytest.mark.parametrize("name", sorted(all_crds()))
def test_schemas_are_structural(name: str) -> None:
    """Every node has a type (or is int-or-string), and no pydantic idiom leaks."""
    crd = all_crds()[name]
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "$ref" not in node, path
        assert "title" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert "type" in node, f"{name}{path} has no type"
            assert "anyOf" not in node, path
    assert yaml.safe_dump(crd)  # serialisable as plain YAML


def test_every_kind_has_status_subresource_columns_and_category() -> None:
    for kind in KINDS:
        crd = all_crds()[f"{kind.plural}.sandbox.dev.yaml"]
        version = crd["spec"]["versions"][0]
        assert version["subresources"]["status"] == {}
        assert ("scale" in version["subresources"]) == (kind.scale is not None), kind.kind
        assert version["additionalPrinterColumns"]
        assert crd["spec"]["names"]["categories"] == ["sandbox-all"]
        assert crd["spec"]["names"]["shortNames"]


@pytest.mark.parametrize("name", sorted(all_crds()))
def test_every_field_is_described(name: str) -> None:
    """`kubectl explain` shows each field's description; none may be blank."""
    crd = all_crds()[name]
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    for root in ("spec", "status"):
        for path, node in _walk(spec[root], root):
            if path.endswith("[]"):
                continue  # a list's items are described by the list
            assert node.get("description"), f"{name}: {path} has no description"
