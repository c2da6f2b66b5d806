"""The two-party engine's own link (SPU over brpc, mutual TLS 1.3 with per-session certificates).

Each party makes a fresh self-signed certificate, the two are exchanged over the servers'
authenticated channel, and each party trusts exactly the peer's (``mpc.spu_engine``). Here one
party is made to trust another certificate (``SpuEngine(trust_override=...)``, tests only): one
of the same shape as a real session certificate (EC P-256, CN ``starfish-spu-0``, a CA of path
length 0, valid now) but another key. The link must not come up: ``EngineError`` on the side
that trusts the wrong certificate (and, since the handshake fails both ways, on the other).
Positive control: the same construction with the right trust computes a sign test correctly.

The engines are built by hand inside an ``insecure_tfp=True`` session (tests only: a party with a
channel and a meter, no engine of its own), as ``mpc.session.open_party`` builds them.
"""

from __future__ import annotations

import datetime
import os
import time

import numpy as np
import pytest

from mpc.launcher import PartyError, run_parties

pytestmark = pytest.mark.timeout(300)

LO, HI = -(2**63), 2**63 - 1
#: the engine's timeout in the refusal run; a refused link must give up after about this long
ENGINE_TIMEOUT = 1.0


def other_certificate_pem(common_name: str = "starfish-spu-0") -> bytes:
    """A self-signed certificate shaped like a session certificate, with a key nobody uses."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)


# ----------------------------------------------------------------------------- party program
def engine_by_hand(party, trust_for_rank1: bytes | None, engine_timeout: float, share0, share1):
    """Build an SpuEngine over this tfp session's channel; party 1 trusts ``trust_for_rank1``
    instead of the peer's certificate when given. Returns (outcome, seconds spent in the
    constructor, this party's share of [x >= 0] or None)."""
    from mpc.spu_engine import EngineError, SpuEngine

    assert party.engine is None and party.offline is None   # the TFP session: neither mode
    override = trust_for_rank1 if party.rank == 1 else None
    t0 = time.monotonic()
    try:
        engine = SpuEngine(party.rank, party.channel, party.metering, timeout=engine_timeout,
                           trust_override=override)
    except EngineError as exc:
        return type(exc).__name__, time.monotonic() - t0, str(exc)[:300], None
    except Exception as exc:  # noqa: BLE001 - any other failure is reported by its class
        return type(exc).__name__, time.monotonic() - t0, str(exc)[:300], None
    seconds = time.monotonic() - t0
    try:
        bit = engine.nonnegative(np.asarray(share0 if party.rank == 0 else share1, dtype=np.int64))
    finally:
        engine.close()
    return "ok", seconds, "", bit


def run(*args, **kwargs):
    """run_parties, failing with both parties' tracebacks (not only the first line)."""
    try:
        return run_parties(*args, **kwargs)
    except PartyError as exc:
        pytest.fail(f"{exc}\n" + "\n".join(f"--- party {r}:\n{msg}" for r, msg in sorted(exc.errors.items())))


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def refused():
    """One run in which party 1 trusts a wrong certificate (a brpc refusal retries for a while)."""
    x = np.array([0, 1, -1], dtype=np.int64)
    t0 = time.monotonic()
    res = run(engine_by_hand, other_certificate_pem(), ENGINE_TIMEOUT, x, np.zeros_like(x),
                      insecure_tfp=True, timeout=150)
    return res.values, time.monotonic() - t0


def test_a_wrong_certificate_on_the_engine_link_is_refused(refused):
    values, _ = refused
    (out0, _, msg0, bit0), (out1, _, msg1, bit1) = values
    # the side trusting the wrong certificate refuses the peer's
    assert out1 == "EngineError", (out1, msg1)
    assert bit1 is None
    # ... and the peer cannot complete a mutually authenticated link either
    assert out0 == "EngineError", (out0, msg0)
    assert bit0 is None
    assert "did not come up" in msg1


def test_a_refused_engine_link_gives_up_within_its_timeout(refused):
    values, _ = refused
    for outcome, seconds, _, _ in values:
        assert outcome == "EngineError"
        # the engine's own start-up counts too, which a loaded machine slows (CI saw 7.2 s for
        # a 1 s timeout); an engine that ignored its timeout would wait out the session (150 s)
        assert seconds <= min(ENGINE_TIMEOUT, 30.0) + 15.0, seconds


def test_the_right_certificate_links_and_computes():
    """Positive control: the same construction, each party trusting the peer's certificate."""
    rng = np.random.default_rng(9)
    x = np.array([0, 1, -1, 2, -2, 2**62, -(2**62), HI, LO, HI - 1, LO + 1]
                 + rng.integers(LO, HI, 50, dtype=np.int64, endpoint=True).tolist(), dtype=np.int64)
    s1 = rng.integers(LO, HI, x.size, dtype=np.int64, endpoint=True)
    s0 = (x.view(np.uint64) - s1.view(np.uint64)).view(np.int64)
    res = run(engine_by_hand, None, 20.0, s0, s1, insecure_tfp=True, timeout=120)
    (out0, sec0, msg0, bit0), (out1, sec1, msg1, bit1) = res.values
    assert out0 == out1 == "ok", (msg0, msg1)
    assert sec0 < 20 and sec1 < 20
    got = (bit0.view(np.uint64) + bit1.view(np.uint64)).view(np.int64)
    assert np.array_equal(got, (x >= 0).astype(np.int64))


def engine_directory(party):
    """The engine's private session directory (its key is in there while the session lives)."""
    return party.engine._dir


def test_a_finished_session_leaves_no_key_behind():
    """The parties close their sessions before ``run_parties`` ends them: each engine's directory,
    which holds its private session key, is gone when the call returns."""
    res = run(engine_directory, offline="two-party", timeout=120)
    dirs = list(res.values)
    assert all(isinstance(d, str) and "starfish-spu-" in d for d in dirs) and dirs[0] != dirs[1]
    assert not any(os.path.exists(d) for d in dirs), dirs


def engine_directory_then_die(party, notes: str):
    """Each party writes down its engine's private directory; party 1 is then killed outright (no
    close, no atexit), as a server daemon can be, and party 0 returns into a session whose peer is
    gone (run_parties then ends it)."""
    with open(f"{notes}{party.rank}", "w") as f:
        f.write(party.engine._dir)
    if party.rank == 1:
        os.kill(os.getpid(), 9)
    return party.engine._dir


def test_a_killed_partys_engine_removes_its_key(tmp_path):
    """No session key stays on disk when a party dies: the dead party's engine process, which
    watches its parent, removes its directory before it ends, and the survivor removes its own
    even while it is being ended."""
    notes = str(tmp_path / "dir")
    with pytest.raises(PartyError):
        run_parties(engine_directory_then_die, notes, offline="two-party", timeout=30)
    dirs = [open(f"{notes}{r}").read() for r in (0, 1)]
    assert all("starfish-spu-" in d for d in dirs) and dirs[0] != dirs[1]
    deadline = time.monotonic() + 10.0
    while any(os.path.exists(d) for d in dirs) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [d for d in dirs if os.path.exists(d)], "a session key outlived its party"
