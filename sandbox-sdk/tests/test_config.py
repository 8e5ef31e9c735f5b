"""Finding the cluster from kubeconfig files, as kubectl does: real files, a real
exec plugin (a script), and the in-pod files. Requests are the integration
tier's business (tests/integration/test_sdk.py); these only read and parse."""

from __future__ import annotations

import base64
import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from sandbox_sdk import ConfigError
from sandbox_sdk.config import (
    ExecPlugin,
    StaticToken,
    TokenFile,
    discover,
    from_kubeconfig,
    in_cluster,
    kubeconfig_paths,
)


def _ca(tmp_path: Path) -> Path:
    """A real self-signed CA certificate (ssl must be able to load it)."""
    key, cert = tmp_path / "ca.key", tmp_path / "ca.crt"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=test-ca",
        ],
        check=True,
        capture_output=True,
    )
    return cert


def _write(
    path: Path,
    clusters: list[dict[str, object]],
    users: list[dict[str, object]],
    contexts: list[dict[str, object]],
    current: str | None,
) -> Path:
    document: dict[str, object] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": clusters,
        "users": users,
        "contexts": contexts,
    }
    if current:
        document["current-context"] = current
    path.write_text(yaml.safe_dump(document))
    return path


def test_merged_kubeconfigs_first_definition_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = _ca(tmp_path)
    first = _write(
        tmp_path / "one",
        [
            {
                "name": "c",
                "cluster": {"server": "https://one:6443", "certificate-authority": str(ca)},
            }
        ],
        [{"name": "u", "user": {"token": "token-one"}}],
        [{"name": "work", "context": {"cluster": "c", "user": "u", "namespace": "team"}}],
        "work",
    )
    second = _write(
        tmp_path / "two",
        [{"name": "c", "cluster": {"server": "https://two:6443"}}],
        [{"name": "u", "user": {"token": "token-two"}}],
        [{"name": "other", "context": {"cluster": "c", "user": "u"}}],
        "other",
    )
    monkeypatch.setenv(
        "KUBECONFIG", f"{first}{os.pathsep}{tmp_path / 'missing'}{os.pathsep}{second}"
    )
    monkeypatch.delenv("SANDBOX_NAMESPACE", raising=False)
    assert kubeconfig_paths() == [first, second]
    config = discover()
    assert config is not None
    assert (config.server, config.namespace) == ("https://one:6443", "team")
    assert isinstance(config.credentials, StaticToken)
    assert config.credentials.token() == "token-one"
    other = discover(context="other", namespace="explicit")
    assert other is not None
    assert (other.server, other.namespace) == ("https://one:6443", "explicit")
    monkeypatch.setenv("SANDBOX_NAMESPACE", "from-env")
    assert (discover() or config).namespace == "from-env"
    with pytest.raises(ConfigError, match="not found"):
        discover(context="nowhere")


def test_certificate_data_token_file_and_exec_plugin(tmp_path: Path) -> None:
    ca = _ca(tmp_path)
    key = tmp_path / "ca.key"
    data = base64.b64encode(ca.read_bytes()).decode()
    cert_only = from_kubeconfig(
        [
            _write(
                tmp_path / "certs",
                [
                    {
                        "name": "c",
                        "cluster": {"server": "https://k:6443", "certificate-authority-data": data},
                    }
                ],
                [
                    {
                        "name": "u",
                        "user": {
                            "client-certificate-data": data,
                            "client-key-data": base64.b64encode(key.read_bytes()).decode(),
                        },
                    }
                ],
                [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "x",
            )
        ]
    )
    assert cert_only.certificate_only
    assert cert_only.credentials is None

    token_file = tmp_path / "token"
    token_file.write_text("first\n")
    with_file = from_kubeconfig(
        [
            _write(
                tmp_path / "file",
                [
                    {
                        "name": "c",
                        "cluster": {"server": "https://k:6443", "insecure-skip-tls-verify": True},
                    }
                ],
                [{"name": "u", "user": {"tokenFile": str(token_file)}}],
                [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "x",
            )
        ]
    )
    assert isinstance(with_file.credentials, TokenFile)
    assert with_file.credentials.token() == "first"
    token_file.write_text("rotated\n")
    os.utime(token_file, (1e9, 2e9))
    assert with_file.credentials.token() == "rotated"

    plugin = tmp_path / "plugin"
    calls = tmp_path / "calls"
    plugin.write_text(
        "#!/bin/sh\n"
        f'echo called >> "{calls}"\n'
        'echo "{\\"apiVersion\\": \\"client.authentication.k8s.io/v1\\", '
        '\\"kind\\": \\"ExecCredential\\", \\"status\\": {\\"token\\": \\"from-$PLUGIN_ENV\\", '
        '\\"expirationTimestamp\\": \\"2999-01-01T00:00:00Z\\"}}"\n'
    )
    plugin.chmod(plugin.stat().st_mode | stat.S_IXUSR)
    exec_config = from_kubeconfig(
        [
            _write(
                tmp_path / "exec",
                [
                    {
                        "name": "c",
                        "cluster": {"server": "https://k:6443", "certificate-authority": "ca.crt"},
                    }
                ],
                [
                    {
                        "name": "u",
                        "user": {
                            "exec": {
                                "apiVersion": "client.authentication.k8s.io/v1",
                                "command": str(plugin),
                                "env": [{"name": "PLUGIN_ENV", "value": "plugin"}],
                            }
                        },
                    }
                ],
                [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "x",
            )
        ]
    )
    assert isinstance(exec_config.credentials, ExecPlugin)
    assert exec_config.credentials.token() == "from-plugin"
    assert exec_config.credentials.token() == "from-plugin"
    assert calls.read_text().count("called") == 1  # cached until it expires


def test_in_a_pod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    account = tmp_path / "sa"
    account.mkdir()
    (account / "token").write_text("pod-token")
    (account / "namespace").write_text("apps")
    (account / "ca.crt").write_bytes(_ca(tmp_path).read_bytes())
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert in_cluster(serviceaccount_dir=account) is None
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    config = in_cluster(serviceaccount_dir=account)
    assert config is not None
    assert (config.server, config.namespace, config.in_cluster) == (
        "https://[fd00::1]:443",
        "apps",
        True,
    )
    assert config.credentials is not None
    assert config.credentials.token() == "pod-token"
    # A kubeconfig comes first, as with kubectl; none at all: the pod's.
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("SANDBOX_NAMESPACE", raising=False)
    found = discover(serviceaccount_dir=account)
    assert found is not None
    assert found.in_cluster
