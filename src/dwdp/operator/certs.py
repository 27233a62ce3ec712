"""Webhook serving certificates made with ``cryptography`` (kopf's own self-signed helper
needs oscrypto, which fails on OpenSSL 3).

:func:`make_webhook_certs` writes a CA and a server certificate signed by it, valid for the
given DNS names and IP addresses, as ``ca.crt``, ``tls.crt`` and ``tls.key`` (the layout of
a ``kubernetes.io/tls`` Secret plus the CA, which the Helm chart also uses).
:func:`temporary_webhook_certs` does the same in a fresh temporary folder and removes that
folder (it holds a private key) when its ``with`` block ends, however it ends.

:func:`new_key`, :func:`write_key`, :func:`cert_builder` and :func:`key_usage` are the x509
pieces of both, also the local cluster's (``dwdp_dev.devcluster.pki``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

__all__ = [
    "CertFiles",
    "cert_builder",
    "key_usage",
    "make_webhook_certs",
    "new_key",
    "temporary_webhook_certs",
    "write_key",
]

TEMP_PREFIX = "dwdp-webhook-"
"""Name prefix of the temporary folders of :func:`temporary_webhook_certs`."""

VALIDITY_DAYS = 365
"""Lifetime of both certificates, in days."""


@dataclass(frozen=True, slots=True)
class CertFiles:
    """Paths of the CA certificate, the server certificate and its private key (PEM)."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_dir(cls, folder: Path) -> CertFiles:
        """The files of ``folder`` in the Secret layout (``ca.crt``, ``tls.crt``,
        ``tls.key``)."""
        return cls(folder / "ca.crt", folder / "tls.crt", folder / "tls.key")


def new_key() -> ec.EllipticCurvePrivateKey:
    """A fresh ECDSA P-256 private key."""
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """Write ``key`` to ``path`` as unencrypted PKCS#8 PEM, then make it readable by its
    owner only."""
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def cert_builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    not_before: dt.datetime,
    not_after: dt.datetime,
) -> x509.CertificateBuilder:
    """A certificate of ``subject`` for ``public_key`` issued by ``issuer``, with a random
    serial number, valid from ``not_before`` to ``not_after``; the caller adds the
    extensions and signs it."""
    from cryptography import x509

    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
    )


def key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    """Digital signatures, plus with ``cert_sign`` (a CA) certificate and CRL signing;
    nothing else."""
    from cryptography import x509

    return x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )


def make_webhook_certs(folder: Path, hosts: Sequence[str]) -> CertFiles:
    """Write a fresh CA and a server certificate for ``hosts`` (DNS names or IP
    addresses; the first is the common name) into ``folder``.

    Raises:
        ValueError: when ``hosts`` is empty.
        OSError: when ``folder`` cannot be written.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not hosts:
        raise ValueError("a webhook certificate needs at least one host name or address")
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=VALIDITY_DAYS)
    ca_key = new_key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dwdp-operator webhook CA")])
    ca_cert = (
        cert_builder(ca_name, ca_name, ca_key.public_key(), start, end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(key_usage(cert_sign=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    key = new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    cert = (
        cert_builder(subject, ca_name, key.public_key(), start, end)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = CertFiles.in_dir(folder)
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_key(files.key, key)
    return files


@contextlib.contextmanager
def temporary_webhook_certs(hosts: Sequence[str]) -> Iterator[CertFiles]:
    """:func:`make_webhook_certs` into a new private folder of the temporary directory
    (``$TMPDIR``), removed with its private key when the block ends (a normal exit, an
    exception, SIGTERM turned into one); only a killed process leaves it behind."""
    folder = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))
    try:
        yield make_webhook_certs(folder, hosts)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
