"""Gateway settings: `SANDBOX_GATEWAY_CONFIG` (a YAML file) and `SANDBOX_GATEWAY_<FIELD>`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from sandbox_operator.config import load_model


class GatewaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "0.0.0.0"
    port: Annotated[int, Field(ge=1, le=65535)] = 8080
    # Prometheus metrics on a port of their own (0: off), apart from callers.
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 9090
    # The agents' port in sandbox pods (the operator's `agent_port`).
    agent_port: Annotated[int, Field(ge=1, le=65535)] = 8080
    # Namespaces whose sandboxes are served; empty: all.
    namespaces: list[str] = Field(default_factory=list)
    # HMAC keys for scoped tokens and signed URLs: one file per key id; the
    # newest key signs, all of them verify (rotation without downtime).
    keys_dir: str = "/etc/sandbox-gateway/keys"
    # How long an answer of the API server is trusted (bounded caches).
    token_review_seconds: Annotated[float, Field(ge=0, le=3600)] = 60.0
    access_review_seconds: Annotated[float, Field(ge=0, le=3600)] = 10.0
    cache_entries: Annotated[int, Field(ge=16, le=1_000_000)] = 10_000
    # A request to a sandbox its idle policy paused resumes it and waits this long.
    resume_wait_seconds: Annotated[float, Field(ge=0, le=600)] = 60.0
    # Longest life of a scoped token or signed URL.
    max_token_seconds: Annotated[int, Field(ge=60, le=7 * 86400)] = 86400
    # Preview ports by host: `{port}-{sandbox}-{namespace}.{preview_domain}`.
    preview_domain: str | None = None
    # The gateway's address as users outside the cluster reach it (the chart's
    # gateway.externalURL): signed URLs are handed out on it, since the address a
    # request came by may be the API server's proxy or a cluster-internal name.
    external_url: Annotated[str | None, Field(pattern=r"^https?://[^/?#]+(/[^?#]*)?$")] = None
    # Timeouts towards agents: connecting, and between bytes of a response
    # (commands stream for as long as they run: no total).
    agent_connect_seconds: float = 5.0
    # Client connections (connections.py): a request head must arrive within
    # `head_seconds` of connecting and the next one within `idle_seconds` of an
    # answer; at most `connections_per_client` from one address (the API
    # server's service proxy is one address) and `max_connections` in all.
    head_seconds: Annotated[float, Field(gt=0, le=600)] = 10.0
    idle_seconds: Annotated[float, Field(gt=0, le=3600)] = 60.0
    connections_per_client: Annotated[int, Field(ge=1, le=100_000)] = 1024
    max_connections: Annotated[int, Field(ge=1, le=1_000_000)] = 16_000
    # On SIGTERM, how long the replica keeps serving while reporting not ready:
    # kube-proxy and the API server's proxy learn of the pod's end some time
    # after the kubelet signals it, and keep sending new connections here until
    # then (closing the listener at once refused them during every rollout).
    drain_seconds: Annotated[float, Field(ge=0, le=300)] = 5.0
    # The E2B adapter (e2b/): its own listener, off when 0.
    e2b_port: Annotated[int, Field(ge=0, le=65535)] = 0
    # Hosts `{port}-{id}.{e2b_domain}` reach a sandbox's ports (get_host, signed
    # file URLs); the domain create answers with. None: by headers only.
    e2b_domain: str | None = None
    # Where a Kubernetes identity that is not a ServiceAccount creates and finds
    # its E2B sandboxes (a ServiceAccount's own namespace otherwise; an E2B-shaped
    # key carries its namespace).
    e2b_default_namespace: str = "default"
    # E2B template names (aliases) -> (Cluster)SandboxTemplate names; a name not
    # listed is looked up as is.
    e2b_templates: dict[str, str] = Field(default_factory=dict)
    # Where the E2B-shaped API keys (`e2b_...`) are kept, hashed, as Secrets: the
    # gateway's own namespace (the chart sets it from the downward API). None:
    # such keys are neither minted nor accepted (Kubernetes tokens still are).
    e2b_keys_namespace: Annotated[str | None, Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")] = (
        None
    )
    # How long a key's Secret, once read, is trusted: a revoked key (its Secret
    # deleted) stops working within this long on every replica.
    e2b_key_seconds: Annotated[float, Field(ge=0, le=300)] = 10.0
    # The longest lease (`timeout`) a create, connect or set_timeout may ask for.
    e2b_max_timeout_seconds: Annotated[int, Field(ge=1, le=30 * 86400)] = 86400
    # How long create (and connect to a paused sandbox) waits for the sandbox to be
    # Ready before it gives up (the SDKs' own request timeout is 60 s).
    e2b_ready_wait_seconds: Annotated[float, Field(gt=0, le=600)] = 50.0


def load(environ: Mapping[str, str] | None = None) -> GatewaySettings:
    return load_model(GatewaySettings, "SANDBOX_GATEWAY_", environ)
