"""The agent's error codes are one list (``errors.CODES``): every code it
answers with is listed there, with the status it comes with, and nothing else is.

What keeps a raise from using a code that is not listed is its type: ``code``
is ``errors.Code`` (a ``Literal`` of the list) wherever a code is taken, so
mypy --strict (``make lint``) refuses an unlisted literal and any plain ``str``,
however it was built. The tests below check that the type is the list and is
where codes are taken, and read the source for what a type cannot say: the
status of each kind of error raised with a code, that no code is built on the
spot, that no code is listed for nothing, and that the codes the README names
are listed with the status it gives them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import get_args, get_type_hints

import pytest

import sandbox_agent
from sandbox_agent import app, errors, httpserver, models, openapi, paths
from sandbox_agent.routes import OPS

PACKAGE = Path(sandbox_agent.__file__).parent
SOURCES = {
    p.name: ast.parse(p.read_text()) for p in sorted(PACKAGE.glob("*.py")) if p.name != "errors.py"
}
LISTED: dict[str, errors.Listed] = {str(code): entry for code, entry in errors.CODES.items()}
# The error kinds by name, as raise sites spell them (`Invalid(...)`, `errors.Invalid(...)`).
KINDS = {
    name: kind
    for name, kind in vars(errors).items()
    if isinstance(kind, type)
    and issubclass(kind, errors.AgentError)
    and kind is not errors.AgentError
}


def test_the_type_lists_the_codes_of_the_registry() -> None:
    assert list(get_args(errors.Code)) == list(errors.CODES)
    assert list(errors.CODES) == sorted(errors.CODES)
    for code, (status, meaning) in errors.CODES.items():
        assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", code), code
        assert re.fullmatch(r"4xx|[1-5]\d\d(, [1-5]\d\d)*", status), (code, status)
        assert meaning[:1].isupper() and meaning.endswith("."), (code, meaning)


@pytest.mark.parametrize(
    ("function", "parameter"),
    [
        (errors.AgentError.__init__, "code"),
        (errors.error_body, "code"),
        (paths._refuse, "code"),
        (httpserver._error, "code"),
    ],
)
def test_codes_are_taken_as_the_listed_type(function: object, parameter: str) -> None:
    """Where a code is a parameter, it has the type of the list: mypy then
    checks every caller, including those that pass a variable."""
    assert get_type_hints(function)[parameter] == errors.Code


def test_the_error_body_model_and_the_edge_tables_use_the_type() -> None:
    assert get_type_hints(models.ErrorDetail)["code"] == errors.Code
    assert get_type_hints(app)["_HTTP_CODES"] == dict[int, errors.Code]


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _raised_with_kind() -> list[tuple[str, int, str, str | None]]:
    """(module, line, kind, code) of every literal code given with a known kind:
    `Kind("code", ...)` and the `(Kind, "code")` pairs of errno tables. A code
    that is not a literal is a variable (mypy knows its type), never built on
    the spot: its line is listed with the code None."""
    found: list[tuple[str, int, str, str | None]] = []
    for module, tree in SOURCES.items():
        for node in ast.walk(tree):
            pair: tuple[ast.expr, ast.expr] | None = None
            if isinstance(node, ast.Call) and node.args:
                pair = (node.func, node.args[0])
            elif isinstance(node, ast.Tuple) and len(node.elts) == 2:
                pair = (node.elts[0], node.elts[1])
            if pair is None or _name(pair[0]) not in KINDS:
                continue
            code = pair[1]
            if isinstance(code, ast.Constant) and isinstance(code.value, str):
                found.append((module, code.lineno, str(_name(pair[0])), code.value))
            elif not isinstance(code, ast.Name):
                found.append((module, code.lineno, str(_name(pair[0])), None))
    return found


def test_the_scan_finds_the_raises() -> None:
    found = {(module, kind, code) for module, _, kind, code in _raised_with_kind()}
    assert ("web.py", "TooLarge", "body_too_large") in found
    assert ("files.py", "NoSpace", "quota_exceeded") in found  # an errno table's pair
    assert len(found) > 80


def test_every_raise_has_a_listed_code_and_its_status() -> None:
    for module, line, kind, code in _raised_with_kind():
        where = f"{module}:{line}: {kind}({code!r})"
        assert code is not None, f"{module}:{line}: {kind}(...) with a code built on the spot"
        assert code in LISTED, f"{where}: not in errors.CODES"
        status, listed = str(app.STATUS[KINDS[kind]]), LISTED[code].status
        assert status in listed.split(", "), f"{where} answers {status}; CODES says {listed}"


def test_every_listed_code_is_used() -> None:
    """A code nothing answers with any more leaves the list (and the document)."""
    literals = {
        node.value
        for tree in SOURCES.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    assert not set(errors.CODES) - literals


def test_the_document_lists_every_code_with_its_meaning() -> None:
    schema = openapi.document(OPS)["components"]["schemas"]["ErrorDetail"]["properties"]["code"]
    assert schema["enum"] == list(errors.CODES)
    assert schema["x-enum-descriptions"] == [
        f"{e.status}: {e.meaning}" for e in errors.CODES.values()
    ]
    for code, entry in errors.CODES.items():
        assert f"| `{code}` | {entry.status} | {entry.meaning} |" in schema["description"]


def test_the_edges_answer_as_before() -> None:
    """Answers the edges build themselves are the bytes they always were."""
    assert (
        httpserver._INTERNAL_ERROR
        == b'{"error":{"code":"internal_error","message":"internal error"}}'
    )
    assert (
        httpserver._error("bad_http", "malformed HTTP request")
        == b'{"error":{"code":"bad_http","message":"malformed HTTP request"}}'
    )
    err = errors.NotFound("not_found", "gone", path="x")
    assert err.body() == {
        "error": {"code": "not_found", "message": "gone", "details": {"path": "x"}}
    }
    assert errors.Invalid("invalid_request", "no").body() == {
        "error": {"code": "invalid_request", "message": "no"}
    }


def test_the_readme_names_listed_codes_with_their_status() -> None:
    """The README names codes in its prose ("409 `stdin_closed`", "400
    `path_traversal`/`invalid_path`"), not as a list; each is a listed code
    answered with that status."""
    readme = (PACKAGE.parents[1] / "README.md").read_text()
    named = re.findall(r"\b([1-5]\d\d) ((?:`[a-z_]+`/?)+)", readme)
    assert len(named) > 30
    for status, codes in named:
        for code in re.findall(r"`([a-z_]+)`", codes):
            assert code in LISTED, f"README: {status} `{code}` is not in errors.CODES"
            assert status in LISTED[code].status.split(", "), f"README: {status} `{code}`"
