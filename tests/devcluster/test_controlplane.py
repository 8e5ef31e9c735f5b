"""The local control plane against itself: a real etcd, kube-apiserver and
kube-controller-manager, reached through the generated admin kubeconfig.

Each check needs a controller or the authorizer to actually do its job, so a
control plane started with the wrong flags fails here rather than later in
the operator's integration tests.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator

import pytest
from kubernetes import client, config
from kubernetes.client import ApiException

from devcluster import versions
from devcluster.controlplane import ControlPlane, free_ports
from tests.devcluster.support import kubectl, wait_for

pytestmark = pytest.mark.integration

# Controllers react within seconds here; the bound only keeps a broken
# controller from hanging the suite.
WAIT = 60.0


def is_gone(read: Callable[[], object]) -> bool:
    try:
        read()
    except ApiException as error:
        if error.status == 404:
            return True
        raise
    return False


@pytest.fixture(scope="module")
def api(control_plane: ControlPlane) -> Iterator[client.ApiClient]:
    # The config loader is the one untyped corner of the client.
    api_client: client.ApiClient = config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=str(control_plane.kubeconfig)
    )
    yield api_client
    api_client.close()  # type: ignore[no-untyped-call]


@pytest.fixture
def namespace(api: client.ApiClient) -> Iterator[str]:
    core = client.CoreV1Api(api)
    name = f"t-{uuid.uuid4().hex[:10]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    # The namespace controller cleans up whatever the test left behind.
    core.delete_namespace(name)


def test_kubectl_by_path_reports_pinned_server_version(control_plane: ControlPlane) -> None:
    reported = json.loads(kubectl(control_plane, "version", "--output=json", check=True).stdout)
    assert reported["serverVersion"]["gitVersion"] == versions.KUBERNETES
    assert reported["clientVersion"]["gitVersion"] == versions.KUBERNETES
    readyz = kubectl(control_plane, "get", "--raw=/readyz", check=True)
    assert readyz.stdout.strip() == "ok"


def test_service_account_without_bindings_is_forbidden(
    control_plane: ControlPlane, api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="nobody"))
    )
    token_request = core.create_namespaced_service_account_token(
        "nobody",
        namespace,
        client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600)
        ),
    )
    configuration = client.Configuration()
    configuration.host = control_plane.server
    configuration.ssl_ca_cert = str(control_plane.ca_cert)
    assert token_request.status is not None
    configuration.api_key = {"authorization": f"Bearer {token_request.status.token}"}
    with client.ApiClient(configuration) as as_sa:
        # Authenticated as the ServiceAccount (not anonymous, not 401) ...
        review = client.AuthenticationV1Api(as_sa).create_self_subject_review(
            client.V1SelfSubjectReview(
                api_version="authentication.k8s.io/v1", kind="SelfSubjectReview"
            )
        )
        assert review.status is not None
        assert review.status.user_info is not None
        assert review.status.user_info.username == f"system:serviceaccount:{namespace}:nobody"
        # ... and denied by RBAC.
        with pytest.raises(ApiException) as denied:
            client.CoreV1Api(as_sa).list_namespaced_pod(namespace)
        assert denied.value.status == 403

        # A RoleBinding lifts the denial: the 403 came from RBAC, not from a broken token.
        rbac = client.RbacAuthorizationV1Api(api)
        rbac.create_namespaced_role(
            namespace,
            client.V1Role(
                metadata=client.V1ObjectMeta(name="pod-reader"),
                rules=[client.V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["list"])],
            ),
        )
        rbac.create_namespaced_role_binding(
            namespace,
            client.V1RoleBinding(
                metadata=client.V1ObjectMeta(name="nobody-reads-pods"),
                role_ref=client.V1RoleRef(
                    api_group="rbac.authorization.k8s.io", kind="Role", name="pod-reader"
                ),
                subjects=[
                    client.RbacV1Subject(kind="ServiceAccount", name="nobody", namespace=namespace)
                ],
            ),
        )

        def can_list() -> bool:
            try:
                client.CoreV1Api(as_sa).list_namespaced_pod(namespace)
            except ApiException as error:
                if error.status == 403:
                    return False
                raise
            return True

        wait_for(can_list, "the RoleBinding to take effect", WAIT)


def test_kubectl_auth_can_i_as_service_account(control_plane: ControlPlane, namespace: str) -> None:
    result = kubectl(
        control_plane,
        "auth",
        "can-i",
        "list",
        "pods",
        f"--namespace={namespace}",
        f"--as=system:serviceaccount:{namespace}:nobody",
    )
    # can-i exits 1 and says "no" when denied.
    assert (result.returncode, result.stdout.strip()) == (1, "no"), result.stderr


def _config_map(name: str, owner: client.V1ConfigMap | None = None) -> client.V1ConfigMap:
    owners = None
    if owner is not None:
        assert owner.metadata is not None
        assert owner.metadata.name is not None
        assert owner.metadata.uid is not None
        owners = [
            client.V1OwnerReference(
                api_version="v1", kind="ConfigMap", name=owner.metadata.name, uid=owner.metadata.uid
            )
        ]
    return client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=name, owner_references=owners), data={"k": name}
    )


def test_garbage_collector_deletes_dependents(api: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(api)
    owner = core.create_namespaced_config_map(namespace, _config_map("owner"))
    other_owner = core.create_namespaced_config_map(namespace, _config_map("other-owner"))
    core.create_namespaced_config_map(namespace, _config_map("dependent", owner))
    core.create_namespaced_config_map(namespace, _config_map("bystander", other_owner))

    core.delete_namespaced_config_map("owner", namespace)  # background propagation
    wait_for(
        lambda: is_gone(lambda: core.read_namespaced_config_map("dependent", namespace)),
        "the garbage collector to delete the dependent ConfigMap",
        WAIT,
    )
    # Only dependents of the deleted owner go.
    assert core.read_namespaced_config_map("bystander", namespace).data == {"k": "bystander"}

    # Foreground: the owner waits (finalizer) until the collector removed the dependent.
    core.delete_namespaced_config_map(
        "other-owner", namespace, propagation_policy="Foreground", grace_period_seconds=0
    )
    wait_for(
        lambda: is_gone(lambda: core.read_namespaced_config_map("other-owner", namespace)),
        "foreground deletion of the owner",
        WAIT,
    )
    assert is_gone(lambda: core.read_namespaced_config_map("bystander", namespace))


def test_namespace_deletion_completes(api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    name = f"t-del-{uuid.uuid4().hex[:8]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    core.create_namespaced_config_map(name, _config_map("content"))
    core.create_namespaced_secret(
        name, client.V1Secret(metadata=client.V1ObjectMeta(name="secret"), string_data={"a": "b"})
    )
    core.create_namespaced_service_account(
        name, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="sa"))
    )

    core.delete_namespace(name)
    # The namespace controller has to empty it and remove the `kubernetes`
    # finalizer; without a working controller it would stay Terminating forever.
    wait_for(
        lambda: is_gone(lambda: core.read_namespace(name)), f"namespace {name} to go away", WAIT
    )


def test_service_account_controllers_populate_new_namespace(
    api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    # serviceaccount controller: a `default` ServiceAccount in every namespace.
    wait_for(
        lambda: not is_gone(lambda: core.read_namespaced_service_account("default", namespace)),
        "the default ServiceAccount",
        WAIT,
    )
    # root-ca-cert-publisher: the CA bundle pods use to trust the API server.
    wait_for(
        lambda: not is_gone(lambda: core.read_namespaced_config_map("kube-root-ca.crt", namespace)),
        "the kube-root-ca.crt ConfigMap",
        WAIT,
    )
    # serviceaccount-token controller: fills a legacy token Secret on request.
    core.create_namespaced_secret(
        namespace,
        client.V1Secret(
            metadata=client.V1ObjectMeta(
                name="default-token",
                annotations={"kubernetes.io/service-account.name": "default"},
            ),
            type="kubernetes.io/service-account-token",
        ),
    )

    def token_filled() -> bool:
        data = core.read_namespaced_secret("default-token", namespace).data or {}
        return {"token", "ca.crt", "namespace"} <= set(data)

    wait_for(token_filled, "the token controller to fill the Secret", WAIT)


def test_free_ports_never_hands_out_a_port_twice() -> None:
    # A cluster takes its control plane's and its node's ports in separate calls,
    # before anything binds them: the two sets must not overlap.
    first = free_ports(200)
    second = free_ports(200)
    assert len(set(first)) == 200
    assert not set(first) & set(second)
