"""One set of connection options (`sandbox_sdk.config.ConnectionOptions`): the
clients' keyword arguments are its fields, and a client made from it is the
client the keywords make. Constructing a client does no network I/O."""

from __future__ import annotations

import inspect
from dataclasses import fields
from typing import Any

import pytest

from sandbox_sdk import AsyncSandboxClient, SandboxClient
from sandbox_sdk.config import ClusterConfig, ConnectionOptions


@pytest.mark.parametrize("client", [SandboxClient, AsyncSandboxClient])
def test_the_client_keywords_are_the_options_fields(
    client: type[SandboxClient] | type[AsyncSandboxClient],
) -> None:
    parameters = list(inspect.signature(client).parameters.values())
    assert [(p.name, p.default) for p in parameters] == [
        (f.name, f.default) for f in fields(ConnectionOptions)
    ]


def test_a_client_from_options_is_the_client_of_the_keywords() -> None:
    keywords: dict[str, Any] = {
        "namespace": "team",
        "api_server": "http://127.0.0.1:9",
        "token": "t0ken",
        "gateway_url": "http://127.0.0.1:8",
        "gateway": "dns",
        "service_account": "robot",
        "timeout": 7.0,
    }
    options = ConnectionOptions(**keywords)
    made = SandboxClient.from_options(options)
    given = SandboxClient(**keywords)
    try:
        assert made.options == given.options == options
        for client in (made, given):
            assert client.config is not None
            assert (client.namespace, client.config.server) == ("team", "http://127.0.0.1:9")
            gateway = client.gateway
            assert (gateway.url, gateway.mode, gateway.service_account, gateway.timeout) == (
                "http://127.0.0.1:8",
                "dns",
                "robot",
                7.0,
            )
            # The API server's token stays the API server's: the gateway gets it
            # from there (an explicit gateway token would go here).
            assert gateway.explicit_token is None
    finally:
        made.close()
        given.close()


def test_without_an_api_server_the_token_is_the_gateways(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/kubeconfig")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    options = ConnectionOptions(token="scoped", gateway_url="http://127.0.0.1:8")
    client = SandboxClient.from_options(options)
    try:
        assert client.kube is None
        assert client.gateway.explicit_token == "scoped"
    finally:
        client.close()


def _cluster(namespace: str) -> ClusterConfig:
    return ClusterConfig("https://k", namespace, False, None, "explicit")


def test_the_namespace_is_the_options_then_the_clusters_then_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SANDBOX_NAMESPACE", raising=False)
    assert ConnectionOptions(namespace="mine").namespace_in(_cluster("theirs")) == "mine"
    assert ConnectionOptions().namespace_in(_cluster("theirs")) == "theirs"
    assert ConnectionOptions().namespace_in(None) == "default"
    monkeypatch.setenv("SANDBOX_NAMESPACE", "from-env")
    assert ConnectionOptions().namespace_in(None) == "from-env"


def test_kubectl_gets_the_same_kubeconfig_and_context() -> None:
    assert ConnectionOptions().kubectl_args() == []
    assert ConnectionOptions(kubeconfig="/k", context="c").kubectl_args() == [
        "--kubeconfig=/k",
        "--context=c",
    ]
