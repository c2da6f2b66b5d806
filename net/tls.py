"""Certificates and mutually authenticated TLS 1.3 contexts, with revocation.

Every channel (client->server, server<->server, dealer->server) uses TLS 1.3 with a
certificate on both ends, issued by the deployment's own CA (``net/ca.py``, ``starfish keys``).
A peer's identity is the single DNS name in its certificate (``server0``, ``server1``,
``dealer``, ``admin``, ``client-<id>``); we check it explicitly on both sides, because
the server side of a TLS handshake verifies the chain but not who the client claims to be.

Revocation: every context made here checks the peer's certificate against ``crl.pem`` of its
key directory inside the handshake (OpenSSL's CRL check), so it covers every kind of peer
without a call in the transport. The contexts notice when ``crl.pem`` changes (one ``stat``
per handshake) and run the next handshakes with the new list: a revocation takes effect
without restarting a daemon. Connections already established stay up.

A daemon never needs the CA's private key, and refuses to start next to it
(``check_key_dir``).
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import ssl
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from net import ca as _ca
from net.ca import CA_CERT_FILE, CA_KEY_FILE, CRL_FILE

CA_NAME = _ca.CA_NAME
PARTY_NAMES = ("server0", "server1")
DEALER_NAME = "dealer"
#: at most this many workers per server (``[deployment] workers``; issue 30)
MAX_WORKERS = 64
ADMIN_NAME = "admin"
#: default certificate lifetimes (days). Services are few and re-keyed by the operator;
#: client and admin certificates are many, handed out, and more likely to leak.
SERVICE_DAYS = 365
USER_DAYS = 90
#: ``check_key_dir`` warns this many days before a certificate expires
EXPIRY_WARNING_DAYS = 14

log = logging.getLogger("starfish.tls")


class IdentityError(ssl.SSLError):
    """The peer presented a valid certificate for the wrong identity."""


class KeyDirError(RuntimeError):
    """A key directory a daemon must not run with (the CA key in it, no CA or CRL)."""


@dataclass(frozen=True)
class Identity:
    """Paths of one participant's credentials in a key directory."""

    name: str
    cert: Path
    key: Path
    ca: Path
    crl: Path


def identity(keys_dir: str | os.PathLike, name: str) -> Identity:
    d = Path(keys_dir)
    ident = Identity(name, d / f"{name}.pem", d / f"{name}.key", d / CA_CERT_FILE, d / CRL_FILE)
    for p in (ident.cert, ident.key, ident.ca, ident.crl):
        if not p.exists():
            raise MissingCredential(p, d, name, cert_exists=ident.cert.exists())
    return ident


class MissingCredential(FileNotFoundError):
    """A certificate, key, CA certificate or CRL is not in the key directory.

    The message says which file and the command that writes it; when the certificate is
    there but its key is not, re-issuing needs ``--replace`` (``keys issue`` refuses to
    overwrite a certificate otherwise, which is what a user following the hint hit).
    """

    def __init__(self, path: Path, keys_dir: Path, name: str, *, cert_exists: bool) -> None:
        if path.name in (CA_CERT_FILE, CRL_FILE):
            hint = (f"copy {path.name} from the deployment's CA (`starfish keys init` or "
                    f"`starfish init-deployment` wrote it)")
        else:
            hint = (f"`starfish keys issue --ca-dir CA --keys-dir {keys_dir} --name {name}"
                    f"{' --replace' if cert_exists else ''}` writes it")
        super().__init__(f"missing credential {path} for {name!r}: {hint}")
        self.path = path


def party_name(rank: int, worker: int | None = None) -> str:
    """The certificate name of server ``rank`` (0 or 1), or of its worker ``worker``.

    Worker k of server 0 and worker k of server 1 form pair k: they compute coordinate shard k
    over their own link and accept only each other (``server0-w3`` talks to ``server1-w3``,
    never to ``server1-w2`` nor to ``server1``), so a worker of one pair cannot join another.
    """
    if rank not in (0, 1):
        raise ValueError(f"rank must be 0 or 1, not {rank!r}")
    if worker is None:
        return PARTY_NAMES[rank]
    if isinstance(worker, bool) or not isinstance(worker, int) or not 0 <= worker < MAX_WORKERS:
        raise ValueError(f"a worker index is 0..{MAX_WORKERS - 1}, not {worker!r}")
    return f"{PARTY_NAMES[rank]}-w{worker}"


def worker_of(name: str) -> tuple[int, int] | None:
    """(rank, worker) of a worker certificate name such as ``server1-w3``; None for any other."""
    for rank in (0, 1):
        prefix = f"{PARTY_NAMES[rank]}-w"
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            k = int(name[len(prefix):])
            if str(k) == name[len(prefix):] and k < MAX_WORKERS:
                return rank, k
    return None


def default_days(name: str) -> int:
    service = name in (*PARTY_NAMES, DEALER_NAME) or worker_of(name) is not None
    return SERVICE_DAYS if service else USER_DAYS


def issue(keys_dir: str | os.PathLike, name: str, *, ca_dir: str | os.PathLike | None = None,
          days: int | None = None, replace: bool = False) -> Identity:
    """Issue a certificate for ``name`` into ``keys_dir``, signed by the CA in ``ca_dir``
    (default: ``keys_dir`` itself, the test-only layout of ``init_keys``)."""
    _ca.sign(keys_dir if ca_dir is None else ca_dir, keys_dir, name,
             days=days or default_days(name), replace=replace)
    return identity(keys_dir, name)


def init_keys(keys_dir: str | os.PathLike, clients: int = 0, *,
              ca_dir: str | os.PathLike | None = None, workers: int = 0) -> list[str]:
    """A new CA and every certificate a deployment needs; refuses to overwrite a CA.

    Deployments pass ``ca_dir`` (``starfish keys init``, ``init-deployment``), so ``keys_dir``
    gets certificates, keys, ``ca.pem`` and ``crl.pem`` only. ``ca_dir=None`` writes ``ca.key``
    into ``keys_dir`` too: for throw-away test keys only (``mpc.launcher`` deletes it or keeps
    it for tests that issue more); no daemon starts on such a directory. ``workers`` = K (a
    server as a coordinator and K workers) adds ``server0-w0`` .. ``server1-w{K-1}``.
    """
    names = [*PARTY_NAMES, DEALER_NAME, ADMIN_NAME] + [f"client-{i}" for i in range(clients)]
    if workers:
        names += [party_name(r, k) for k in range(workers) for r in (0, 1)]
    ca_d = Path(keys_dir if ca_dir is None else ca_dir)
    for p in [ca_d / CA_KEY_FILE] + [Path(keys_dir) / f"{n}.pem" for n in names]:
        if p.exists():  # checked before anything is written: no half-made deployment
            raise FileExistsError(f"{p} exists; refusing to replace a deployment's CA or certificates")
    _ca.create_ca(ca_d)
    for n in names:
        issue(keys_dir, n, ca_dir=ca_d)
    return names


# ------------------------------------------------------------------ contexts
def _configure(ctx: ssl.SSLContext, ident: Identity, server_side: bool, *,
               with_crl: bool = True) -> ssl.SSLContext:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cafile=str(ident.ca))
    if with_crl:
        ctx.load_verify_locations(cafile=str(ident.crl))
    # The chain is the CA and the leaf, so checking the leaf is checking everything. Without a
    # loaded CRL this flag fails every verification ("unable to get certificate CRL"): the
    # fail-closed state ``_RevocationAwareContext`` falls back to.
    ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    ctx.load_cert_chain(certfile=str(ident.cert), keyfile=str(ident.key))
    if server_side:
        # A resumed TLS session skips the certificate check; with no tickets there is nothing
        # to resume, so a revoked client cannot ride a session from before its revocation.
        # Our channels never resume anyway.
        ctx.num_tickets = 0
    else:
        ctx.check_hostname = True  # pins the server's identity (its DNS name)
    return ctx


def _file_key(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _verified_crl(ca: Path, crl_path: Path) -> x509.CertificateRevocationList:
    """The CRL at ``crl_path`` after checking the CA of ``ca`` signed it (raises otherwise):
    a list from another deployment must neither replace ours nor raise its number."""
    crl = _ca.load_crl(crl_path)
    ca_cert = x509.load_pem_x509_certificate(ca.read_bytes())
    if not crl.is_signature_valid(ca_cert.public_key()):
        raise ValueError(f"{crl_path} is not signed by the deployment's CA")
    return crl


class _RevocationAwareContext(ssl.SSLContext):
    """An SSLContext that follows its key directory's ``crl.pem``.

    OpenSSL reads a CRL when it is loaded into a context and a context cannot drop one, so
    when ``crl.pem`` changes (inode, mtime or size) the handshakes from then on run in a
    context built afresh with the new list (which also gets fresh session-ticket keys).
    That context is configured by ``_configure``, not copied from this one: configure
    contexts through this module, not by setting attributes afterwards.
    """

    def _track(self, ident: Identity, server_side: bool, seen, number: int) -> None:
        self._ident, self._server_side = ident, server_side
        self._lock = threading.Lock()
        self._crl_seen, self._crl_number = seen, number
        self._active: ssl.SSLContext = self

    def _current(self) -> ssl.SSLContext:
        seen = _file_key(self._ident.crl)  # before reading: a change while we read shows next time
        with self._lock:
            if seen != self._crl_seen:
                self._crl_seen = seen
                self._active = self._reload()
            return self._active

    def _reload(self) -> ssl.SSLContext:
        where = f"{self._ident.name}: {self._ident.crl}"
        try:
            number = _ca.crl_number(_verified_crl(self._ident.ca, self._ident.crl))
            if number < self._crl_number:
                # an older list would un-revoke certificates: keep the one we have
                log.error("%s: CRL number %d is older than the loaded %d; kept the loaded list",
                          where, number, self._crl_number)
                return self._active
            ctx = _configure(ssl.SSLContext(self.protocol), self._ident, self._server_side)
        except (OSError, ValueError, ssl.SSLError) as exc:
            log.error("%s: cannot use the revocation list (%s); refusing every peer until it "
                      "is fixed", where, exc)
            return _configure(ssl.SSLContext(self.protocol), self._ident, self._server_side,
                              with_crl=False)
        self._crl_number = number
        log.info("%s: revocation list %d loaded", where, number)
        return ctx

    def wrap_bio(self, incoming, outgoing, server_side=False, server_hostname=None, session=None):
        return ssl.SSLContext.wrap_bio(self._current(), incoming, outgoing, server_side,
                                       server_hostname, session)

    def wrap_socket(self, sock, *args, **kwargs):
        return ssl.SSLContext.wrap_socket(self._current(), sock, *args, **kwargs)


class RevocationWatch:
    """The serials on a key directory's ``crl.pem``, re-read when the file changes, for the
    connections that are already open: the contexts above check the CRL inside each *new*
    handshake only, so a revoked client's open connection used to be served on (issue 25,
    finding 6: 151 s after ``keys revoke`` its upload was committed). The same rules as the
    contexts: the list must be signed by the CA, an older list number is ignored (no
    un-revoking by copying back an old file), and an unusable file fails closed (every serial
    counts as revoked until it is fixed, as every handshake fails meanwhile).
    """

    def __init__(self, keys_dir: str | os.PathLike) -> None:
        d = Path(keys_dir)
        self._ca, self._crl = d / CA_CERT_FILE, d / CRL_FILE
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._number = -1
        self._serials: frozenset[int] = frozenset()
        self._broken = False
        #: counts the changes seen, so that several callers each notice every change
        self.generation = 0
        self.refresh()

    def refresh(self) -> bool:
        """Re-read the list if the file changed (one ``stat`` otherwise); whether it changed."""
        seen = _file_key(self._crl)
        with self._lock:
            if seen == self._seen:
                return False
            self._seen = seen
            try:
                crl = _verified_crl(self._ca, self._crl)
                number = _ca.crl_number(crl)
            except (OSError, ValueError) as exc:
                log.error("%s: cannot use the revocation list (%s); open connections are closed "
                          "until it is fixed", self._crl, exc)
                self._broken = True
                self.generation += 1
                return True
            self._broken = False
            if number < self._number:
                return False
            self._number = number
            self._serials = frozenset(_ca.revoked_serials(crl))
            self.generation += 1
            return True

    def revoked(self, cert: dict | None) -> bool:
        """Whether a peer's certificate (``getpeercert()``) is revoked by the current list."""
        if self._broken or not cert:
            return True
        return int(cert["serialNumber"], 16) in self._serials


def _tracking_context(ident: Identity, server_side: bool) -> ssl.SSLContext:
    seen = _file_key(ident.crl)
    # a bad list at start-up is an error to fix, not a reason to run refusing everyone
    number = _ca.crl_number(_verified_crl(ident.ca, ident.crl))
    proto = ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT
    ctx = _configure(_RevocationAwareContext(proto), ident, server_side)
    ctx._track(ident, server_side, seen, number)
    return ctx


def server_context(ident: Identity) -> ssl.SSLContext:
    """Context for the accepting side; the client's certificate is required and checked
    against the CRL at every handshake."""
    return _tracking_context(ident, server_side=True)


def client_context(ident: Identity) -> ssl.SSLContext:
    """Context for the connecting side; hostname checking pins the server's identity, and
    the server's certificate is checked against the CRL too."""
    return _tracking_context(ident, server_side=False)


def peer_name(cert: dict | None) -> str:
    """The single DNS name of a verified peer certificate (as returned by getpeercert())."""
    if not cert:
        raise IdentityError("peer presented no certificate")
    names = [v for k, v in cert.get("subjectAltName", ()) if k == "DNS"]
    if len(names) != 1:
        raise IdentityError(f"peer certificate must carry exactly one DNS name, has {names}")
    return names[0]


# ------------------------------------------------------------------ key directory checks
def is_revoked(keys_dir: str | os.PathLike, cert: x509.Certificate | bytes | dict) -> bool:
    """Whether ``cert`` (a certificate, its PEM, or a ``getpeercert()`` dict) is on the key
    directory's CRL. The handshake checks this already; for listings and diagnostics."""
    d = Path(keys_dir)
    crl = _verified_crl(d / CA_CERT_FILE, d / CRL_FILE)
    if isinstance(cert, dict):
        serial = int(cert["serialNumber"], 16)
    else:
        serial = (cert if isinstance(cert, x509.Certificate)
                  else x509.load_pem_x509_certificate(cert)).serial_number
    return crl.get_revoked_certificate_by_serial_number(serial) is not None


def check_key_dir(keys_dir: str | os.PathLike) -> list[str]:
    """Refuse a key directory a daemon must not start with; return warnings worth logging.

    Raises ``KeyDirError`` when the CA's private key is in it (``ca.key`` anywhere below it,
    or any ``*.key`` whose public key is the CA's): whoever takes a daemon's host would get the
    power to mint certificates, ``admin`` included. Also when ``ca.pem`` or a CA-signed
    ``crl.pem`` is missing. Warns about private files or the directory being open to group or
    others, and about certificates expired or expiring within ``EXPIRY_WARNING_DAYS``.
    """
    d = Path(keys_dir)
    found = sorted(d.rglob(CA_KEY_FILE))
    try:
        ca_cert = x509.load_pem_x509_certificate((d / CA_CERT_FILE).read_bytes())
        _verified_crl(d / CA_CERT_FILE, d / CRL_FILE)
    except (OSError, ValueError) as exc:
        raise KeyDirError(f"{d}: no usable {CA_CERT_FILE} and CA-signed {CRL_FILE} ({exc}); "
                          f"copy them from the CA directory (`starfish keys issue` does)") from None
    ca_public = ca_cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    warnings = []
    for key_file in sorted(d.glob("*.key")):
        try:
            key = serialization.load_pem_private_key(key_file.read_bytes(), None)
        except (OSError, ValueError, TypeError):
            continue  # not ours to judge; the context that uses it will say
        public = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        if public == ca_public:
            found.append(key_file)
        if stat.S_IMODE(key_file.stat().st_mode) & 0o077:
            warnings.append(f"{key_file} is readable by group or others (should be 0600)")
    if found:
        raise KeyDirError(
            f"{found[0]}: the CA's private key is in the key directory a daemon reads; anyone "
            f"who takes this host could mint certificates (admin included). Move it to the "
            f"offline CA directory (only `starfish keys issue|revoke` need it) and start again.")
    if stat.S_IMODE(d.stat().st_mode) & 0o077:
        warnings.append(f"{d} is open to group or others (should be 0700)")
    now = _dt.datetime.now(_dt.timezone.utc)
    for cert_file in sorted(d.glob("*.pem")):
        if cert_file.name in (CA_CERT_FILE, CRL_FILE):
            continue
        try:
            left = x509.load_pem_x509_certificate(cert_file.read_bytes()).not_valid_after_utc - now
        except ValueError:
            continue
        if left.days < EXPIRY_WARNING_DAYS:
            warnings.append(f"{cert_file} " + ("has expired" if left.total_seconds() < 0 else
                            f"expires in {left.days} days") + " (renew: starfish keys issue --replace)")
    return warnings
