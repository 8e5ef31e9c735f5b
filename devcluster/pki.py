"""Certificates and keys for a local control plane, made with `cryptography`.

Everything lives in one directory per cluster. `ensure_pki` is idempotent: a
complete, valid set is reused as it is (so kubeconfigs handed out earlier keep
working); anything missing, unreadable or close to expiry makes it regenerate
the whole set, because certificates signed by a replaced CA would be useless.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from devcluster import records

# Long enough that a dev cluster never expires under someone's feet, short
# enough to stay a sane certificate.
VALIDITY = datetime.timedelta(days=365)
# Regenerate when less than this is left, rather than fail mid-run.
RENEW_BEFORE = datetime.timedelta(days=7)

# SANs of the API server's serving certificate: loopback for everything on this
# machine, the in-cluster names for clients that use the `kubernetes` Service.
APISERVER_DNS_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Leaf:
    """What a leaf certificate says: subject (O= becomes a client's groups),
    extended key usages and SANs."""

    common_name: str
    organization: str | None = None
    server: bool = False
    client: bool = False
    dns_names: tuple[str, ...] = ()
    ip_addresses: tuple[str, ...] = ()

    @classmethod
    def loopback_serving(cls, common_name: str) -> Leaf:
        """The serving certificate of a component that listens on 127.0.0.1 only."""
        return cls(common_name, server=True, dns_names=("localhost",), ip_addresses=("127.0.0.1",))

    @property
    def subject(self) -> x509.Name:
        return _name(self.common_name, self.organization)

    @property
    def usages(self) -> list[x509.ObjectIdentifier]:
        return [
            usage
            for usage, on in (
                (ExtendedKeyUsageOID.SERVER_AUTH, self.server),
                (ExtendedKeyUsageOID.CLIENT_AUTH, self.client),
            )
            if on
        ]

    @property
    def alt_names(self) -> list[x509.GeneralName]:
        names: list[x509.GeneralName] = [x509.DNSName(name) for name in self.dns_names]
        return names + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in self.ip_addresses]


@dataclass(frozen=True)
class PKI:
    """Paths of every file `ensure_pki` writes."""

    directory: Path
    ca: CertPair
    apiserver: CertPair
    """Serving certificate of kube-apiserver."""
    admin: CertPair
    """Client certificate in group system:masters, for the admin kubeconfig."""
    controller_manager: CertPair
    """Client certificate CN=system:kube-controller-manager (bootstrap RBAC knows it)."""
    controller_manager_serving: CertPair
    """Serving certificate of kube-controller-manager's health/metrics port."""
    apiserver_kubelet_client: CertPair
    """What kube-apiserver presents to kubelets (logs, exec); used once a node exists."""
    front_proxy_ca: CertPair
    """Separate CA for the aggregation layer's request-header authentication."""
    front_proxy_client: CertPair
    service_account_key: Path
    """RSA private key that signs service-account tokens."""
    service_account_pub: Path


def paths(directory: Path) -> PKI:
    """Where the files of `ensure_pki` are (without creating or checking them)."""

    def pair(name: str) -> CertPair:
        return CertPair(directory / f"{name}.crt", directory / f"{name}.key")

    return PKI(
        directory=directory,
        ca=pair("ca"),
        apiserver=pair("apiserver"),
        admin=pair("admin"),
        controller_manager=pair("controller-manager"),
        controller_manager_serving=pair("controller-manager-serving"),
        apiserver_kubelet_client=pair("apiserver-kubelet-client"),
        front_proxy_ca=pair("front-proxy-ca"),
        front_proxy_client=pair("front-proxy-client"),
        service_account_key=directory / "sa.key",
        service_account_pub=directory / "sa.pub",
    )


def _all_files(pki: PKI) -> list[Path]:
    pairs = [
        pki.ca,
        pki.apiserver,
        pki.admin,
        pki.controller_manager,
        pki.controller_manager_serving,
        pki.apiserver_kubelet_client,
        pki.front_proxy_ca,
        pki.front_proxy_client,
    ]
    files = [path for pair in pairs for path in (pair.cert, pair.key)]
    return [*files, pki.service_account_key, pki.service_account_pub]


def _certificates(pki: PKI) -> list[Path]:
    return [path for path in _all_files(pki) if path.suffix == ".crt"]


def _write(path: Path, data: bytes, mode: int) -> None:
    # Atomic, so a crash never leaves a half-written key for the next run.
    records.write_atomic(path, data, mode=mode)


def _key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        # Kubernetes maps O= of a client certificate to the user's groups.
        attributes.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _new_key() -> ec.EllipticCurvePrivateKey:
    # P-256: every client here (Go, OpenSSL via Python) accepts it, and it is
    # generated in microseconds where RSA takes a noticeable part of a second.
    return ec.generate_private_key(ec.SECP256R1())


def _builder(subject: x509.Name, issuer: x509.Name, key: PrivateKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        # Backdated a little so a clock step right after generation does not
        # make the certificate "not yet valid".
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
    )


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """Signatures for every certificate (ECDSA: no key encipherment); a CA
    also signs certificates and revocation lists."""
    return x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=ca,
        crl_sign=ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )


def _make_ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    name = _name(common_name)
    cert = (
        _builder(name, name, key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _make_leaf(
    ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, leaf: Leaf
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    builder = (
        _builder(leaf.subject, ca_cert.subject, key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(leaf.usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if leaf.alt_names:
        builder = builder.add_extension(x509.SubjectAlternativeName(leaf.alt_names), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _usable(pki: PKI, apiserver_ips: tuple[str, ...]) -> bool:
    """True when every file exists, parses, is not near expiry and SANs still fit."""
    if not all(path.is_file() for path in _all_files(pki)):
        return False
    deadline = datetime.datetime.now(datetime.UTC) + RENEW_BEFORE
    try:
        for path in _certificates(pki):
            cert = x509.load_pem_x509_certificate(path.read_bytes())
            if cert.not_valid_after_utc < deadline:
                return False
        for path in _all_files(pki):
            if path.suffix == ".key":
                serialization.load_pem_private_key(path.read_bytes(), password=None)
        # Leaves must come from the CAs on disk (they are made together).
        ca = x509.load_pem_x509_certificate(pki.ca.cert.read_bytes())
        front_ca = x509.load_pem_x509_certificate(pki.front_proxy_ca.cert.read_bytes())
        for pair in (pki.apiserver, pki.admin, pki.controller_manager):
            x509.load_pem_x509_certificate(pair.cert.read_bytes()).verify_directly_issued_by(ca)
        client = x509.load_pem_x509_certificate(pki.front_proxy_client.cert.read_bytes())
        client.verify_directly_issued_by(front_ca)
        serving = x509.load_pem_x509_certificate(pki.apiserver.cert.read_bytes())
        sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        present = {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    except (ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return False
    return set(apiserver_ips) <= present


def ensure_pki(directory: Path, *, apiserver_ips: tuple[str, ...] = ("127.0.0.1",)) -> PKI:
    """Create (or reuse) the cluster's CA, certificates and service-account keys.

    `apiserver_ips` are the IP SANs of the serving certificate; the first
    Service IP (the `kubernetes` Service's ClusterIP) belongs there too.
    """
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    pki = paths(directory)
    if _usable(pki, apiserver_ips):
        return pki

    ca_cert, ca_key = _make_ca("sandbox-operator-devcluster-ca")
    front_ca_cert, front_ca_key = _make_ca("sandbox-operator-devcluster-front-proxy-ca")
    leaves: dict[CertPair, tuple[x509.Certificate, ec.EllipticCurvePrivateKey]] = {
        pki.apiserver: _make_leaf(
            ca_cert,
            ca_key,
            Leaf(
                "kube-apiserver",
                server=True,
                dns_names=APISERVER_DNS_NAMES,
                ip_addresses=apiserver_ips,
            ),
        ),
        pki.admin: _make_leaf(
            ca_cert, ca_key, Leaf("devcluster-admin", "system:masters", client=True)
        ),
        pki.controller_manager: _make_leaf(
            ca_cert, ca_key, Leaf("system:kube-controller-manager", client=True)
        ),
        pki.controller_manager_serving: _make_leaf(
            ca_cert, ca_key, Leaf.loopback_serving("kube-controller-manager")
        ),
        pki.apiserver_kubelet_client: _make_leaf(
            ca_cert, ca_key, Leaf("kube-apiserver-kubelet-client", "system:masters", client=True)
        ),
        # The aggregation layer only trusts this CN (--requestheader-allowed-names).
        pki.front_proxy_client: _make_leaf(
            front_ca_cert, front_ca_key, Leaf("front-proxy-client", client=True)
        ),
    }
    # RSA for the token signer: RS256 is what every token consumer supports.
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    pem = serialization.Encoding.PEM
    # Keys first and CA certificates last: `_usable` needs every file, so an
    # interrupted run is detected and redone rather than half reused.
    for path in _all_files(pki):
        path.unlink(missing_ok=True)
    for pair, (cert, key) in leaves.items():
        _write(pair.key, _key_pem(key), 0o600)
        _write(pair.cert, cert.public_bytes(pem), 0o644)
    _write(pki.service_account_key, _key_pem(sa_key), 0o600)
    _write(
        pki.service_account_pub,
        sa_key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo),
        0o644,
    )
    _write(pki.front_proxy_ca.key, _key_pem(front_ca_key), 0o600)
    _write(pki.front_proxy_ca.cert, front_ca_cert.public_bytes(pem), 0o644)
    _write(pki.ca.key, _key_pem(ca_key), 0o600)
    _write(pki.ca.cert, ca_cert.public_bytes(pem), 0o644)
    return pki


def ensure_leaf(pki: PKI, name: str, leaf: Leaf, *, directory: Path | None = None) -> CertPair:
    """An extra certificate `<name>.crt`/`.key` signed by the cluster CA (for
    components beyond the control plane: scheduler, kubelet, CSI sidecars),
    reused while it still matches: same CA, subject, SANs, usages and not
    near expiry. In the cluster's PKI directory unless `directory` is given
    (which must exist).

    Call after `ensure_pki`: a regenerated CA makes every leaf of the old one
    fail the check here, so they are reissued too.
    """
    where = directory or pki.directory
    pair = CertPair(where / f"{name}.crt", where / f"{name}.key")
    ca_cert = x509.load_pem_x509_certificate(pki.ca.cert.read_bytes())
    try:
        cert = x509.load_pem_x509_certificate(pair.cert.read_bytes())
        serialization.load_pem_private_key(pair.key.read_bytes(), password=None)
        cert.verify_directly_issued_by(ca_cert)
        sans: set[object] = set()
        with contextlib.suppress(x509.ExtensionNotFound):
            ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            sans = {
                *ext.get_values_for_type(x509.DNSName),
                *ext.get_values_for_type(x509.IPAddress),
            }
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        deadline = datetime.datetime.now(datetime.UTC) + RENEW_BEFORE
        if (
            cert.subject == leaf.subject
            and sans == {name.value for name in leaf.alt_names}
            and usages == set(leaf.usages)
            and cert.not_valid_after_utc > deadline
        ):
            return pair
    except (FileNotFoundError, ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        pass
    ca_key = serialization.load_pem_private_key(pki.ca.key.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{pki.ca.key}: expected an EC key")
    cert, key = _make_leaf(ca_cert, ca_key, leaf)
    _write(pair.key, _key_pem(key), 0o600)
    _write(pair.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return pair


def write_kubeconfig(path: Path, *, server: str, ca: Path, user: CertPair, context: str) -> None:
    """A kubeconfig for `server` as the client certificate `user`, trusting `ca`.
    Certificates are embedded, so the file keeps working when copied elsewhere;
    mode 0600 from the start (it holds a private key)."""

    def b64(file: Path) -> str:
        return base64.b64encode(file.read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": context, "cluster": {"server": server, "certificate-authority-data": b64(ca)}}
        ],
        "users": [
            {
                "name": context,
                "user": {
                    "client-certificate-data": b64(user.cert),
                    "client-key-data": b64(user.key),
                },
            }
        ],
        "contexts": [{"name": context, "context": {"cluster": context, "user": context}}],
        "current-context": context,
    }
    records.write_atomic(path, yaml.safe_dump(config, sort_keys=False), mode=0o600)
