"""The fleet's TLS material, made by `prefixflow cluster config` when none is given: one
CA (kept under `<out>/ca/`, its key never leaves the operator's machine) and, per node, a
certificate for the node's address and name, used by its nats-server for clients and, in
both directions, for the routes to the other servers (so it is valid for server and
client authentication). Uses `cryptography`; ECDSA P-256 keys.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
NODE_DAYS = 825


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "prefixflow"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common)])


def load_or_make_ca(directory: Path, cluster: str) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) of the fleet's CA: the one in `directory` if there is
    one (a second run keeps it, so the nodes' certificates stay trusted), else a new one."""
    cert_path, key_path = directory / "ca.pem", directory / "ca-key.pem"
    if cert_path.exists() and key_path.exists():
        return cert_path.read_bytes(), key_path.read_bytes()
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    name = _name(f"prefixflow CA ({cluster})")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def node_certificate(ca_pem: bytes, ca_key_pem: bytes, name: str, hosts: list[str]) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) for a node known as `name` and reached at `hosts`
    (addresses or DNS names); also valid for 127.0.0.1 and localhost."""
    ca = x509.load_pem_x509_certificate(ca_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for host in dict.fromkeys([*hosts, name, "127.0.0.1", "localhost"]):
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=NODE_DAYS))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)
