"""Certificates and mutually authenticated TLS 1.3 contexts.

Every channel (client->server, server<->server, dealer->server) uses TLS 1.3 with a
certificate on both ends, issued by the deployment's own CA (``starfish keys init``).
A peer's identity is the single DNS name in its certificate (``server0``, ``server1``,
``dealer``, ``admin``, ``client-<id>``); we check it explicitly on both sides, because
the server side of a TLS handshake verifies the chain but not who the client claims to be.
"""

from __future__ import annotations

import datetime as _dt
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_NAME = "starfish-ca"
PARTY_NAMES = ("server0", "server1")
DEALER_NAME = "dealer"
ADMIN_NAME = "admin"
_VALIDITY = _dt.timedelta(days=825)


class IdentityError(ssl.SSLError):
    """The peer presented a valid certificate for the wrong identity."""


@dataclass(frozen=True)
class Identity:
    """Paths of one participant's credentials in a key directory."""

    name: str
    cert: Path
    key: Path
    ca: Path


def identity(keys_dir: str | os.PathLike, name: str) -> Identity:
    d = Path(keys_dir)
    ident = Identity(name, d / f"{name}.pem", d / f"{name}.key", d / "ca.pem")
    for p in (ident.cert, ident.key, ident.ca):
        if not p.exists():
            raise FileNotFoundError(f"missing credential {p} (run `starfish keys init {d}`)")
    return ident


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def create_ca(keys_dir: str | os.PathLike) -> None:
    d = Path(keys_dir)
    d.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _dt.datetime.now(_dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(CA_NAME))
        .issuer_name(_name(CA_NAME))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    _write_private(d / "ca.key", _key_pem(key))
    (d / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def issue(keys_dir: str | os.PathLike, name: str) -> Identity:
    """Issue a certificate for ``name`` signed by the CA in ``keys_dir``."""
    d = Path(keys_dir)
    ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = _dt.datetime.now(_dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_private(d / f"{name}.key", _key_pem(key))
    (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return identity(d, name)


def init_keys(keys_dir: str | os.PathLike, clients: int = 0) -> list[str]:
    """Write a CA and every certificate a deployment needs; refuse to overwrite a CA."""
    d = Path(keys_dir)
    if (d / "ca.key").exists():
        raise FileExistsError(f"{d / 'ca.key'} exists; refusing to replace a deployment's CA")
    create_ca(d)
    names = [*PARTY_NAMES, DEALER_NAME, ADMIN_NAME] + [f"client-{i}" for i in range(clients)]
    for n in names:
        issue(d, n)
    return names


def _base_context(purpose: int, ident: Identity) -> ssl.SSLContext:
    proto = ssl.PROTOCOL_TLS_SERVER if purpose == ssl.Purpose.CLIENT_AUTH else ssl.PROTOCOL_TLS_CLIENT
    ctx = ssl.SSLContext(proto)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cafile=str(ident.ca))
    ctx.load_cert_chain(certfile=str(ident.cert), keyfile=str(ident.key))
    return ctx


def server_context(ident: Identity) -> ssl.SSLContext:
    """Context for the accepting side; the client's certificate is required."""
    return _base_context(ssl.Purpose.CLIENT_AUTH, ident)


def client_context(ident: Identity) -> ssl.SSLContext:
    """Context for the connecting side; hostname checking pins the server's identity."""
    ctx = _base_context(ssl.Purpose.SERVER_AUTH, ident)
    ctx.check_hostname = True
    return ctx


def peer_name(cert: dict | None) -> str:
    """The single DNS name of a verified peer certificate (as returned by getpeercert())."""
    if not cert:
        raise IdentityError("peer presented no certificate")
    names = [v for k, v in cert.get("subjectAltName", ()) if k == "DNS"]
    if len(names) != 1:
        raise IdentityError(f"peer certificate must carry exactly one DNS name, has {names}")
    return names[0]
