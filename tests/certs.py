"""Certificates made on the fly for TLS tests: a CA, and certificates it signs for 127.0.0.1 / localhost
(usable by servers and, for mutual TLS, by clients)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_certs(folder: Path, name: str = "baton-test") -> dict[str, str]:
    """Writes ca.pem, cert.pem, key.pem (signed by the CA) and other-ca.pem (an unrelated CA) into folder."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    out = {}
    cas = {}
    for ca_name in ("ca", "other-ca"):
        key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} {ca_name}")])
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        cas[ca_name] = (key, cert)
        path = folder / f"{ca_name}.pem"
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[ca_name] = str(path)
    ca_key, ca_cert = cas["ca"]
    key = _key()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(_pem_key(key))
    out["cert"], out["key"] = str(folder / "cert.pem"), str(folder / "key.pem")
    return out
