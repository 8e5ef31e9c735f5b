"""Argo CD resource health scripts (charts/sandbox-operator/files/health/*.lua)
evaluated by the Lua interpreter Argo CD embeds: gopher-lua, built from its Go
module at the pinned version like the other Go tools (devcluster/lua/)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devcluster import build, phases, versions

SOURCE = Path(__file__).resolve().parent / "lua"
CHART = Path(__file__).resolve().parent.parent / "charts" / "sandbox-operator"
SCRIPTS = CHART / "files" / "health"


def binary(*, build_missing: bool = True) -> Path:
    """The runner (a few seconds to build once gopher-lua is downloaded)."""
    return build.go_source_binaries(
        "luahealth",
        SOURCE,
        {versions.GOPHER_LUA_MODULE: versions.GOPHER_LUA},
        ["luahealth"],
        build_missing=build_missing,
    )["luahealth"]


@dataclass(frozen=True)
class Health:
    status: str
    message: str


# One script for the three kinds (it reads obj.kind where they differ).
SCRIPT = SCRIPTS / "sandbox.dev.lua"


def evaluate(objects: Sequence[dict[str, Any]], script: Path = SCRIPT) -> list[Health]:
    """The health Argo CD would show for each object. A script that fails on an
    object raises (Argo CD would show an error instead of a health)."""
    done = subprocess.run(
        [str(binary()), str(script)],
        input=json.dumps(list(objects)),
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"luahealth: {done.stderr.strip()}")
    results: list[dict[str, str]] = json.loads(done.stdout)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"the health script failed: {errors}")
    return [Health(r.get("status", ""), r.get("message", "")) for r in results]


if __name__ == "__main__":
    # `make binaries`: a phase of CI's table when SANDBOX_CI_PHASES is set.
    with phases.phase("binaries: luahealth (gopher-lua)"):
        print(binary())
