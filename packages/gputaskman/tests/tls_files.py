"""A throwaway PKI for TLS tests: a CA, a server certificate for 127.0.0.1, a client
certificate the CA signed and one a rogue CA signed (written with `cryptography`)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path


def make_pki(d: Path) -> dict[str, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    out: dict[str, Path] = {}

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(cn: str, key, issuer: str, issuer_key, ca: bool) -> x509.Certificate:
        b = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                critical=False,
            )
        return b.sign(issuer_key, hashes.SHA256())

    def save(label: str, key, crt: x509.Certificate) -> None:
        k = d / f"{label}.key"
        k.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        k.chmod(0o600)
        (d / f"{label}.pem").write_bytes(crt.public_bytes(serialization.Encoding.PEM))
        out[label], out[label + "_key"] = d / f"{label}.pem", k

    keys = {}
    for ca in ("ca", "rogue_ca"):
        keys[ca] = ec.generate_private_key(ec.SECP256R1())
        save(ca, keys[ca], cert(ca, keys[ca], ca, keys[ca], True))
    for label, issuer in (("server", "ca"), ("client", "ca"), ("rogue", "rogue_ca")):
        k = ec.generate_private_key(ec.SECP256R1())
        save(label, k, cert(label, k, issuer, keys[issuer], False))
    return out
