"""The cluster PKI: what Kubernetes reads from each certificate, and reuse."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from devcluster import pki


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def subject(cert: x509.Certificate, oid: x509.ObjectIdentifier) -> list[str]:
    return [str(attribute.value) for attribute in cert.subject.get_attributes_for_oid(oid)]


def test_certificates_carry_what_kubernetes_reads(tmp_path: Path) -> None:
    certs = pki.ensure_pki(tmp_path / "pki", apiserver_ips=("127.0.0.1", "10.96.0.1"))
    ca = load(certs.ca.cert)

    serving = load(certs.apiserver.cert)
    serving.verify_directly_issued_by(ca)
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "kubernetes.default.svc"} <= set(sans.get_values_for_type(x509.DNSName))
    assert set(sans.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("10.96.0.1"),
    }
    usages = serving.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usages

    admin = load(certs.admin.cert)
    admin.verify_directly_issued_by(ca)
    # O= becomes the user's groups: system:masters is cluster-admin.
    assert subject(admin, NameOID.ORGANIZATION_NAME) == ["system:masters"]
    kcm = load(certs.controller_manager.cert)
    assert subject(kcm, NameOID.COMMON_NAME) == ["system:kube-controller-manager"]
    load(certs.front_proxy_client.cert).verify_directly_issued_by(load(certs.front_proxy_ca.cert))
    assert certs.ca.key.stat().st_mode & 0o077 == 0, "private keys must not be world-readable"
    assert certs.service_account_key.stat().st_mode & 0o077 == 0


def test_ensure_pki_is_idempotent(tmp_path: Path) -> None:
    first = pki.ensure_pki(tmp_path)
    contents = {path: path.read_bytes() for path in tmp_path.iterdir()}
    second = pki.ensure_pki(tmp_path)
    assert second == first
    assert {path: path.read_bytes() for path in tmp_path.iterdir()} == contents


def test_incomplete_pki_is_regenerated_whole(tmp_path: Path) -> None:
    first = pki.ensure_pki(tmp_path)
    old_ca = first.ca.cert.read_bytes()
    first.admin.key.unlink()  # e.g. a run killed while writing
    second = pki.ensure_pki(tmp_path)
    assert second.admin.key.exists()
    # A new CA, and every leaf signed by it (no mix of old and new).
    assert second.ca.cert.read_bytes() != old_ca
    load(second.apiserver.cert).verify_directly_issued_by(load(second.ca.cert))


def test_missing_san_triggers_regeneration(tmp_path: Path) -> None:
    pki.ensure_pki(tmp_path, apiserver_ips=("127.0.0.1",))
    certs = pki.ensure_pki(tmp_path, apiserver_ips=("127.0.0.1", "10.0.0.1"))
    sans = load(certs.apiserver.cert).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert ipaddress.ip_address("10.0.0.1") in sans.value.get_values_for_type(x509.IPAddress)
