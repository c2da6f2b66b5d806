"""The servers' durable history store (servers.store.share_store and the catalog, validation and
staging it is built from), each property against an oracle.

Oracles: the values the test itself wrote (kept in dicts), the client-side sharing in
``common.sharing`` (two stores' shares must add up to the client's encoding), a deterministic
generator that both a SIGKILLed writer process and the checker call (a reopened store
must hold exactly a prefix of what the writer intended), byte-level file edits (a flipped
byte must be caught) and a fresh interpreter (the store loads no torch). Staging, job
records and the History adapter have their own files (test_staging, test_job_records,
test_share_history).

This file is also the crash-test writer: ``python -m tests.servers.test_share_store writer ...``
from the repository root (run as a subprocess so that it can be killed with SIGKILL).
"""

from __future__ import annotations

import os
import random
import selectors
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common import encoding, prg, sharing
from servers.store import blobs as blobs_mod
from servers.store import share_store as ss
from servers.store.share_store import ClientShares, ShareStore
from tests.helpers.store_helpers import DIM, blob_files, expected_share, new_store, ring, uploads

REPO = Path(__file__).resolve().parents[2]


# ====================================================================== deterministic workload
GEN_DIM = 300
GEN_ROUNDS = 12
GEN_LR = 0.5


def initial_model(seed: int) -> np.ndarray:
    return np.random.default_rng([seed, 0]).standard_normal(GEN_DIM).astype(np.float32)


def intended_round(seed: int, r: int) -> dict[str, Any]:
    """What the writer means to store as round r (pure function of seed and r).

    Even rounds go through staging + commit_round, with one uploader left out of the
    agreed participants (its upload must be dropped); odd rounds use append_round.
    Party 0: about a third of the shares arrive as 16-byte seeds.
    """
    rng = np.random.default_rng([seed, r])
    uploaders = sorted(int(c) for c in rng.choice(6, size=int(rng.integers(3, 6)), replace=False))
    staged = r % 2 == 0
    dropped = uploaders[int(rng.integers(len(uploaders)))]
    parts = [c for c in uploaders if c != dropped] if staged else list(uploaders)
    raw = rng.random(len(parts)) + 0.1
    weights = {c: float(w) for c, w in zip(parts, raw / raw.sum())}
    shares: dict[int, tuple[Any, Any, Any]] = {}
    for c in uploaders:
        def one(shape: tuple[int, ...]) -> Any:
            return rng.bytes(16) if rng.random() < 0.35 else ring(rng, shape)
        shares[c] = (one((GEN_DIM,)), one(()), one(()))
    return {"staged": staged, "uploaders": uploaders, "participants": parts, "weights": weights,
            "model": rng.standard_normal(GEN_DIM).astype(np.float32), "shares": shares,
            "metadata": {"deadline": 1000.0 + r, "config": f"cfg-{seed}"}}


def _writer_main(argv: list[str]) -> int:
    """Write rounds 1..N of the deterministic workload, resuming after T; report progress.

    Optional ``POINT HIT``: SIGKILL itself at the HIT-th pass through the store's named
    checkpoint POINT (the precise places of the commit protocol).
    """
    root, seed, rounds = Path(argv[0]), int(argv[1]), int(argv[2])
    if len(argv) > 3:
        point, hit = argv[3], int(argv[4])
        count = [0]

        def crash(name: str) -> None:
            if name == point:
                count[0] += 1
                if count[0] == hit:
                    os.kill(os.getpid(), signal.SIGKILL)

        ss._checkpoint = crash
        blobs_mod._checkpoint = crash

    def say(msg: str) -> None:
        sys.stdout.write(msg + "\n")
        sys.stdout.flush()

    store = ShareStore(root, party=0, initial_model=initial_model(seed), server_lr=GEN_LR)
    say(f"open {store.num_rounds}")
    for r in range(store.num_rounds + 1, rounds + 1):
        spec = intended_round(seed, r)
        say(f"begin {r}")
        if spec["staged"]:
            for c in spec["uploaders"]:
                store.stage_upload(r, c, *spec["shares"][c])
                say(f"staged {r} {c}")
            store.commit_round(r, spec["model"], spec["participants"], spec["weights"],
                               spec["metadata"])
        else:
            store.append_round(r, spec["model"], spec["participants"], spec["weights"],
                               {c: ClientShares(*spec["shares"][c]) for c in spec["participants"]},
                               spec["metadata"])
        say(f"round {r}")
    store.close()
    say("done")
    return 0


class Writer:
    """A writer subprocess and a line reader on its stdout that never blocks past a deadline."""

    def __init__(self, root: Path, seed: int, crash: tuple[str, int] | None = None,
                 rounds: int = GEN_ROUNDS) -> None:
        cmd = [sys.executable, "-m", "tests.servers.test_share_store", "writer", str(root), str(seed),
               str(rounds)]
        if crash:
            cmd += [crash[0], str(crash[1])]
        self.errfile = root.parent / f"{root.name}-writer.err"
        with self.errfile.open("ab") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, cwd=REPO, bufsize=0)
        self._buf = b""
        self._sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self.lines: list[str] = []

    def line(self, timeout: float = 30.0) -> str | None:
        """The next progress line, or None at EOF (the writer exited or was killed)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise AssertionError(f"writer silent for {timeout}s; stderr: {self.errfile.read_text()}")
            if self._sel.select(timeout=left):
                chunk = os.read(self.proc.stdout.fileno(), 4096)  # type: ignore[union-attr]
                if not chunk:
                    return None
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\n", 1)
        text = raw.decode()
        self.lines.append(text)
        return text

    def drain(self) -> None:
        """Read what the writer printed before it died (bounded: it is dead)."""
        while self.line(timeout=10.0) is not None:
            pass

    def kill(self) -> None:
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def close(self) -> None:
        self._sel.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def check_against_intent(root: Path, seed: int) -> tuple[int, tuple[int, ...], tuple[Path, ...]]:
    """Reopen; assert rounds 1..T and the staging area are exactly what the writer intended.

    Returns (T, staged clients of T+1, files the open removed). Also checks that no
    orphan blob and no temp file remains, by counting the arrays the intent references.
    """
    with ShareStore(root, party=0) as store:
        T = store.num_rounds
        assert 0 <= T <= GEN_ROUNDS
        assert np.array_equal(store.model(0), initial_model(seed))
        expected_blobs = 1 + T  # M_0 and one model per round
        for r in range(1, T + 1):
            spec = intended_round(seed, r)
            assert store.participants(r) == tuple(spec["participants"])
            assert dict(store.weights(r)) == spec["weights"]
            assert store.metadata(r) == spec["metadata"]
            assert np.array_equal(store.model(r), spec["model"])
            for c in spec["participants"]:
                u, n, d = spec["shares"][c]
                got = store.client_shares(r, c)
                assert np.array_equal(got.update, expected_share(u, (GEN_DIM,)))
                assert np.array_equal(got.norm, expected_share(n, ()))
                assert np.array_equal(got.delta, expected_share(d, ()))
                expected_blobs += not isinstance(u, bytes)
        staged: tuple[int, ...] = ()
        if T < GEN_ROUNDS:
            spec = intended_round(seed, T + 1)
            staged = store.staged(T + 1)
            if spec["staged"]:  # the uploads happen in order: a prefix of them is staged
                assert staged == tuple(spec["uploaders"][: len(staged)])
            else:
                assert staged == ()
            for c in staged:
                u, n, d = spec["shares"][c]
                got = store.staged_upload(T + 1, c)
                assert np.array_equal(got.update, expected_share(u, (GEN_DIM,)))
                assert np.array_equal(got.norm, expected_share(n, ()))
                assert np.array_equal(got.delta, expected_share(d, ()))
                expected_blobs += not isinstance(u, bytes)
        assert len(blob_files(root)) == expected_blobs, "orphan blobs survived the open"
        assert list((root / "tmp").iterdir()) == []
        return T, staged, store.recovered_files


def test_kill_at_every_step_of_the_commit_protocol(tmp_path):
    """SIGKILL inside each named step; the visible state is exactly what committed."""
    root, seed = tmp_path / "store", 5
    # (checkpoint, hit, round visible after the kill?, staged row of the in-flight client visible?)
    plan = [
        ("blob-temp-written", 2, False, False),
        ("blob-renamed", 1, False, False),
        ("round-blobs-durable", 1, False, False),
        ("round-in-transaction", 1, False, False),
        ("round-committed", 1, True, False),
        ("staged-blob-durable", 2, False, False),
        ("staged-in-transaction", 1, False, False),
        ("staged-committed", 2, False, True),
        ("round-in-transaction", 2, False, False),
    ]
    prev_T = 0
    for point, hit, committed, staged_visible in plan:
        w = Writer(root, seed, crash=(point, hit))
        try:
            assert w.line() == f"open {prev_T}"  # resumes exactly where the last run stopped
            w.drain()
            assert w.proc.wait(timeout=30) == -signal.SIGKILL, f"{point}: writer was not killed"
        finally:
            w.close()
        begins = [int(x.split()[1]) for x in w.lines if x.startswith("begin")]
        assert begins and begins[0] == prev_T + 1
        r = begins[-1]
        T, staged, recovered = check_against_intent(root, seed)
        assert T == (r if committed else r - 1), point
        if point.startswith("staged"):
            done_here = [x for x in w.lines if x.startswith(f"staged {r} ")]
            assert len(staged) == len(done_here) + (1 if staged_visible else 0), point
        if point in ("blob-temp-written", "blob-renamed", "round-blobs-durable", "round-in-transaction"):
            assert recovered, f"{point}: the crash leftovers were not reported"
        prev_T = T
    w = Writer(root, seed)
    try:
        assert w.line() == f"open {prev_T}"
        w.drain()
        assert w.proc.wait(timeout=60) == 0 and w.lines[-1] == "done"
    finally:
        w.close()
    T, _, _ = check_against_intent(root, seed)
    assert T == GEN_ROUNDS
    with ShareStore(root, party=0) as store:
        assert store.verify() == []


def test_kill_at_random_moments_loses_nothing_committed(tmp_path):
    """Ten SIGKILLs from outside at random moments (rounds, staging, recovery at open)."""
    root, seed = tmp_path / "store", 9
    rnd = random.Random(1234)
    prev_T = 0
    kills = 0
    for _ in range(10):
        w = Writer(root, seed)
        try:
            assert w.line() == f"open {prev_T}"
            for _ in range(rnd.randint(0, 3)):  # let it make 0..3 progress steps
                if w.line() in (None, "done"):
                    break
            # then kill at a random moment: not a wait for anything, the moment is the test
            # (a round takes a few fsyncs, so 0..30 ms lands in blob writes, transactions,
            # between commit and clean-up, or in the next step)
            time.sleep(rnd.uniform(0.0, 0.03))
            kills += w.proc.poll() is None
            w.kill()
        finally:
            w.close()
        T, staged, _ = check_against_intent(root, seed)
        assert T >= prev_T
        prev_T = T
    assert kills >= 8, "most iterations must kill a live writer"
    w = Writer(root, seed)
    try:
        assert w.line() == f"open {prev_T}"
        w.drain()
        assert w.proc.wait(timeout=60) == 0
    finally:
        w.close()
    assert check_against_intent(root, seed)[0] == GEN_ROUNDS


# ====================================================================== round trips
def test_round_trip_of_several_rounds_survives_reopen(tmp_path):
    import torch

    from protocols.starfish.ports import History
    from servers.secure.share_history import ShareHistory

    rng = np.random.default_rng(1)
    for party in (0, 1):
        root = tmp_path / f"p{party}"
        m0 = rng.standard_normal(DIM).astype(np.float32)
        want: dict[int, dict[str, Any]] = {}
        with new_store(root, party, m0) as store:
            for r in range(1, 5):
                parts = sorted(int(c) for c in rng.choice(7, size=3 + r % 2, replace=False))
                w = rng.random(len(parts)) + 0.05
                weights = {c: float(x) for c, x in zip(parts, w / w.sum())}
                model = rng.standard_normal(DIM).astype(np.float64 if r == 4 else np.float32)
                shares = {}
                for k, c in enumerate(parts):
                    seeded = party == 0 and k % 2 == 0
                    upd = prg.new_seed() if seeded else ring(rng, (DIM,))
                    if r == 3 and not seeded:
                        upd = torch.from_numpy(upd)  # torch.long is accepted too
                    norm = prg.new_seed() if seeded else np.int64(ring(rng, ())[()])  # numpy scalar
                    delta = ring(rng, (1,))  # shape (1,) is stored as a scalar
                    shares[c] = (upd, norm, delta)
                meta = {"deadline": 100 + r, "config": "abc", "nested": {"r": r}}
                if r == 2:  # through staging, with one extra upload that is not agreed
                    extra = ring(rng, (DIM,)), ring(rng, ()), ring(rng, ())
                    for c, sh in shares.items():
                        assert store.stage_upload(r, c, *sh)
                    assert store.stage_upload(r, 99, *extra)
                    assert store.staged(r) == tuple(parts) + (99,)
                    assert store.commit_round(r, model, parts, weights, meta)
                    assert store.staged(r) == ()
                else:
                    assert store.append_round(r, model, parts, weights,
                                              {c: ClientShares(*s) for c, s in shares.items()}, meta)
                want[r] = {"model": model, "parts": tuple(parts), "weights": weights,
                           "meta": meta, "shares": shares}
            open_upload = (ring(rng, (DIM,)), ring(rng, ()), prg.new_seed() if party == 0 else ring(rng, ()))
            store.stage_upload(5, 3, *open_upload)
        with ShareStore(root, party=party) as store:  # reopen: everything comes back
            assert store.num_rounds == 4 and store.party == party and store.dim == DIM
            assert store.server_lr == 0.25 and store.precision == 16
            assert store.recovered_files == ()
            assert np.array_equal(store.model(0), m0) and store.model(0).dtype == np.float32
            for r, exp in want.items():
                got_model = store.model(r)
                assert got_model.dtype == exp["model"].dtype and np.array_equal(got_model, exp["model"])
                assert store.participants(r) == exp["parts"]
                assert dict(store.weights(r)) == exp["weights"]
                assert store.metadata(r) == exp["meta"]
                for c, (u, n, d) in exp["shares"].items():
                    u = u.numpy() if isinstance(u, torch.Tensor) else u
                    for got, value, shape in ((store.update_share(r, c), u, (DIM,)),
                                              (store.norm_share(r, c), n, ()),
                                              (store.delta_share(r, c), d, ())):
                        assert got.dtype == np.int64 and got.shape == shape
                        assert np.array_equal(got, expected_share(value, shape))
            with pytest.raises(KeyError, match="did not take part"):
                store.update_share(2, 99)  # the dropped upload is gone
            assert store.staged(5) == (3,)
            got = store.staged_upload(5, 3)
            for g, value, shape in zip((got.update, got.norm, got.delta), open_upload, ((DIM,), (), ())):
                assert np.array_equal(g, expected_share(value, shape))
            with pytest.raises(IndexError):
                store.model(5)

            hist = ShareHistory(store)
            assert isinstance(hist, History) and hist.num_rounds == 4
            assert hist.server_lr == 0.25
            assert torch.equal(hist.model(1), torch.from_numpy(want[1]["model"]))
            assert torch.equal(hist.model_delta(2), torch.from_numpy(want[2]["model"] - want[1]["model"]))
            c0 = want[1]["parts"][0]
            assert np.array_equal(hist.update(1, c0), store.update_share(1, c0))
            assert hist.norm(1, c0).shape == () and hist.delta(1, c0).dtype == np.int64
            assert hist.clients() == tuple(sorted({c for e in want.values() for c in e["parts"]}))
            assert hist.weight(c0) == want[1]["weights"][c0]
            calls = []
            wrapped = ShareHistory(store, wrap=lambda s, precision: calls.append(precision) or ("wrapped", s))
            assert wrapped.update(1, c0)[0] == "wrapped" and calls == [16]


# ====================================================================== reconstruction
def test_two_parties_stores_give_back_the_clients_values(tmp_path):
    rng = np.random.default_rng(3)
    clients = [0, 1, 2]
    plain: dict[tuple[int, int], tuple[np.ndarray, float, float]] = {}
    stores = [new_store(tmp_path / "p0", 0), new_store(tmp_path / "p1", 1)]
    for r in (1, 2, 3):
        per_party: list[dict[int, ClientShares]] = [{}, {}]
        for c in clients:
            x = rng.normal(size=DIM) * 10 ** rng.uniform(-3, 3)
            norm, delta = float(np.linalg.norm(x)), float(np.quantile(np.abs(x), 0.6))
            compress = (r + c) % 2 == 0
            sx, sn, sd = (sharing.share(v, compress=compress) for v in (x, np.float64(norm), np.float64(delta)))
            per_party[0][c] = ClientShares(*(s.seed0 if compress else s.share0 for s in (sx, sn, sd)))
            per_party[1][c] = ClientShares(sx.share1, sn.share1, sd.share1)
            plain[r, c] = (x, norm, delta)
        model = rng.standard_normal(DIM).astype(np.float32)
        for p in (0, 1):
            stores[p].append_round(r, model, clients, {c: 1 / 3 for c in clients}, per_party[p])
    for s in stores:
        s.close()
    s0, s1 = ShareStore(tmp_path / "p0", party=0), ShareStore(tmp_path / "p1", party=1)
    try:
        for (r, c), (x, norm, delta) in plain.items():
            ring_x = sharing.reconstruct_ring(s0.update_share(r, c), s1.update_share(r, c))
            assert np.array_equal(ring_x, encoding.encode(x))  # exactly the client's encoding
            assert np.max(np.abs(sharing.reconstruct(s0.update_share(r, c), s1.update_share(r, c)) - x)) <= 2**-16
            assert abs(float(sharing.reconstruct(s0.norm_share(r, c), s1.norm_share(r, c))) - norm) <= 2**-16
            assert abs(float(sharing.reconstruct(s0.delta_share(r, c), s1.delta_share(r, c))) - delta) <= 2**-16
            # a share alone is not the value
            assert not np.array_equal(s1.update_share(r, c), encoding.encode(x))
    finally:
        s0.close()
        s1.close()


# ====================================================================== corruption
def test_a_flipped_byte_is_detected_and_names_the_file(tmp_path):
    root = tmp_path / "s"
    rng = np.random.default_rng(5)
    share = ring(rng, (DIM,))
    with new_store(root, 1) as store:
        store.append_round(1, np.ones(DIM, np.float32), [4], {4: 1.0},
                           {4: ClientShares(share, ring(rng, ()), ring(rng, ()))})
    files = blob_files(root)
    assert len(files) == 3  # M_0, M_1, the update share
    update_file = max(files, key=lambda p: p.stat().st_size)  # int64 vs float32 models
    model_files = [p for p in files if p != update_file]

    def flip(path: Path, offset: int) -> None:
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x10
        path.write_bytes(bytes(data))

    flip(update_file, -1)  # last payload byte
    with ShareStore(root, party=1) as store:
        assert store.recovered_files == ()  # the sweep never deletes a referenced (corrupt) blob
        with pytest.raises(ss.BlobCorruptError, match="checksum") as exc:
            store.update_share(1, 4)
        assert str(update_file) in str(exc.value)
        assert store.model(1).sum() == DIM  # other files unaffected
        problems = store.verify()
        assert len(problems) == 1 and str(update_file) in problems[0]
    flip(update_file, -1)  # repair; now break a model's header
    flip(model_files[0], 20)
    with ShareStore(root, party=1) as store:
        assert np.array_equal(store.update_share(1, 4), share)
        with pytest.raises(ss.BlobCorruptError) as exc:
            [store.model(i) for i in (0, 1)]
        assert str(model_files[0]) in str(exc.value)
    flip(model_files[0], 20)
    update_file.unlink()
    with ShareStore(root, party=1) as store:
        with pytest.raises(ss.BlobMissingError) as exc:
            store.update_share(1, 4)
        assert str(update_file) in str(exc.value)
    # the catalog is covered too: an edited weight breaks the round's content hash
    with sqlite3.connect(root / "catalog.sqlite3") as conn:
        conn.execute("UPDATE round_shares SET weight = 0.5")
    conn.close()
    with ShareStore(root, party=1) as store:
        with pytest.raises(ss.CatalogCorruptError, match="round 1"):
            store.weights(1)


# ====================================================================== replay
def test_replays_are_idempotent_and_conflicts_are_refused(tmp_path):
    rng = np.random.default_rng(6)
    root = tmp_path / "s"
    model1 = rng.standard_normal(DIM).astype(np.float32)
    ups = uploads(rng, [1, 2])
    w = {1: 0.25, 2: 0.75}
    with new_store(root, 0) as store:
        assert store.append_round(1, model1, [1, 2], w, ups, {"cfg": "x"}) is True
        files = blob_files(root)
        assert store.append_round(1, model1.copy(), (2, 1), dict(w), dict(ups), {"cfg": "x"}) is False
        assert store.num_rounds == 1 and blob_files(root) == files

        other = dict(ups)
        other[2] = ClientShares(ring(rng, (DIM,)), ups[2].norm, ups[2].delta)
        with pytest.raises(ss.RoundConflictError, match=r"shares of clients \[2\]"):
            store.append_round(1, model1, [1, 2], w, other, {"cfg": "x"})
        with pytest.raises(ss.RoundConflictError, match="model"):
            store.append_round(1, model1 + 1, [1, 2], w, ups, {"cfg": "x"})
        with pytest.raises(ss.RoundConflictError, match="weights"):
            store.append_round(1, model1, [1, 2], {1: 0.5, 2: 0.5}, ups, {"cfg": "x"})
        with pytest.raises(ss.RoundConflictError, match="metadata"):
            store.append_round(1, model1, [1, 2], w, ups, {"cfg": "y"})
        with pytest.raises(ss.RoundOrderError, match="next is 2"):
            store.append_round(3, model1, [1, 2], w, ups)
        assert blob_files(root) == files, "a refused write left files behind"

    with ShareStore(root, party=0) as store:
        assert store.num_rounds == 1 and store.recovered_files == ()


# ====================================================================== bad input
def _snapshot(store: ShareStore, root: Path) -> tuple:
    rounds = [(store.round_info(i).content_hash) for i in range(1, store.num_rounds + 1)]
    return (store.num_rounds, tuple(rounds), store.staged(store.num_rounds + 1),
            tuple((p.name, p.stat().st_size) for p in blob_files(root)),
            tuple((root / "tmp").iterdir()))


def test_bad_input_raises_and_changes_nothing(tmp_path):
    import torch

    rng = np.random.default_rng(7)
    root = tmp_path / "s"
    good = uploads(rng, [1, 2])
    model = rng.standard_normal(DIM).astype(np.float32)
    w = {1: 0.5, 2: 0.5}
    nan_model = model.copy()
    nan_model[3] = np.nan
    store = new_store(root, 0)
    store.append_round(1, model, [1, 2], w, good)
    store.stage_upload(2, 1, *good[1].__dict__.values())
    before = _snapshot(store, root)

    def with_share(c: int, **kw: Any) -> dict[int, ClientShares]:
        out = dict(good)
        out[c] = ClientShares(**{**good[c].__dict__, **kw})
        return out

    u = good[2].update
    bad_appends: list[tuple[type[Exception], str, dict[str, Any]]] = [
        (TypeError, "plaintext", {"shares": with_share(2, update=u.astype(np.float64))}),
        (TypeError, "int64", {"shares": with_share(2, update=u.astype(np.int32))}),
        (TypeError, "int64", {"shares": with_share(2, update=torch.from_numpy(u).float())}),
        (ValueError, "shape", {"shares": with_share(2, update=u[:-1])}),
        (ValueError, "shape", {"shares": with_share(2, update=u.reshape(1, DIM))}),
        (ValueError, "scalar", {"shares": with_share(2, norm=ring(rng, (3,)))}),
        (TypeError, "numpy array", {"shares": with_share(2, norm=5)}),
        (TypeError, "numpy array", {"shares": with_share(2, delta=0.25)}),
        (ValueError, "16 bytes", {"shares": with_share(2, update=b"x" * 15)}),
        (ValueError, "same seed", {"shares": with_share(2, update=b"s" * 16, norm=b"s" * 16)}),
        (ValueError, "one entry per participant", {"shares": {1: good[1]}}),
        (ValueError, "NaN", {"model": nan_model}),
        (ValueError, "NaN", {"model": np.full(DIM, np.inf, np.float32)}),
        (ValueError, "entries", {"model": model[:-1]}),
        (TypeError, "float32 or float64", {"model": np.zeros(DIM, np.int64)}),
        (ValueError, "sum to 1", {"weights": {1: 0.5, 2: 0.6}}),
        (ValueError, "finite", {"weights": {1: 1.5, 2: -0.5}}),
        (ValueError, "one entry per participant", {"weights": {1: 1.0}}),
        (ValueError, "duplicates", {"participants": [1, 1, 2]}),
        (ValueError, "at least one", {"participants": [], "weights": {}, "shares": {}}),
        (ValueError, "JSON", {"metadata": {"x": {1, 2}}}),
        (ValueError, "JSON", {"metadata": {"x": float("nan")}}),
        (ValueError, "limit", {"metadata": {"x": "a" * (ss.MAX_METADATA_BYTES + 1)}}),
        (ValueError, "from 1", {"round": 0}),
    ]
    for exc, msg, change in bad_appends:
        args = {"round": 2, "model": model, "participants": [1, 2], "weights": w, "shares": good,
                "metadata": None, **change}
        with pytest.raises(exc, match=msg):
            store.append_round(**args)
        assert _snapshot(store, root) == before, f"{msg}: the store changed"
    with pytest.raises(TypeError, match="int64"):
        store.stage_upload(2, 2, u.astype(np.float32), good[2].norm, good[2].delta)
    with pytest.raises(TypeError, match="integer"):
        store.stage_upload(2, "2", *good[2].__dict__.values())
    with pytest.raises(ValueError, match="NaN"):
        store.commit_round(2, nan_model, [1], {1: 1.0})
    assert _snapshot(store, root) == before
    store.close()

    p1 = new_store(tmp_path / "p1", 1)
    with pytest.raises(ValueError, match="only party 0"):
        p1.stage_upload(1, 1, prg.new_seed(), good[1].norm, good[1].delta)
    assert p1.staged(1) == ()
    p1.close()


def test_open_close_and_locking(tmp_path):
    root = tmp_path / "s"
    with pytest.raises(ss.StoreError, match="initial_model"):
        ShareStore(root, party=0)
    with pytest.raises(ValueError, match="NaN"):
        ShareStore(root, party=0, initial_model=np.full(DIM, np.nan), server_lr=0.1)
    store = new_store(root, 0)
    with pytest.raises(ss.StoreLockedError):
        ShareStore(root, party=0)
    store.close()
    store.close()  # idempotent
    for call in (lambda: store.num_rounds, lambda: store.model(0), lambda: store.staged(1),
                 lambda: store.stage_upload(1, 1, ring(np.random.default_rng(0), (DIM,)),
                                            np.int64(1), np.int64(2)),
                 lambda: store.create_job("admin", [1])):
        with pytest.raises(ss.StoreClosedError):
            call()
    with pytest.raises(ss.StoreError, match="party 0"):
        ShareStore(root, party=1)
    with pytest.raises(ss.StoreError, match="different initial model"):
        ShareStore(root, party=0, initial_model=np.zeros(DIM, np.float32))
    with pytest.raises(ss.StoreError, match="server_lr"):
        ShareStore(root, party=0, server_lr=0.3)
    with ShareStore(root, party=0, initial_model=np.linspace(-1, 1, DIM, dtype=np.float32),
                    server_lr=0.25) as again:  # same values: opens
        assert again.num_rounds == 0
    # stray temp files and unreferenced blobs (a crash's leftovers) are removed at open
    (root / "tmp" / "blob-x.tmp").write_bytes(b"partial")
    stray = root / "blobs" / ("ab" * 32 + ".blob")
    stray.write_bytes(b"whatever")
    unknown = root / "blobs" / "README"
    unknown.write_text("not ours")
    with ShareStore(root, party=0) as again:
        assert sorted(p.name for p in again.recovered_files) == sorted(["blob-x.tmp", stray.name])
    assert not stray.exists() and unknown.exists()  # never delete what it does not understand


def test_the_store_imports_neither_torch_nor_crypten():
    code = ("import sys, servers.store.share_store; "
            "print(sorted(m for m in ('torch', 'crypten') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "writer":
    sys.exit(_writer_main(sys.argv[2:]))
