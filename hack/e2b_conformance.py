"""Run E2B's own SDK test suites against this operator's E2B adapter.

    python hack/e2b_conformance.py e2b CHECKOUT [--select tests/sync] [-- PYTEST_ARGS...]
    python hack/e2b_conformance.py code-interpreter CHECKOUT [--select ...] [-- PYTEST_ARGS...]

CHECKOUT is a checkout of e2b-dev/E2B (its `packages/python-sdk/tests` run)
or of e2b-dev/code-interpreter (`python/tests`), ideally at the tag of the
SDK version pinned here; nothing of it is copied into this repository. The
suites run in a virtualenv of their own under the build cache
(~/.cache/sandbox-operator, or SANDBOX_CACHE_DIR),
with the pinned SDK from PyPI and the suites' test dependencies, against
`E2B_API_URL` / `E2B_SANDBOX_URL` / `E2B_API_KEY` (by default: the E2B port of
the `make up` cluster's gateway and a token of its `sandbox-demo`
ServiceAccount).

The report is one line per test file: passed, failed, skipped, and why its
failures fail when a category explains them (something the adapter does not
offer: template builds, volumes, secrets, memory snapshots, fork, network
policy knobs, sudo, file metadata; or a test that assumes E2B's own cloud),
then every failure no category explains. Categories are reported, never
hidden: their tests run like the others.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import venv
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from devcluster import build  # noqa: E402

CACHE = build.cache_root() / "e2b-conformance"

# The SDK versions the adapter is checked against (tests/e2e pins the same).
E2B = "e2b==2.63.0"
CODE_INTERPRETER = "e2b-code-interpreter==2.11.5"
TEST_DEPENDENCIES = (
    "pytest>=9,<10",
    "pytest-asyncio>=1.3,<2",
    "pytest-timeout>=2.4,<3",
    "pytest-xdist>=3.3,<4",
    "python-dotenv>=1,<2",
    "pytest-dotenv>=0.5,<0.6",
)
SUITES = {
    "e2b": ("packages/python-sdk", (E2B,)),
    "code-interpreter": ("python", (E2B, CODE_INTERPRETER)),
}
# What E2B offers that the adapter does not, or what a test assumes of E2B's
# own cloud (docs/e2b.md, "What differs"): fragments of test ids (file::name),
# first match wins -> why such a test is expected to fail.
CATEGORIES = (
    ("template", "template builds (templates are SandboxTemplates here)"),
    ("volume", "E2B volumes"),
    ("secret", "E2B secrets"),
    ("snapshot", "E2B snapshots (memory and the snapshot API)"),
    ("keep_memory", "memory snapshots"),
    ("filesystem_only_reboots", "memory snapshots (a resume is a reboot here)"),
    ("auto_resume", "auto-resume on traffic (resume is connect)"),
    ("fork", "fork"),
    ("network", "network policy knobs"),
    ("internet_access", "network policy knobs"),
    ("egress", "network policy knobs"),
    ("scoped_env_vars", "sudo (Pod Security restricted)"),
    ("sudo", "sudo (Pod Security restricted)"),
    ("mcp", "the MCP gateway (runs as root)"),
    ("metadata", "file metadata (xattrs)"),
    ("entry_details", "modes and owners (group-writable files, the agent's own user)"),
    ("mixed_entries", "modes and owners (group-writable files, the agent's own user)"),
    ("get_info_of_", "modes and owners (group-writable files, the agent's own user)"),
    ("test_secured", "signed URLs by E2B_SANDBOX_URL (the URL names no sandbox; hosts do)"),
    ("test_host.py", "hosts {port}-{id}.<domain> (need a wildcard DNS name)"),
    ("test_file_symlink", "a test older than the pinned SDK (2.63 reports a symlink as one)"),
    ("stable_host_routing", "a client-side test that assumes E2B's cloud (no E2B_SANDBOX_URL)"),
    ("normalizes_unset_tokens", "a client-side test of the v1 connect (the SDK uses v2)"),
    ("tests/charts/", "chart data from figures (a figure comes as PNG)"),
    ("test_data.py", "data extracted from DataFrames (a DataFrame comes as HTML and text)"),
    ("esm_imports", "JavaScript: `import` (a Node.js REPL: `require`)"),
    ("top_level_await", "JavaScript: a cell with top-level await has no value"),
    ("typescript", "a TypeScript kernel (Python and JavaScript run)"),
    ("ts_kernel", "a TypeScript kernel (Python and JavaScript run)"),
    ("_r_kernel", "an R kernel (not in the image)"),
    ("cwd_r", "an R kernel (not in the image)"),
    ("with_options", "a context outside the workspace (cwd /root)"),
    ("test_bash", "a bash kernel (Python and JavaScript run)"),
    ("cwd_bash", "a bash kernel (Python and JavaScript run)"),
    ("java", "a Java kernel (not in the image)"),
    ("test_r.py", "an R kernel (not in the image)"),
    ("systemd", "systemd (no init system in a pod)"),
)


def category(test_id: str) -> str:
    for fragment, why in CATEGORIES:
        if fragment in test_id:
            return why
    return ""


def environment(venv_dir: Path, packages: tuple[str, ...]) -> Path:
    """A virtualenv with `packages` and the test dependencies, made once per set."""
    python = venv_dir / "bin" / "python"
    marker = venv_dir / ".installed"
    wanted = "\n".join((*packages, *TEST_DEPENDENCIES))
    if not marker.exists() or marker.read_text() != wanted:
        venv.create(venv_dir, with_pip=True, clear=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *packages, *TEST_DEPENDENCIES], check=True
        )
        marker.write_text(wanted)
    return python


def _cluster_defaults() -> dict[str, str]:
    """E2B_API_URL and E2B_API_KEY of the `make up` cluster, unless already set."""
    from devcluster import deploy
    from devcluster.cluster import LocalCluster

    cluster = LocalCluster("local")
    out: dict[str, str] = {}
    if "E2B_API_URL" not in os.environ:
        service = deploy.kubectl(
            cluster,
            "get",
            "service",
            "-n",
            deploy.NAMESPACE,
            f"{deploy.RELEASE}-gateway",
            "-o",
            "jsonpath={.spec.clusterIP} {.spec.ports[?(@.name=='e2b')].port}",
        )
        ip, _, port = service.stdout.strip().partition(" ")
        if service.returncode != 0 or not port:
            raise SystemExit(
                "the gateway Service has no `e2b` port: is the cluster up (`make up`)"
                " with gateway.e2b.enabled? Or set E2B_API_URL."
            )
        out["E2B_API_URL"] = f"http://{ip}:{port}"
    if "E2B_API_KEY" not in os.environ:
        token = deploy.kubectl(cluster, "create", "token", "sandbox-demo", "--duration=4h")
        if token.returncode != 0:
            raise SystemExit(f"no token for sandbox-demo: {token.stderr}")
        out["E2B_API_KEY"] = token.stdout.strip()
    return out


def report(junit: Path) -> tuple[list[str], int]:
    """Lines of the per-file table, and how many failed tests no category explains."""
    per_file: dict[str, Counter[str]] = {}
    reasons: dict[str, set[str]] = {}
    unexplained: list[str] = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = (case.get("file") or case.get("classname", "").replace(".", "/") + ".py").strip()
        test_id = f"{name}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        per_file.setdefault(name, Counter())[outcome] += 1
        if outcome == "failed":
            why = category(test_id)
            reasons.setdefault(name, set()).add(why or "UNEXPECTED")
            if not why:
                unexplained.append(test_id)
    lines = [
        f"| {'test file':62} | pass | fail | skip | why the failures fail |",
        f"| {'-' * 62} | ---: | ---: | ---: | --- |",
    ]
    for name in sorted(per_file):
        counts = per_file[name]
        why = "; ".join(sorted(reasons.get(name, set())))
        lines.append(
            f"| {name[:62]:62} | {counts['passed']:4} | {counts['failed']:4}"
            f" | {counts['skipped']:4} | {why} |"
        )
    total = sum(per_file.values(), Counter())
    lines.append(
        f"\n{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped in"
        f" {len(per_file)} files; {len(unexplained)} failures no category explains:"
    )
    lines.extend(f"  {test_id}" for test_id in unexplained)
    return lines, len(unexplained)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("checkout", type=Path, help="a checkout of the suite's repository")
    parser.add_argument(
        "--select",
        action="append",
        help="a test directory or file of the suite to run (repeatable; default: all of tests/)",
    )
    argv = sys.argv[1:] if argv is None else argv
    # Everything after `--` goes to pytest as it is.
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    package, packages = SUITES[args.suite]
    root = args.checkout.resolve() / package
    if not (root / "tests").is_dir():
        parser.error(f"{root / 'tests'} does not exist: is {args.checkout} the right checkout?")
    key = hashlib.sha256(args.suite.encode()).hexdigest()[:8]
    python = environment(CACHE / f"venv-{args.suite}-{key}", packages)
    env = {**os.environ, **_cluster_defaults()}
    env.setdefault("E2B_SANDBOX_URL", env["E2B_API_URL"])
    env.setdefault("E2B_DOMAIN", "e2b.local")
    # The pinned SDK from PyPI is what is judged, not the checkout's own source
    # next to its tests: the working directory stays off sys.path.
    env["PYTHONSAFEPATH"] = "1"
    junit = CACHE / f"{args.suite}.xml"
    run = subprocess.run(
        [
            str(python),
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            f"--junitxml={junit}",
            "-o",
            "junit_family=xunit1",
            *(args.select or ["tests"]),
            *extra,
        ],
        cwd=root,
        env=env,
        check=False,
    )
    if not junit.exists():
        return run.returncode or 1
    lines, unexpected = report(junit)
    print("\n".join(lines))
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
