"""A self-signed serving certificate made at start-up: the EPP's (GIE's --secure-serving default)
and the operator's External Metrics API (the aggregation layer is told to skip verifying it)."""

from __future__ import annotations

import datetime as dt
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def self_signed_cert(hostnames: tuple[str, ...] = ("localhost",), days: int = 3650) -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM). Envoy's ext_proc cluster does not verify it, as in GIE."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvgate"),
            x509.NameAttribute(NameOID.COMMON_NAME, "kvgate-epp"),
        ]
    )
    alt: list[x509.GeneralName] = [x509.DNSName(h) for h in hostnames]
    alt.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .sign(key, hashes.SHA256())
    )
    return (
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )
