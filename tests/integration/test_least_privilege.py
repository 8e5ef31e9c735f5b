"""Least privilege, proven from the API server's audit log.

The whole integration tier runs the operator and the gateway under their own
ServiceAccount tokens, bound to exactly the chart's rules files, against
control planes that log their requests (`devcluster.controlplane.AUDITED_GROUP`).
These tests run after every other test of the tier (the tier's conftest moves
them there) and compare what was used with what is granted:

- nothing used was refused by the authorizer or lies outside the rules files;
- every grant was used, or is written down below with the reason the tier
  cannot use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from devcluster.controlplane import ControlPlane
from tests.grants import Permission, Use, audit_events, granted, service_account, used
from tests.integration.harness import (
    GATEWAY_RULES,
    OPERATOR_NAMESPACE,
    OPERATOR_RULES,
    chart_rules,
)

# ServiceAccount name (as the harness binds it) -> the chart's rules files.
ACCOUNTS: dict[str, Sequence[str]] = {
    "sandbox-operator": OPERATOR_RULES,
    "sandbox-gateway": GATEWAY_RULES,
}

# Grants the integration tier cannot exercise, each with the reason it is
# granted anyway. Keep this short: an entry is a grant no test proves needed.
_NAMESPACED_PEERING = (
    "with watchNamespaces set, Kopf keeps its peering in a KopfPeering of each watched"
    " namespace; the tier's operator watches every namespace (a ClusterKopfPeering)"
)
UNUSED_BY_DESIGN: dict[str, dict[Permission, str]] = {
    "sandbox-operator": {
        Permission("kopf.dev", "kopfpeerings", "", verb): _NAMESPACED_PEERING
        for verb in ("list", "watch", "create", "patch")
    },
    "sandbox-gateway": {},
}

pytestmark = pytest.mark.after_integration_tier


def _uses(control_plane: ControlPlane, archive: Path, account: str) -> dict[Permission, Use]:
    logs = [*control_plane.audit_logs, *sorted(archive.glob("*.log"))]
    assert logs, f"no audit log in {control_plane.logs_dir}: started without one?"
    uses = used(audit_events(logs), service_account(OPERATOR_NAMESPACE, account))
    assert uses, f"the audit log has no request of {account}"
    return uses


def _tier_modules_not_run(session: pytest.Session) -> list[str]:
    here = Path(__file__).parent
    ran = {Path(item.path).name for item in session.items if Path(item.path).parent == here}
    return sorted({p.name for p in here.glob("test_*.py")} - ran)


@pytest.mark.parametrize("account", sorted(ACCOUNTS))
def test_nothing_used_is_missing_from_the_grants(
    control_plane: ControlPlane, audit_archive: Path, repo: Path, account: str
) -> None:
    grants = granted(chart_rules(repo, ACCOUNTS[account]))
    uses = _uses(control_plane, audit_archive, account)
    refused = {str(p): u.refused for p, u in uses.items() if u.refused}
    assert not refused, f"{account} was refused by the authorizer: {refused}"
    beyond = sorted(str(p) for p in set(uses) - grants)
    assert not beyond, f"{account} used permissions its rules files do not name: {beyond}"


@pytest.mark.parametrize("account", sorted(ACCOUNTS))
def test_every_grant_is_used(
    control_plane: ControlPlane,
    audit_archive: Path,
    repo: Path,
    request: pytest.FixtureRequest,
    account: str,
) -> None:
    not_run = _tier_modules_not_run(request.session)
    if not_run:
        pytest.skip(f"needs the whole integration tier in this session; not run: {not_run}")
    grants = granted(chart_rules(repo, ACCOUNTS[account]))
    uses = _uses(control_plane, audit_archive, account)
    excused = UNUSED_BY_DESIGN[account]
    unused = sorted(str(p) for p in grants - set(uses) - set(excused))
    assert not unused, f"{account} is granted what the whole tier never used: {unused}"
    stale = sorted(str(p) for p in set(excused) & set(uses))
    assert not stale, f"excused as unused, but used: {stale}"
