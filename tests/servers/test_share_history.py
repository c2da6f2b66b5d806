"""The History adapter over a server's store (servers.secure.share_history), against oracles.

Oracles: the store's own accessors (the adapter must give back exactly what it holds), the
client-side sharing in ``common.sharing`` (a CrypTen two-party session reading both parties'
stores must compute on the clients' values) and the round range a pinned view promises.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mpc.launcher import run_parties
from common import sharing
from protocols.starfish.ports import History, RoundRecord
from servers.store import share_store as ss
from servers.secure.share_history import ShareHistory
from servers.store.share_store import ClientShares, ShareStore
from tests.helpers.store_helpers import DIM, new_store, ring, uploads


def test_history_append_round_detects_replay_only_with_a_round_index(tmp_path):
    rng = np.random.default_rng(2)
    with new_store(tmp_path / "s", 1) as store:
        hist = ShareHistory(store)
        rec = RoundRecord(model=torch.zeros(DIM), participants=(1, 2), weights={1: 0.5, 2: 0.5},
                          updates={1: ring(rng, (DIM,)), 2: ring(rng, (DIM,))},
                          norms={1: ring(rng, ()), 2: ring(rng, ())},
                          deltas={1: ring(rng, ()), 2: ring(rng, ())})
        hist.append_round(rec)
        hist.append_round(rec, round_index=1)  # replay: no-op
        assert hist.num_rounds == 1
        with pytest.raises(ss.RoundConflictError):
            hist.append_round(RoundRecord(torch.ones(DIM), rec.participants, rec.weights,
                                          rec.updates, rec.norms, rec.deltas), round_index=1)
        plain = RoundRecord(torch.zeros(DIM), (1,), {1: 1.0}, {1: torch.randn(DIM)},
                            {1: torch.tensor(2.0)}, {1: torch.tensor(0.1)})
        with pytest.raises(TypeError, match="int64"):  # a plaintext record is refused
            hist.append_round(plain)
        assert hist.num_rounds == 1


def test_a_pinned_view_shows_rounds_1_to_t_only_and_is_read_only(tmp_path):
    rng = np.random.default_rng(8)
    with new_store(tmp_path / "s", 0) as store:
        models = [store.model(0)]
        for r in (1, 2, 3):
            models.append(rng.standard_normal(DIM).astype(np.float32))
            store.append_round(r, models[-1], [r, 9], {r: 0.5, 9: 0.5}, uploads(rng, [r, 9]))
        with pytest.raises(ValueError, match="job needs 4"):
            ShareHistory(store, rounds=4)
        calls = []
        hist = ShareHistory(store, wrap=lambda s, precision: calls.append(precision) or ("wrapped", s),
                            rounds=2)
        assert isinstance(hist, History) and hist.num_rounds == 2 and hist.server_lr == 0.25
        assert hist.clients() == (1, 2, 9)  # round 3's client 3 is not in the view
        assert torch.equal(hist.model(2), torch.from_numpy(models[2]))
        assert torch.equal(hist.model_delta(1), torch.from_numpy(models[1] - models[0]))
        assert hist.participants(2) == (2, 9) and dict(hist.weights(1)) == {1: 0.5, 9: 0.5}
        assert hist.update(2, 9)[0] == "wrapped" and calls == [16]
        assert np.array_equal(hist.update(2, 9)[1], store.update_share(2, 9))
        assert np.array_equal(hist.norm(1, 1)[1], store.norm_share(1, 1))
        assert np.array_equal(hist.delta(1, 9)[1], store.delta_share(1, 9))
        for read in (lambda: hist.model(3), lambda: hist.participants(3), lambda: hist.weights(0),
                     lambda: hist.update(3, 3), lambda: hist.norm(3, 9), lambda: hist.delta(3, 9)):
            with pytest.raises(IndexError):
                read()
        rec = RoundRecord(torch.zeros(DIM), (1,), {1: 1.0}, {1: ring(rng, (DIM,))},
                          {1: ring(rng, ())}, {1: ring(rng, ())})
        with pytest.raises(RuntimeError, match="read-only"):
            hist.append_round(rec)
        assert store.num_rounds == 3
        assert ShareHistory(store).num_rounds == 3  # unpinned: every committed round


# ====================================================================== two-party session
def _party_reads_store(party, roots, client):
    """Two-party program: each party opens its own store and computes on wrapped shares."""
    store = ShareStore(roots[party.rank], party=party.rank)
    try:
        hist = ShareHistory(store, wrap=party.wrap_share)
        out = []
        for i in range(1, hist.num_rounds + 1):
            g = hist.update(i, client)
            dm = hist.model_delta(i).double()
            u = (g * dm).sum()  # <[g_i], M_i - M_{i-1}>: a public factor, local
            out.append((g.get_plain_text().double().numpy(), float(u.get_plain_text()),
                        float(hist.norm(i, client).get_plain_text())))
        return out
    finally:
        store.close()


def test_a_two_party_session_computes_on_the_stored_shares(tmp_path):
    rng = np.random.default_rng(4)
    roots = [str(tmp_path / "p0"), str(tmp_path / "p1")]
    stores = [new_store(Path(roots[0]), 0), new_store(Path(roots[1]), 1)]
    xs, models = [], [stores[0].model(0)]
    for r in (1, 2):
        x = rng.normal(size=DIM)
        sx, sn = sharing.share(x, compress=True), sharing.share(np.float64(np.linalg.norm(x)))
        z = sharing.share(np.float64(0.5))
        model = models[-1] - np.float32(0.1) * x.astype(np.float32)
        stores[0].append_round(r, model, [7], {7: 1.0}, {7: ClientShares(sx.seed0, sn.share0, z.share0)})
        stores[1].append_round(r, model, [7], {7: 1.0}, {7: ClientShares(sx.share1, sn.share1, z.share1)})
        xs.append(x)
        models.append(model)
    for s in stores:
        s.close()
    res = run_parties(_party_reads_store, roots, 7, insecure_tfp=True, timeout=60)
    for values in res.values:
        for (g, u, n), x, m_prev, m in zip(values, xs, models, models[1:]):
            assert np.max(np.abs(g - x)) <= 1e-3
            expect_u = float(x @ (m.astype(np.float64) - m_prev.astype(np.float64)))
            assert abs(u - expect_u) <= 1e-2 * max(1.0, abs(expect_u))
            assert abs(n - np.linalg.norm(x)) <= 1e-3
