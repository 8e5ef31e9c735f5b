"""A client's connection: the API server (lifecycle) and the gateway (commands
and files), found from one set of ConnectionOptions (`sandbox_sdk.config`)."""

from __future__ import annotations

import os
from dataclasses import fields
from types import TracebackType
from typing import Self

from sandbox_sdk._async.gateway import AsyncGateway
from sandbox_sdk._async.kube import AsyncKube
from sandbox_sdk.config import ConnectionOptions
from sandbox_sdk.errors import ConfigError


class AsyncConnection:
    """The API server's client (`kube`, None without one), the gateway's
    (`gateway`), the cluster found (`config`) and the default namespace. The
    keyword arguments are ConnectionOptions' fields, which document them."""

    def __init__(
        self,
        namespace: str | None = None,
        *,
        kubeconfig: str | os.PathLike[str] | None = None,
        context: str | None = None,
        api_server: str | None = None,
        token: str | None = None,
        ca_file: str | None = None,
        gateway_url: str | None = None,
        gateway_token: str | None = None,
        gateway: str | None = None,
        service_account: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.options = ConnectionOptions(
            namespace=namespace,
            kubeconfig=kubeconfig,
            context=context,
            api_server=api_server,
            token=token,
            ca_file=ca_file,
            gateway_url=gateway_url,
            gateway_token=gateway_token,
            gateway=gateway,
            service_account=service_account,
            timeout=timeout,
        )
        options = self.options
        self.config = options.cluster()
        self.namespace = options.namespace_in(self.config)
        self.kube = AsyncKube(self.config, options.timeout) if self.config is not None else None
        self.gateway = AsyncGateway(
            self.kube,
            url=options.gateway_url,
            # Without an API server, `token` is the gateway's (a scoped token).
            token=options.gateway_token or (options.token if self.kube is None else None),
            mode=options.gateway,
            service_account=options.service_account,
            timeout=options.timeout,
            kubeconfig_args=options.kubectl_args(),
        )

    @classmethod
    def from_options(cls, options: ConnectionOptions) -> Self:
        """A client connected as `options` say: the same as passing its fields
        as keyword arguments (`sandbox_sdk.config.ConnectionOptions`)."""
        return cls(**{f.name: getattr(options, f.name) for f in fields(options)})

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close connections (and a port-forward, if one was started)."""
        await self.gateway.aclose()
        if self.kube is not None:
            await self.kube.aclose()

    def _kube(self) -> AsyncKube:
        if self.kube is None:
            raise ConfigError(
                "no Kubernetes API access (no kubeconfig, not in a pod): lifecycle operations"
                " need one; a gateway URL and token serve commands and files only"
            )
        return self.kube

    async def describe(self) -> str:
        """Where this client talks to: the API server and the gateway route."""
        location = await self.gateway.locate()
        cluster = self.config.describe() if self.config else "no API server"
        return f"API server: {cluster}\ngateway: {location.describe}"
