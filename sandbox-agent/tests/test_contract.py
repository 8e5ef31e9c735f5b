"""The OpenAPI contract: checked in, served, and fuzzed against the live agent."""

from __future__ import annotations

import ast
import io
import json
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from conftest import Sandbox, make_sandbox
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from sandbox_agent import __version__, openapi
from sandbox_agent import runner as runner_module
from sandbox_agent.routes import OPS

CHECKED_IN = Path(__file__).resolve().parents[1] / "openapi.json"


def test_checked_in_openapi_is_current() -> None:
    assert CHECKED_IN.read_text() == openapi.render(OPS), (
        "sandbox-agent/openapi.json is stale: run "
        "`python -m sandbox_agent.openapi > sandbox-agent/openapi.json`"
    )


def test_served_openapi_matches_checked_in(sandbox: Sandbox) -> None:
    served = sandbox.client.get("/openapi.json").json()
    assert served == json.loads(CHECKED_IN.read_text())
    assert served["info"]["version"] == __version__


def test_every_route_is_documented(sandbox: Sandbox) -> None:
    doc = openapi.document(OPS)
    for op in OPS:
        assert op.method.lower() in doc["paths"][op.path], op.path
    # and every documented operation is fuzzed below
    assert len(FUZZ_OPERATIONS) == len(OPS)


def test_runner_is_stdlib_only_and_py39_syntax() -> None:
    source = Path(runner_module.__file__).read_text()
    tree = ast.parse(source, feature_version=(3, 9))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "the runner must not use relative imports"
            imported.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.Match):
            raise AssertionError("match statements need Python 3.10")
    imported.discard("__future__")
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
    assert "from __future__ import annotations" in source  # PEP 604 hints stay unevaluated


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    # Random commands run as nobody, with short timeouts, in their own sandbox.
    import os
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="sandbox-agent-fuzz-"))
    os.chmod(root, 0o755)
    sb = make_sandbox(
        root / "sb",
        env={"SANDBOX_AGENT_MAX_TIMEOUT": "3", "SANDBOX_AGENT_DEFAULT_TIMEOUT": "2"},
        runner=False,
    )
    os.chmod(sb.root, 0o755)
    sb.start_runner(user=65534)
    yield sb
    sb.stop()
    shutil.rmtree(root, ignore_errors=True)


def _tiny_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        ti = tarfile.TarInfo("fuzz.txt")
        ti.size = 2
        tar.addfile(ti, io.BytesIO(b"hi"))
    return buf.getvalue()


# Tar uploads: random bytes (invalid archives) and a valid archive.
schemathesis.openapi.media_type(
    "application/x-tar", st.one_of(st.binary(max_size=2048), st.just(_tiny_tar()))
)

# No 5xx, and every answer is one the document declares (status, media type,
# body schema). Checks about which valid inputs must succeed do not fit a
# filesystem API (a schema-valid path may simply not exist), so they are off.
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

# The checked-in document is what is fuzzed (test_served_openapi_matches_checked_in
# proves the agent serves the same one); loading it at import lets every
# operation be its own test case.
FUZZ_SCHEMA = schemathesis.openapi.from_dict(json.loads(CHECKED_IN.read_text()))
FUZZ_OPERATIONS = {
    f"{op.method.upper()} {op.path}": op
    for op in (r.ok() for r in FUZZ_SCHEMA.get_all_operations() if isinstance(r, Ok))
}


def bounded(case: Any) -> None:
    """A watch that is answered 200 streams until its client leaves, which a
    fuzzing client reading whole answers never does: it gets a time limit."""
    if case.path == "/v1/files/watch":
        case.query = {**(case.query or {}), "timeoutSeconds": 0.5}


@pytest.mark.parametrize("label", sorted(FUZZ_OPERATIONS))
def test_fuzz_no_server_errors(label: str, fuzz_target: Sandbox) -> None:
    operation = FUZZ_OPERATIONS[label]
    auth = {"Authorization": f"Bearer {fuzz_target.token}"}
    seen: list[int] = []

    @given(case=operation.as_strategy())
    @settings(
        max_examples=100,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )
    def run(case: Any) -> None:
        bounded(case)
        response = case.call(base_url=fuzz_target.base_url, headers=auth, timeout=30)
        seen.append(response.status_code)
        case.validate_response(response, checks=CHECKS)
        assert response.status_code < 500, (response.status_code, response.text[:500])

    run()
    assert seen, "no request was generated"


def test_fuzzed_agent_still_healthy(fuzz_target: Sandbox) -> None:
    assert fuzz_target.anon.get("/readyz").status_code == 200
    ex = fuzz_target.sh("echo alive")
    assert ex["stdout"] == "alive\n", ex
    ws_mode = fuzz_target.workspace.stat().st_mode & 0o7777
    assert ws_mode == 0o777, oct(ws_mode)
    assert "Traceback" not in fuzz_target.agent_log(), fuzz_target.agent_log()


def test_stateful_sequences_no_server_errors(fuzz_target: Sandbox) -> None:
    """Sequences of calls that feed answers into later calls (links inferred
    from the document: an execution started, then read, streamed, signalled,
    fed stdin, cancelled, deleted...): still no 5xx and no undocumented answer."""
    schema = schemathesis.openapi.from_dict(json.loads(CHECKED_IN.read_text()))
    auth = {"Authorization": f"Bearer {fuzz_target.token}"}
    seen: list[tuple[str, int]] = []

    def same_start() -> None:
        """Every sequence starts from the same executions (three finished ones
        for the links to find): hypothesis replays prefixes of earlier
        sequences and requires them to draw alike, which answers that depend
        on what earlier sequences left behind would break."""
        for ex in fuzz_target.client.get("/v1/executions").json()["executions"]:
            if ex["status"] == "running":
                fuzz_target.wait_finished(ex["id"], timeout=10)
            fuzz_target.client.delete(f"/v1/executions/{ex['id']}")
        for _ in range(3):
            fuzz_target.sh("true")
        # Code contexts too: one left by an earlier sequence (or eight: the
        # cap) would change what a later one's calls answer.
        for ctx in fuzz_target.client.get("/v1/contexts").json()["contexts"]:
            fuzz_target.client.delete(f"/v1/contexts/{ctx['id']}")
        # And watchers (eight at most, kept between calls).
        for kept in fuzz_target.client.get("/v1/files/watchers").json()["watchers"]:
            fuzz_target.client.delete(f"/v1/files/watchers/{kept['id']}")

    class Workflow(schema.as_state_machine()):  # type: ignore[misc]
        def setup(self) -> None:
            same_start()

        def before_call(self, case: Any) -> None:
            # Generated security headers would replace ours: the token wins.
            case.headers = {**(case.headers or {}), **auth}
            bounded(case)

        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"base_url": fuzz_target.base_url, "timeout": 30}

        def validate_response(self, response: Any, case: Any, *args: Any, **kwargs: Any) -> None:
            seen.append((f"{case.method} {case.path}", response.status_code))
            try:
                case.validate_response(response, checks=CHECKS)
                assert response.status_code < 500, (response.status_code, response.text[:500])
            except BaseException as exc:
                failures.append(
                    f"{case.method} {case.formatted_path} -> {response.status_code}"
                    f" {response.text[:300]!r}: {exc!r}"[:2000]
                )
                raise

    failures: list[str] = []
    try:
        Workflow.run(
            settings=settings(
                # Enough sequences that some reach an execution through a link
                # among the API's 50-odd operations.
                max_examples=80,
                stateful_step_count=6,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
                # The server's state differs between runs of a sequence, so a
                # failure is reported as found, not shrunk by replaying it.
                phases=[Phase.explicit, Phase.generate],
            )
        )
    except Exception as exc:
        # A failure's replay draws differently when the server's state moved on
        # (hypothesis then reports its own FlakyStrategyDefinition): say what failed.
        if failures:
            raise AssertionError(f"first failure: {failures[0]}") from exc
        raise
    # Some sequence reached an execution through a link (an id from an answer).
    assert any(
        label.startswith(("GET /v1/executions/{id}", "POST /v1/executions/{id}")) and status == 200
        for label, status in seen
    ), sorted(set(seen))
