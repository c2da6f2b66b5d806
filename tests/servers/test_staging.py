"""Staging of uploads for the open round (servers.store.staging), against the values written.

Oracles: the shares the test uploaded (kept in variables), the round the store says is
open, and the blob files on disk (a withdrawn upload's file must go, nothing else).
"""

from __future__ import annotations

import numpy as np
import pytest

from servers.store import share_store as ss
from servers.store.share_store import ClientShares, ShareStore
from tests.helpers.store_helpers import DIM, blob_files, new_store, ring, uploads


def test_staged_uploads_are_idempotent_refuse_conflicts_and_commit_only_when_complete(tmp_path):
    rng = np.random.default_rng(6)
    root = tmp_path / "s"
    with new_store(root, 0) as store:
        assert store.append_round(1, rng.standard_normal(DIM).astype(np.float32), [1, 2],
                                  {1: 0.25, 2: 0.75}, uploads(rng, [1, 2])) is True
        # staging: a client's retry is a no-op, a different upload a conflict
        up3 = uploads(rng, [3])[3]
        assert store.stage_upload(2, 3, up3.update, up3.norm, up3.delta) is True
        assert store.stage_upload(2, 3, up3.update.copy(), up3.norm, up3.delta) is False
        new3 = ClientShares(ring(rng, (DIM,)), up3.norm, up3.delta)
        with pytest.raises(ss.StagingConflictError):
            store.stage_upload(2, 3, *[new3.update, new3.norm, new3.delta])
        assert np.array_equal(store.staged_upload(2, 3).update, up3.update)
        assert store.stage_upload(2, 3, new3.update, new3.norm, new3.delta, replace=True) is True
        assert np.array_equal(store.staged_upload(2, 3).update, new3.update)
        with pytest.raises(ss.StagingError, match="already committed"):
            store.stage_upload(1, 3, *new3.__dict__.values())
        with pytest.raises(ss.StagingError, match="not open"):
            store.stage_upload(3, 3, *new3.__dict__.values())
        # commit needs every agreed participant's upload, and changes nothing otherwise
        model2 = rng.standard_normal(DIM).astype(np.float32)
        with pytest.raises(ss.StagingError, match=r"\[4\] have no staged upload"):
            store.commit_round(2, model2, [3, 4], {3: 0.5, 4: 0.5})
        assert store.num_rounds == 1 and store.staged(2) == (3,)
        assert store.commit_round(2, model2, [3], {3: 1.0}) is True
        assert store.commit_round(2, model2, [3], {3: 1.0}) is False  # replay after a crash
        with pytest.raises(ss.RoundConflictError, match="participants"):
            store.commit_round(2, model2, [3, 5], {3: 0.5, 5: 0.5})
        assert np.array_equal(store.update_share(2, 3), new3.update)
    with ShareStore(root, party=0) as store:
        assert store.num_rounds == 2 and store.recovered_files == ()


def test_drop_staged_withdraws_uploads_and_their_files(tmp_path):
    rng = np.random.default_rng(10)
    root = tmp_path / "s"
    with new_store(root, 0) as store:
        ups = uploads(rng, [1, 2, 3])
        for c, up in ups.items():
            assert store.stage_upload(1, c, up.update, up.norm, up.delta)
        assert store.staged(1) == (1, 2, 3) and len(blob_files(root)) == 4  # M_0 + 3 updates
        assert store.drop_staged(1, 2) == (2,)
        assert store.drop_staged(1, 2) == ()  # already gone
        assert store.staged(1) == (1, 3) and len(blob_files(root)) == 3
        with pytest.raises(KeyError, match="no staged upload"):
            store.staged_upload(1, 2)
        assert np.array_equal(store.staged_upload(1, 3).update, ups[3].update)
        assert store.drop_staged(1) == (1, 3)
        assert store.staged(1) == () and len(blob_files(root)) == 1
        with pytest.raises(ss.StagingError, match="have no staged upload"):
            store.commit_round(1, store.model(0), [1], {1: 1.0})
    with ShareStore(root, party=0) as store:
        assert store.staged(1) == () and store.recovered_files == ()
