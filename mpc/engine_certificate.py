"""The two-party engine link's own key: a fresh EC key and a self-signed certificate per engine.

Why its own module: the engine's link trusts exactly the peer's certificate, exchanged over the
servers' authenticated channel (``mpc.spu_engine``), so each engine needs a key that exists for
it alone and is never a certificate of the deployment's CA.
"""

from __future__ import annotations

import datetime
import os


def session_certificate(directory: str, name: str) -> tuple[str, str, bytes]:
    """A fresh EC key and a self-signed certificate valid for a day: (cert path, key path, PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            # a trust anchor for exactly one peer: it may only sign itself
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    cert_path, key_path = os.path.join(directory, "own.crt"), os.path.join(directory, "own.key")
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    with open(cert_path, "wb") as f:
        f.write(pem)
    return cert_path, key_path, pem
