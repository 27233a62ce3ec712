"""Webhook serving certificates made with ``cryptography`` (kopf's own self-signed helper
needs oscrypto, which fails on OpenSSL 3).

:func:`make_webhook_certs` writes a CA and a server certificate signed by it, valid for the
given DNS names and IP addresses, as ``ca.crt``, ``tls.crt`` and ``tls.key`` (the layout of
a ``kubernetes.io/tls`` Secret plus the CA, which the Helm chart also uses).
:func:`temporary_webhook_certs` does the same in a fresh temporary folder and removes that
folder (it holds a private key) when its ``with`` block ends, however it ends.
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

__all__ = ["CertFiles", "make_webhook_certs", "temporary_webhook_certs"]

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


def make_webhook_certs(folder: Path, hosts: Sequence[str]) -> CertFiles:
    """Write a fresh CA and a server certificate for ``hosts`` (DNS names or IP
    addresses; the first is the common name) into ``folder``.

    Raises:
        ValueError: when ``hosts`` is empty.
        OSError: when ``folder`` cannot be written.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not hosts:
        raise ValueError("a webhook certificate needs at least one host name or address")
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dwdp-operator webhook CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALIDITY_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALIDITY_DAYS))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = CertFiles.in_dir(folder)
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    files.key.chmod(0o600)
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
