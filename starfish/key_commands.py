"""``starfish keys init|issue|revoke|list``: the offline certificate authority's commands.

Why a module of its own: these are the only commands that touch the CA's private key, and
they run on the machine that keeps it (the *CA directory*, ``net/ca.py``), not where the
daemons run. Layout and lifetimes: docs/service.md, "Keys and certificates".
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path
from typing import Any

from cryptography import x509

from net import ca, tls
from common import wire

__all__ = ["add_commands"]


def _fail(action: str, exc: Exception) -> int:
    print(f"starfish keys {action}: {exc}", file=sys.stderr)
    return 2


def _valid_name(name: str) -> bool:
    # the names the servers authorise; anything else would be a certificate nobody accepts
    return (name in (*tls.PARTY_NAMES, tls.DEALER_NAME, tls.ADMIN_NAME) or wire.client_id_of(name) is not None
            or tls.worker_of(name) is not None)


def cmd_init(args: argparse.Namespace) -> int:
    keys_dir = Path(args.dir)
    ca_dir = Path(args.ca_dir) if args.ca_dir else keys_dir.parent / "ca-offline"
    try:
        names = tls.init_keys(keys_dir, clients=args.clients, ca_dir=ca_dir, workers=args.workers)
    except (FileExistsError, ValueError) as exc:
        return _fail("init", exc)
    print(f"wrote certificates for {', '.join(names)} to {keys_dir}")
    print("private keys are mode 0600; give each participant only its own .key plus ca.pem and crl.pem")
    print(f"WARNING: {ca_dir} holds the CA's private key: move it off this machine; only "
          f"`starfish keys issue|revoke --ca-dir` need it", file=sys.stderr)
    return 0


def cmd_issue(args: argparse.Namespace) -> int:
    if not _valid_name(args.name):
        return _fail("issue", ValueError(f"{args.name!r} is not server0, server1, dealer, admin, "
                                         f"client-<id> or a worker server<0|1>-w<k> (k 0..{tls.MAX_WORKERS - 1}; "
                                         f"decimal, no leading zeros)"))
    days = args.days or tls.default_days(args.name)
    try:
        tls.issue(args.keys_dir, args.name, ca_dir=args.ca_dir, days=days, replace=args.replace)
    except (FileExistsError, FileNotFoundError, ValueError) as exc:
        return _fail("issue", exc)
    cert = x509.load_pem_x509_certificate((Path(args.keys_dir) / f"{args.name}.pem").read_bytes())
    print(f"issued {args.name} (serial {cert.serial_number:x}), valid {days} days until "
          f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, into {args.keys_dir}")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    serials: list[int] = []
    try:
        serials += [int(s, 16) for s in args.serial or ()]
        for path in args.cert or ():
            serials.append(x509.load_pem_x509_certificate(Path(path).read_bytes()).serial_number)
        if not (args.name or serials):
            raise ValueError("name what to revoke: --name, --serial or --cert")
        new = ca.revoke(args.ca_dir, name=args.name, serials=tuple(serials))
        for keys_dir in args.keys_dir or ():
            ca.publish(args.ca_dir, keys_dir)
    except (OSError, ValueError, LookupError) as exc:
        return _fail("revoke", exc)
    for r in new:
        print(f"revoked {r.name} (serial {r.serial:x})")
    if not new:
        print("nothing new to revoke: already on the list")
    number = ca.crl_number(ca.load_crl(Path(args.ca_dir) / ca.CRL_FILE))
    print(f"revocation list {number}: {Path(args.ca_dir) / ca.CRL_FILE}"
          + "".join(f", copied to {k}" for k in args.keys_dir or ()))
    print("copy crl.pem into every key directory in use (servers, dealer, clients); daemons "
          "apply it at their next handshake, no restart; open connections stay up")
    return 0


def _status(serial: int, not_after: dt.datetime, revoked: set[int], now: dt.datetime) -> str:
    if serial in revoked:
        return "revoked"
    left = not_after - now
    return "expired" if left.total_seconds() < 0 else f"valid, {left.days} days left"


def cmd_list(args: argparse.Namespace) -> int:
    now = dt.datetime.now(dt.timezone.utc)
    rows: list[tuple[str, int, dt.datetime]] = []
    try:
        if args.ca_dir:
            crl_path = Path(args.ca_dir) / ca.CRL_FILE
            rows = [(r.name, r.serial, r.not_after) for r in ca.issued(args.ca_dir)]
        else:
            crl_path = Path(args.keys_dir) / ca.CRL_FILE
            for pem in sorted(Path(args.keys_dir).glob("*.pem")):
                if pem.name not in (ca.CA_CERT_FILE, ca.CRL_FILE):
                    cert = x509.load_pem_x509_certificate(pem.read_bytes())
                    rows.append((pem.stem, cert.serial_number, cert.not_valid_after_utc))
        crl = ca.load_crl(crl_path)
    except (OSError, ValueError) as exc:
        return _fail("list", exc)
    revoked = set(ca.revoked_serials(crl))
    print(f"revocation list {ca.crl_number(crl)} ({crl_path}): {len(revoked)} revoked")
    for name, serial, not_after in rows:
        print(f"{name:<12} {serial:040x}  until {not_after:%Y-%m-%d}  "
              f"{_status(serial, not_after, revoked, now)}")
    if args.keys_dir:  # what a daemon would say about this directory at start-up
        try:
            problems = tls.check_key_dir(args.keys_dir)
        except tls.KeyDirError as exc:
            problems = [f"a daemon would refuse it: {exc}"]
        for p in problems:
            print(f"warning: {p}", file=sys.stderr)
    return 0


def add_commands(sub: Any) -> None:
    """Add ``keys`` and its actions to the ``starfish`` parser."""
    keys = sub.add_parser("keys", help="the deployment's certificates: init, issue, revoke, list")
    ksub = keys.add_subparsers(dest="keys_command", metavar="ACTION")

    i = ksub.add_parser("init", help="a CA (in --ca-dir) and the certificates of server0, server1, "
                                     "dealer, admin (and clients) in DIR")
    i.add_argument("dir", help="key directory to create: certificates, keys, ca.pem, crl.pem")
    i.add_argument("--ca-dir", help="where the CA's key goes (default: ca-offline beside DIR); "
                                    "refuses to replace an existing CA")
    i.add_argument("--clients", type=int, default=0, help="also issue client-0..client-N-1 (default 0)")
    i.add_argument("--workers", type=int, default=0, choices=range(0, tls.MAX_WORKERS + 1), metavar="K",
                   help="also issue server0-w0..server1-w<K-1>: each server's K workers (default 0)")
    i.set_defaults(func=cmd_init)

    s = ksub.add_parser("issue", help="sign a new certificate and key for one identity")
    s.add_argument("--ca-dir", required=True, help="the CA directory (holds ca.key)")
    s.add_argument("--keys-dir", required=True, help="write NAME.pem, NAME.key, ca.pem, crl.pem here")
    s.add_argument("--name", required=True, help="server0, server1, dealer, admin or client-<id>")
    s.add_argument("--days", type=int, help=f"lifetime (default {tls.SERVICE_DAYS} for servers and "
                                            f"the dealer, {tls.USER_DAYS} for admin and clients)")
    s.add_argument("--replace", action="store_true",
                   help="overwrite an existing NAME.pem (renewal; revoke the old one if it leaked)")
    s.set_defaults(func=cmd_issue)

    r = ksub.add_parser("revoke", help="add certificates to the revocation list (crl.pem)")
    r.add_argument("--ca-dir", required=True, help="the CA directory (holds ca.key)")
    r.add_argument("--keys-dir", action="append", help="copy the new crl.pem here (repeatable)")
    r.add_argument("--name", help="revoke every certificate issued to this identity")
    r.add_argument("--serial", action="append", help="revoke this serial number (hex; repeatable)")
    r.add_argument("--cert", action="append", help="revoke this certificate file (repeatable)")
    r.set_defaults(func=cmd_revoke)

    ls = ksub.add_parser("list", help="certificates with expiry and revocation status")
    where = ls.add_mutually_exclusive_group(required=True)
    where.add_argument("--keys-dir", help="the certificates in this key directory")
    where.add_argument("--ca-dir", help="every certificate the CA issued")
    ls.set_defaults(func=cmd_list)
