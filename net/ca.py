"""The deployment's certificate authority: create it, sign certificates, revoke them.

Why a module apart from ``net/tls.py``: the daemons need certificates, contexts and the
revocation list, never the CA's private key; everything here needs that key and runs offline
(``starfish keys ...``) on the machine that keeps it. A host that holds ``ca.key`` can mint
any identity, ``admin`` included, so the key lives in its own directory (the *CA directory*),
never in a *key directory* that a daemon reads.

CA directory (0700, every file 0600): ``ca.key``, ``ca.pem``, ``crl.pem`` (the authoritative
revocation list) and ``issued.txt`` (one line per certificate signed: serial, name, expiry;
revocation by name needs it, because the certificates themselves go to their owners).
Key directory (0700, every file 0600): ``ca.pem``, ``crl.pem`` (a copy) and
``<name>.pem``/``<name>.key`` of the identities it holds.

Revocation is a CRL signed by the CA, not a plain deny list: a daemon's host cannot forge or
shorten it without the CA key, and OpenSSL checks it inside every handshake (``net/tls.py``).
"""

from __future__ import annotations

import datetime as _dt
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_NAME = "starfish-ca"
CA_KEY_FILE = "ca.key"
CA_CERT_FILE = "ca.pem"
CRL_FILE = "crl.pem"
ISSUED_FILE = "issued.txt"
#: the CA outlives the certificates it signs by far: renewing it means handing every
#: participant a new ca.pem, renewing a leaf only that participant a new certificate.
CA_DAYS = 1825
#: backdating tolerates clocks that run behind the signing machine's; a CRL "not yet valid"
#: would make every handshake fail, hence the larger margin there.
_CERT_BACKDATE = _dt.timedelta(minutes=5)
_CRL_BACKDATE = _dt.timedelta(hours=1)
# one DNS label: the identity is the certificate's single DNS name (net/tls.py)
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class Issued:
    """One line of the CA's ``issued.txt``."""

    serial: int
    name: str
    not_after: _dt.datetime


def private_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` if needed and make it 0700 (also when it existed: it holds keys)."""
    d = Path(path)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)  # mkdir's mode is filtered by the umask; an existing dir keeps its own
    return d


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` as a 0600 file, atomically: daemons re-read crl.pem while it is replaced,
    and must see either the old list or the new one, never half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem(obj) -> bytes:
    return obj.public_bytes(serialization.Encoding.PEM)


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def create_ca(ca_dir: str | os.PathLike, *, days: int = CA_DAYS) -> x509.Certificate:
    """A new CA key and self-signed certificate, an empty CRL and an empty issued list."""
    d = private_dir(ca_dir)
    if (d / CA_KEY_FILE).exists():
        raise FileExistsError(f"{d / CA_KEY_FILE} exists; refusing to replace a deployment's CA")
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(CA_NAME))
        .issuer_name(_name(CA_NAME))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CERT_BACKDATE)
        .not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(  # key_cert_sign and crl_sign only
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    write_private(d / CA_KEY_FILE, key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    write_private(d / CA_CERT_FILE, _pem(cert))
    write_private(d / ISSUED_FILE, b"")
    _write_crl(d, key, cert, {}, number=1)
    return cert


def _load_ca(ca_dir: Path):
    key_path = ca_dir / CA_KEY_FILE
    if not key_path.exists():
        raise FileNotFoundError(f"no CA key at {key_path}: run this on the machine that keeps the "
                                f"offline CA directory (--ca-dir)")
    key = serialization.load_pem_private_key(key_path.read_bytes(), None)
    return key, x509.load_pem_x509_certificate((ca_dir / CA_CERT_FILE).read_bytes())


def sign(ca_dir: str | os.PathLike, keys_dir: str | os.PathLike, name: str, *, days: int,
         replace: bool = False) -> Path:
    """Key and certificate for identity ``name``, valid ``days`` days, into ``keys_dir``;
    records it in the CA's ``issued.txt`` and refreshes ``ca.pem``/``crl.pem`` there."""
    if not _NAME_RE.match(name):
        raise ValueError(f"{name!r} is not a DNS label (a-z, 0-9, '-')")
    if not 1 <= days <= 3650:
        raise ValueError(f"days must be 1..3650, got {days}")
    ca_d, keys_d = Path(ca_dir), private_dir(keys_dir)
    ca_key, ca_cert = _load_ca(ca_d)
    if (keys_d / f"{name}.pem").exists() and not replace:
        raise FileExistsError(f"{keys_d / (name + '.pem')} exists; refusing to replace it "
                              f"(renewal: --replace; the old certificate stays valid until it "
                              f"expires unless revoked)")
    now = _now()
    not_after = now + _dt.timedelta(days=days)
    if not_after > ca_cert.not_valid_after_utc:
        raise ValueError(f"a {days}-day certificate would outlive the CA "
                         f"(valid until {ca_cert.not_valid_after_utc:%Y-%m-%d})")
    key = ec.generate_private_key(ec.SECP256R1())
    serial = x509.random_serial_number()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(now - _CERT_BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    write_private(keys_d / f"{name}.key", key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    write_private(keys_d / f"{name}.pem", _pem(cert))
    # recorded before anything else can fail: a certificate that is out must be revocable by name
    fd = os.open(ca_d / ISSUED_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(f"{serial:x} {name} {not_after.isoformat(timespec='seconds')}\n")
    publish(ca_d, keys_d)
    return keys_d / f"{name}.pem"


def issued(ca_dir: str | os.PathLike) -> list[Issued]:
    out = []
    for line in (Path(ca_dir) / ISSUED_FILE).read_text().splitlines():
        if line.strip():
            serial, name, not_after = line.split()
            out.append(Issued(int(serial, 16), name, _dt.datetime.fromisoformat(not_after)))
    return out


def load_crl(path: str | os.PathLike) -> x509.CertificateRevocationList:
    return x509.load_pem_x509_crl(Path(path).read_bytes())


def crl_number(crl: x509.CertificateRevocationList) -> int:
    return crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number


def revoked_serials(crl: x509.CertificateRevocationList) -> dict[int, _dt.datetime]:
    return {r.serial_number: r.revocation_date_utc for r in crl}


def _write_crl(ca_dir: Path, key, cert: x509.Certificate, revoked: dict[int, _dt.datetime],
               number: int) -> None:
    now = _now()
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(cert.subject)
        .last_update(now - _CRL_BACKDATE)
        # OpenSSL refuses every certificate once a CRL's next update has passed; the daemons
        # learn of new revocations from the file changing, not from this date, so it is the
        # CA's own end rather than a refresh deadline nobody would be there to meet.
        .next_update(cert.not_valid_after_utc)
        .add_extension(x509.CRLNumber(number), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()),
                       critical=False)
    )
    for serial, when in sorted(revoked.items()):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build())
    write_private(ca_dir / CRL_FILE, _pem(builder.sign(key, hashes.SHA256())))


def revoke(ca_dir: str | os.PathLike, *, name: str | None = None,
           serials: tuple[int, ...] = ()) -> list[Issued]:
    """Add every certificate issued to ``name`` and every serial in ``serials`` to the CRL.

    Returns the newly revoked records (a serial the CA has no record of is revoked all the
    same, with name ``?``). Copy ``crl.pem`` to the key directories with ``publish``.
    """
    d = Path(ca_dir)
    key, cert = _load_ca(d)
    crl = load_crl(d / CRL_FILE)
    if not crl.is_signature_valid(key.public_key()):
        raise ValueError(f"{d / CRL_FILE} is not signed by this CA")
    known = {r.serial: r for r in issued(d)}
    targets = [r for r in known.values() if r.name == name] if name else []
    if name and not targets:
        raise LookupError(f"no certificate was issued to {name!r} (see {d / ISSUED_FILE})")
    targets += [known.get(s, Issued(s, "?", _now())) for s in serials]
    current = revoked_serials(crl)
    new = [r for r in targets if r.serial not in current]
    now = _now()
    current.update({r.serial: now for r in new})
    _write_crl(d, key, cert, current, number=crl_number(crl) + 1)
    return new


def publish(ca_dir: str | os.PathLike, keys_dir: str | os.PathLike) -> None:
    """Copy the CA certificate and the current CRL into a key directory (never the key)."""
    ca_d, keys_d = Path(ca_dir), private_dir(keys_dir)
    if ca_d.resolve() == keys_d.resolve():
        return
    for fname in (CA_CERT_FILE, CRL_FILE):
        write_private(keys_d / fname, (ca_d / fname).read_bytes())
