"""Where the cluster is and who we are: found the way kubectl finds it.

Order (the first that applies wins):

1. explicit: `api_server=` (and `token=`), or `kubeconfig=`/`context=` arguments;
2. a kubeconfig: `$KUBECONFIG` (colon-separated, merged as kubectl merges:
   the first file to name a context, cluster or user wins) or `~/.kube/config`;
3. inside a pod: the pod's ServiceAccount (`/var/run/secrets/kubernetes.io/
   serviceaccount`: token, re-read as the kubelet rotates it; CA; namespace)
   and `KUBERNETES_SERVICE_HOST`/`_PORT`;
4. none: only an explicit gateway URL and token can be used (commands and files
   of one sandbox, no lifecycle).

Credentials of a kubeconfig user: `token`, `tokenFile`, client certificates
(`client-certificate(-data)`, `client-key(-data)`) and `exec` plugins (the
ExecCredential protocol, as cloud providers' kubeconfigs use). Nothing here does
network I/O: it only reads files and, for exec plugins, runs the plugin.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from sandbox_sdk.errors import ConfigError

SERVICEACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
JSON = dict[str, Any]


class TokenSource:
    """Gives the current bearer token (or None: the client authenticates otherwise)."""

    def token(self) -> str | None:
        raise NotImplementedError


@dataclass
class StaticToken(TokenSource):
    value: str

    def token(self) -> str | None:
        return self.value


@dataclass
class TokenFile(TokenSource):
    """A token file that may be replaced under us (projected ServiceAccount tokens
    are rotated by the kubelet): re-read when its modification time changes."""

    path: Path
    _cached: tuple[float, str] | None = None

    def token(self) -> str | None:
        try:
            mtime = self.path.stat().st_mtime
        except OSError as exc:
            raise ConfigError(f"cannot read the token file {self.path}: {exc}") from exc
        if self._cached is None or self._cached[0] != mtime:
            self._cached = (mtime, self.path.read_text().strip())
        return self._cached[1]


@dataclass
class ExecPlugin(TokenSource):
    """A kubeconfig `exec` credential plugin (client.authentication.k8s.io):
    run it, use its token until its expirationTimestamp."""

    command: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    api_version: str = "client.authentication.k8s.io/v1"
    _cached: tuple[float, str] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def token(self) -> str | None:
        with self._lock:
            if self._cached is not None and self._cached[0] > time.time() + 10:
                return self._cached[1]
            request = {"apiVersion": self.api_version, "kind": "ExecCredential", "spec": {}}
            env = {**os.environ, **self.env, "KUBERNETES_EXEC_INFO": json.dumps(request)}
            try:
                import subprocess  # exec plugins only: kept off `kubectl sandbox`'s start-up

                done = subprocess.run(
                    [self.command, *self.args],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=False,
                )
            except OSError as exc:
                raise ConfigError(f"kubeconfig exec plugin {self.command}: {exc}") from exc
            if done.returncode != 0:
                raise ConfigError(
                    f"kubeconfig exec plugin {self.command} failed: {done.stderr.strip()}"
                )
            status = (json.loads(done.stdout or "{}") or {}).get("status") or {}
            token = status.get("token")
            if not token:
                raise ConfigError(
                    f"kubeconfig exec plugin {self.command} returned no token"
                    " (client certificates from exec plugins are not supported)"
                )
            expires = status.get("expirationTimestamp")
            until = (
                datetime.fromisoformat(expires.replace("Z", "+00:00")).timestamp()
                if expires
                else time.time() + 300
            )
            self._cached = (until, str(token))
            return str(token)


@dataclass
class ClusterConfig:
    """How to reach the API server: URL, TLS, credentials, default namespace."""

    server: str
    namespace: str
    ssl_context: ssl.SSLContext | bool
    credentials: TokenSource | None
    # "in-cluster", "kubeconfig <path> (context <name>)" or "explicit": for messages.
    source: str
    in_cluster: bool = False
    # True when the user authenticates with a client certificate only: there is
    # no bearer token the gateway could review (see SandboxClient, service_account).
    certificate_only: bool = False

    def describe(self) -> str:
        return f"{self.server} from {self.source}, namespace {self.namespace}"


def _b64(data: str) -> bytes:
    return base64.b64decode(data)


def _ssl_context(
    ca_file: str | None,
    ca_data: bytes | None,
    cert: tuple[bytes, bytes] | None,
    insecure: bool,
) -> ssl.SSLContext | bool:
    if insecure and cert is None:
        return False
    context = ssl.create_default_context(
        cafile=ca_file, cadata=ca_data.decode() if ca_data else None
    )
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if cert is not None:
        # load_cert_chain reads files only: a private directory, removed at once.
        import tempfile  # client certificates only: kept off the start-up

        with tempfile.TemporaryDirectory(prefix="sandbox-sdk-") as tmp:
            cert_path, key_path = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
            cert_path.write_bytes(cert[0])
            key_path.touch(mode=0o600)
            key_path.write_bytes(cert[1])
            context.load_cert_chain(str(cert_path), str(key_path))
    return context


def _read(path: str | None, data: str | None, base: Path) -> bytes | None:
    if data:
        return _b64(data)
    if path:
        resolved = Path(path) if os.path.isabs(path) else base / path
        return resolved.read_bytes()
    return None


def _merged(paths: list[Path]) -> tuple[JSON, dict[str, Path]]:
    """kubectl's merge: the first file to define a name wins; `current-context`
    from the first file that sets one. Also: which file each name came from
    (relative paths in a kubeconfig are relative to its own file)."""
    merged: JSON = {"clusters": {}, "users": {}, "contexts": {}, "current-context": None}
    origin: dict[str, Path] = {}
    for path in paths:
        document = yaml.safe_load(path.read_text()) or {}
        if merged["current-context"] is None and document.get("current-context"):
            merged["current-context"] = document["current-context"]
        for section, key in (("clusters", "cluster"), ("users", "user"), ("contexts", "context")):
            for entry in document.get(section) or []:
                name = entry.get("name")
                if name is not None and name not in merged[section]:
                    merged[section][name] = entry.get(key) or {}
                    origin[f"{section}/{name}"] = path.parent
    return merged, origin


def kubeconfig_paths(explicit: str | os.PathLike[str] | None = None) -> list[Path]:
    """The kubeconfig files kubectl would read, existing ones only."""
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.exists():
            raise ConfigError(f"kubeconfig {path} does not exist")
        return [path]
    env = os.environ.get("KUBECONFIG")
    if env:
        return [Path(p).expanduser() for p in env.split(os.pathsep) if p and Path(p).exists()]
    default = Path.home() / ".kube" / "config"
    return [default] if default.exists() else []


def from_kubeconfig(
    paths: list[Path], context: str | None = None, namespace: str | None = None
) -> ClusterConfig:
    merged, origin = _merged(paths)
    name = context or merged["current-context"]
    if not name:
        raise ConfigError(f"no current-context in {', '.join(map(str, paths))}; pass context=")
    ctx = merged["contexts"].get(name)
    if ctx is None:
        raise ConfigError(f"context {name!r} not found in {', '.join(map(str, paths))}")
    cluster_name, user_name = ctx.get("cluster"), ctx.get("user")
    cluster = merged["clusters"].get(cluster_name)
    if cluster is None or not cluster.get("server"):
        raise ConfigError(f"context {name!r}: cluster {cluster_name!r} has no server")
    user = merged["users"].get(user_name) or {}
    cbase = origin.get(f"clusters/{cluster_name}", Path.cwd())
    ubase = origin.get(f"users/{user_name}", Path.cwd())
    ca_file = cluster.get("certificate-authority")
    if ca_file and not os.path.isabs(ca_file):
        ca_file = str(cbase / ca_file)
    ca_data = (
        _b64(cluster["certificate-authority-data"])
        if cluster.get("certificate-authority-data")
        else None
    )
    cert = _read(user.get("client-certificate"), user.get("client-certificate-data"), ubase)
    key = _read(user.get("client-key"), user.get("client-key-data"), ubase)
    credentials: TokenSource | None = None
    if user.get("token"):
        credentials = StaticToken(str(user["token"]))
    elif user.get("tokenFile"):
        credentials = TokenFile(Path(user["tokenFile"]))
    elif user.get("exec"):
        spec = user["exec"]
        credentials = ExecPlugin(
            command=str(spec["command"]),
            args=[str(a) for a in spec.get("args") or []],
            env={str(e["name"]): str(e["value"]) for e in spec.get("env") or []},
            api_version=str(spec.get("apiVersion") or "client.authentication.k8s.io/v1"),
        )
    elif user.get("username") or user.get("auth-provider"):
        raise ConfigError(
            f"context {name!r}: basic auth and auth-provider users are not supported;"
            " use a token, a client certificate or an exec plugin"
        )
    context_ssl = _ssl_context(
        ca_file,
        ca_data,
        (cert, key) if cert and key else None,
        bool(cluster.get("insecure-skip-tls-verify")),
    )
    return ClusterConfig(
        server=str(cluster["server"]).rstrip("/"),
        namespace=namespace or ctx.get("namespace") or "default",
        ssl_context=context_ssl,
        credentials=credentials,
        source=f"kubeconfig {':'.join(map(str, paths))} (context {name})",
        certificate_only=credentials is None and cert is not None,
    )


def in_cluster(
    namespace: str | None = None, serviceaccount_dir: Path | None = None
) -> ClusterConfig | None:
    """The pod's own ServiceAccount, or None when not in a pod."""
    serviceaccount_dir = serviceaccount_dir or SERVICEACCOUNT_DIR
    host, port = (
        os.environ.get("KUBERNETES_SERVICE_HOST"),
        os.environ.get("KUBERNETES_SERVICE_PORT"),
    )
    token = serviceaccount_dir / "token"
    if not host or not port or not token.exists():
        return None
    ns_file = serviceaccount_dir / "namespace"
    own_ns = ns_file.read_text().strip() if ns_file.exists() else "default"
    ca = serviceaccount_dir / "ca.crt"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6
    return ClusterConfig(
        server=f"https://{host}:{port}",
        namespace=namespace or own_ns,
        ssl_context=_ssl_context(str(ca) if ca.exists() else None, None, None, False),
        credentials=TokenFile(token),
        source="in-cluster",
        in_cluster=True,
    )


@dataclass(frozen=True)
class ConnectionOptions:
    """Where the cluster and the gateway are, and who we are: the client's
    connection arguments as one value (`SandboxClient.from_options`), shared by
    the clients, `kubectl sandbox` and `sandbox-mcp`. Every field is optional:
    None means "find it as kubectl would" (this module's docstring) and, for
    the gateway, as `sandbox_sdk._async.gateway` says.

    Fields:
        namespace: default namespace (else `$SANDBOX_NAMESPACE`, else the
            kubeconfig context's, or the pod's).
        kubeconfig, context: a kubeconfig file and context instead of kubectl's defaults.
        api_server, token, ca_file: an explicit API server and bearer token.
        gateway_url: the gateway's URL (else found through its Service).
        gateway_token: the token for the gateway (else the API server's token, or a
            ServiceAccount's for certificate-only kubeconfigs).
        gateway: "auto" (DNS in a pod, API server proxy outside), "dns", "proxy" or
            "port-forward".
        service_account: the ServiceAccount whose token the gateway gets when the
            kubeconfig has only a client certificate.
        timeout: per-request timeout of calls that are not commands.
    """

    namespace: str | None = None
    kubeconfig: str | os.PathLike[str] | None = None
    context: str | None = None
    api_server: str | None = None
    token: str | None = None
    ca_file: str | None = None
    gateway_url: str | None = None
    gateway_token: str | None = None
    gateway: str | None = None
    service_account: str | None = None
    timeout: float = 60.0

    def cluster(self, serviceaccount_dir: Path | None = None) -> ClusterConfig | None:
        """The cluster to talk to (see `discover`)."""
        namespace = self.namespace or os.environ.get("SANDBOX_NAMESPACE") or None
        if self.api_server is not None:
            return ClusterConfig(
                server=self.api_server.rstrip("/"),
                namespace=namespace or "default",
                ssl_context=_ssl_context(self.ca_file, None, None, False)
                if self.api_server.startswith("https")
                else False,
                credentials=StaticToken(self.token) if self.token else None,
                source="explicit",
            )
        paths = kubeconfig_paths(self.kubeconfig)
        if paths or self.context is not None:
            if not paths:
                raise ConfigError("context= given but no kubeconfig was found")
            config = from_kubeconfig(paths, self.context, namespace)
            if self.token is not None:
                config.credentials, config.certificate_only = StaticToken(self.token), False
            return config
        pod = in_cluster(namespace, serviceaccount_dir)
        if pod is not None and self.token is not None:
            pod.credentials = StaticToken(self.token)
        return pod

    def namespace_in(self, cluster: ClusterConfig | None) -> str:
        """The default namespace once the cluster is known: `namespace`, else the
        cluster's (which `$SANDBOX_NAMESPACE` set), else the variable, else `default`."""
        return (
            self.namespace
            or (cluster.namespace if cluster else None)
            or os.environ.get("SANDBOX_NAMESPACE")
            or "default"
        )

    def kubectl_args(self) -> list[str]:
        """kubectl's flags for the same kubeconfig and context (`kubectl port-forward`)."""
        args = [f"--kubeconfig={self.kubeconfig}"] if self.kubeconfig else []
        if self.context:
            args.append(f"--context={self.context}")
        return args


def discover(
    *,
    namespace: str | None = None,
    kubeconfig: str | os.PathLike[str] | None = None,
    context: str | None = None,
    api_server: str | None = None,
    token: str | None = None,
    ca_file: str | None = None,
    serviceaccount_dir: Path | None = None,
) -> ClusterConfig | None:
    """The cluster to talk to, by the order in the module's docstring; None when
    there is none (gateway-only use). The namespace: `namespace`, else
    `$SANDBOX_NAMESPACE`, else the context's (or the pod's) own."""
    options = ConnectionOptions(
        namespace=namespace,
        kubeconfig=kubeconfig,
        context=context,
        api_server=api_server,
        token=token,
        ca_file=ca_file,
    )
    return options.cluster(serviceaccount_dir)
