"""A test CA with server and client certificates (the ``cryptography`` package), for the
tests that run NATS over TLS and mutual TLS."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    rogue_cert: str  # a client certificate from another CA
    rogue_key: str


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(folder: Path, stem: str, cn: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
           *, ca: bool = False, server: bool = False) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(cn))
               .issuer_name(issuer[0].subject if issuer else _name(cn))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                      content_commitment=False, key_encipherment=False,
                                                      data_encipherment=False, key_agreement=False,
                                                      encipher_only=False, decipher_only=False), critical=True)
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
    (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / f"{stem}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    (folder / f"{stem}.key").chmod(0o600)
    return cert, key


def make_pki(d: Path) -> Pki:
    """A CA, a server certificate for localhost/127.0.0.1, a client certificate, and a client
    certificate from another CA, written to ``d``."""
    ca = _issue(d, "ca", "zml test CA", None, ca=True)
    _issue(d, "server", "localhost", ca, server=True)
    _issue(d, "client", "zml service", ca)
    rogue_ca = _issue(d, "rogue-ca", "someone else's CA", None, ca=True)
    _issue(d, "rogue", "intruder", rogue_ca)
    return Pki(*(str(d / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key",
                                      "rogue.pem", "rogue.key")))
