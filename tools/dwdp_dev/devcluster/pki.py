"""Certificates and keys of one local cluster, made with ``cryptography`` (ECDSA P-256).

Files in ``<state>/pki``: ``ca.crt/.key`` (the cluster CA, also the client CA),
``apiserver.crt/.key`` (serving: the addresses the caller names and the kubernetes service names),
``admin.crt/.key`` (client, group system:masters), ``kubelet.crt/.key`` (the process
kubelet's serving certificate, for ``kubectl logs``), and ``sa.key/.pub`` (the
service-account token signing key). Existing files are kept, so ``up`` is idempotent.
A real node adds :func:`ensure_node_pki`'s ``node``, ``node-serving`` and ``proxy``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dwdp.operator.certs import cert_builder, key_usage, new_key, write_key

_VALIDITY = dt.timedelta(days=3650)


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _load(pki: Path, name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate((pki / f"{name}.crt").read_bytes())
    key = serialization.load_pem_private_key((pki / f"{name}.key").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return cert, key


def _issue(
    pki: Path,
    name: str,
    subject: x509.Name,
    *,
    server: bool,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    dns: tuple[str, ...] = (),
    ips: tuple[str, ...] = (),
) -> None:
    if (pki / f"{name}.crt").exists() and (pki / f"{name}.key").exists():
        return
    ca_cert, ca_key = ca
    key = new_key()
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    builder = (
        cert_builder(subject, ca_cert.subject, key.public_key(), now, now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(key_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
    )
    if dns or ips:
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    write_key(pki / f"{name}.key", key)
    (pki / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _names_ips(path: Path, ips: tuple[str, ...]) -> bool:
    """Whether the certificate at ``path`` exists and names every address of ``ips``."""
    if not path.exists():
        return False
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    return set(ips) <= {str(i) for i in san.get_values_for_type(x509.IPAddress)}


def ensure_pki(pki: Path, apiserver_ips: tuple[str, ...]) -> None:
    """Create every missing certificate and key of a cluster under ``pki``; the apiserver's
    serving certificate names ``apiserver_ips`` (issued again when one is missing)."""
    pki.mkdir(parents=True, exist_ok=True)
    if not ((pki / "ca.crt").exists() and (pki / "ca.key").exists()):
        key = new_key()
        now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
        subject = _name("dwdp-devcluster-ca")
        cert = (
            cert_builder(subject, subject, key.public_key(), now, now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(key_usage(cert_sign=True), critical=True)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        write_key(pki / "ca.key", key)
        (pki / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    ca = _load(pki, "ca")
    if not _names_ips(pki / "apiserver.crt", apiserver_ips):
        (pki / "apiserver.crt").unlink(missing_ok=True)
    _issue(
        pki,
        "apiserver",
        _name("kube-apiserver"),
        server=True,
        ca=ca,
        dns=(
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ),
        ips=apiserver_ips,
    )
    _issue(pki, "admin", _name("kubernetes-admin", "system:masters"), server=False, ca=ca)
    _issue(
        pki,
        "kubelet",
        _name("dwdp-process-kubelet"),
        server=True,
        ca=ca,
        dns=("localhost",),
        ips=("127.0.0.1",),
    )
    if not (pki / "sa.key").exists():
        key = new_key()
        write_key(pki / "sa.key", key)
        (pki / "sa.pub").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )


def ensure_node_pki(pki: Path, node_name: str, node_ip: str) -> None:
    """The real node's certificates under ``pki``: ``node.crt/.key`` (the kubelet's client:
    ``system:node:<node_name>`` in ``system:nodes``, for the Node authorizer),
    ``node-serving.crt/.key`` (the kubelet's serving certificate for ``node_ip``, 127.0.0.1
    and the node name; issued again when the node IP changed), ``proxy.crt/.key``
    (kube-proxy's client, ``system:kube-proxy``) and ``coredns.crt/.key`` (the cluster DNS
    server's client, ``system:coredns``, bound to its read-only role by
    :mod:`dwdp_dev.devcluster.clusterdns`)."""
    ca = _load(pki, "ca")
    if not _names_ips(pki / "node-serving.crt", (node_ip,)):
        (pki / "node-serving.crt").unlink(missing_ok=True)
    _issue(pki, "node", _name(f"system:node:{node_name}", "system:nodes"), server=False, ca=ca)
    _issue(
        pki,
        "node-serving",
        _name(node_name),
        server=True,
        ca=ca,
        dns=(node_name, "localhost"),
        ips=(node_ip, "127.0.0.1"),
    )
    _issue(pki, "proxy", _name("system:kube-proxy"), server=False, ca=ca)
    _issue(pki, "coredns", _name("system:coredns"), server=False, ca=ca)
