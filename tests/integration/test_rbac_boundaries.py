"""What the operator and the gateway must not do, asked of the real authorizer.

The chart's RBAC objects, rendered as `helm template` renders them, are applied
to the control plane under a release of their own; SubjectAccessReviews then
ask, as each ServiceAccount, the questions that matter when a sandbox's code
or a compromised component turns against the cluster. Each matrix carries a
few things the account must be able to do, so a review that asks about the
wrong user cannot pass by denying everything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from devcluster.controlplane import ControlPlane
from tests.integration.conftest import kubectl
from tests.integration.test_chart import render
from tests.kube import ApiError, KubeJSON, api_path, core_path

RELEASE, NAMESPACE = "lp", "lp-system"
WATCHED, OTHER = "lp-team-a", "lp-elsewhere"
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


class Ask(NamedTuple):
    verb: str
    resource: str
    namespace: str = ""
    group: str = ""
    subresource: str = ""

    def review(self, user: str) -> dict[str, Any]:
        attributes = {
            "verb": self.verb,
            "resource": self.resource,
            "group": self.group,
            "subresource": self.subresource,
            "namespace": self.namespace,
        }
        groups = ["system:serviceaccounts", f"system:serviceaccounts:{NAMESPACE}"]
        return {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": user,
                "groups": [*groups, "system:authenticated"],
                "resourceAttributes": attributes,
            },
        }


RBAC = "rbac.authorization.k8s.io"
# Neither account may do any of these, in any namespace mode.
NEVER = [
    *(
        Ask(v, "pods", WATCHED, subresource=s)
        for v in ("create", "get")
        for s in ("exec", "attach")
    ),
    Ask("create", "pods", WATCHED, subresource="portforward"),
    Ask("get", "nodes", subresource="proxy"),
    *(Ask(v, r, group=RBAC) for v in ("escalate", "bind") for r in ("clusterroles", "roles")),
    *(Ask(v, r, WATCHED, group=RBAC) for v in ("escalate", "bind") for r in ("roles",)),
    *(Ask("create", r, group=RBAC) for r in ("clusterroles", "clusterrolebindings")),
    Ask("create", "rolebindings", WATCHED, group=RBAC),
    *(Ask("impersonate", r) for r in ("users", "groups", "serviceaccounts")),
    Ask("impersonate", "userextras", group="authentication.k8s.io"),
    Ask("create", "serviceaccounts", WATCHED, subresource="token"),
    Ask("update", "customresourcedefinitions", group="apiextensions.k8s.io"),
    Ask("delete", "namespaces"),
    Ask("create", "certificatesigningrequests", group="certificates.k8s.io"),
]
# With watchNamespaces set: no Secret outside the watched namespaces, including
# the chart's own namespace (the gateway's signing keys live there, mounted).
SECRETS_OUTSIDE = [
    Ask(verb, "secrets", namespace)
    for namespace in ("kube-system", "default", NAMESPACE, OTHER)
    for verb in ("get", "list", "watch")
]
OPERATOR = f"system:serviceaccount:{NAMESPACE}:{RELEASE}"
GATEWAY = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-gateway"
# What each must be able to do (with watchNamespaces set): the controls.
MUST = {
    OPERATOR: [
        Ask("create", "pods", WATCHED),
        Ask("get", "secrets", WATCHED),
        Ask("create", "secrets", WATCHED),
        Ask("patch", "sandboxes", WATCHED, group="sandbox.dev", subresource="status"),
        Ask("watch", "namespaces"),  # Kopf follows the watched namespaces
    ],
    GATEWAY: [
        Ask("list", "secrets", WATCHED),
        Ask("watch", "secrets", WATCHED),
        Ask("create", "tokenreviews", group="authentication.k8s.io"),
        Ask("create", "subjectaccessreviews", group="authorization.k8s.io"),
    ],
}
# What each must not do beyond NEVER: write Secrets at all (the gateway), read
# pods' logs, or touch workloads it does not own.
ALSO_NEVER = {
    OPERATOR: [
        Ask("update", "secrets", WATCHED),
        Ask("list", "secrets", WATCHED),
        Ask("get", "pods", WATCHED, subresource="log"),
        Ask("create", "deployments", WATCHED, group="apps"),
    ],
    GATEWAY: [
        Ask("get", "secrets", WATCHED),
        Ask("create", "secrets", WATCHED),
        Ask("create", "pods", WATCHED),
        Ask("delete", "sandboxes", WATCHED, group="sandbox.dev"),
    ],
}


def _allowed(kube: KubeJSON, user: str, ask: Ask) -> bool:
    answer = kube.create(
        api_path("authorization.k8s.io/v1", "subjectaccessreviews"), ask.review(user)
    )
    return bool(answer["status"].get("allowed"))


@pytest.fixture(scope="module")
def scoped_release(control_plane: ControlPlane, kube: KubeJSON, repo: Path, crds: None) -> None:
    """The chart's RBAC with watchNamespaces={WATCHED}, applied as the chart would."""
    for name in (NAMESPACE, WATCHED, OTHER):
        try:
            kube.create(
                core_path("namespaces"),
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
            )
        except ApiError as error:
            if error.status != 409:
                raise
    docs = render(repo, f"watchNamespaces={{{WATCHED}}}", namespace=NAMESPACE, release=RELEASE)
    rbac = [doc for doc in docs if doc["kind"] in RBAC_KINDS]
    applied = kubectl(
        control_plane,
        "apply",
        "-f",
        "-",
        input=json.dumps({"kind": "List", "apiVersion": "v1", "items": rbac}),
    )
    assert applied.returncode == 0, applied.stderr


@pytest.mark.parametrize("user", [OPERATOR, GATEWAY], ids=["operator", "gateway"])
def test_what_they_must_not_do_is_denied(kube: KubeJSON, scoped_release: None, user: str) -> None:
    missing = [ask for ask in MUST[user] if not _allowed(kube, user, ask)]
    assert not missing, f"{user} cannot do what it needs (the controls): {missing}"
    allowed = [
        ask for ask in [*NEVER, *SECRETS_OUTSIDE, *ALSO_NEVER[user]] if _allowed(kube, user, ask)
    ]
    assert not allowed, f"{user} may do what it must not: {allowed}"
