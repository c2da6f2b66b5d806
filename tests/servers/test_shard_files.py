"""A store whose update shares live on coordinate shards (``servers.store.shard_files``, issue 30).

Oracles: numpy (what was staged or appended, sliced by the shard plan), the catalog's own
references (which digests each shard must hold), and a byte scan of every file of the store
and its shards for the forgotten clients' slices. The shard directories are local here
(``SliceDirs``); the daemon reaches the same calls through its workers
(``tests/servers/test_service_workers.py``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.share_seeds import find_traces
from servers.store.blobs import BlobCorruptError, BlobMissingError, BlobStore, encode_blob
from servers.store.shard_files import SliceDirs, named_blob
from servers.store.share_store import ClientShares, ShareStore, StoreError
from servers.workers.shards import shard_bounds
from tests.helpers.store_helpers import expected_share, ring


def _open(root, dim, k, party=0, m0=None):
    dirs = [os.path.join(root, "shards", f"w{i}") for i in range(k)]
    shards = SliceDirs(dirs, shard_bounds(dim, k))
    m0 = np.linspace(-1, 1, dim, dtype=np.float32) if m0 is None else m0
    return ShareStore(os.path.join(root, "store"), party=party, initial_model=m0, server_lr=0.5,
                      shards=shards), shards


def _slices_on_disk(shards, digest):
    return [BlobStore(d.root, keyed=False).read(digest) for d in shards.dirs]


@settings(max_examples=25)
@given(dim=st.integers(1, 40), k=st.integers(1, 5), seed=st.integers(0, 2**32 - 1),
       rounds=st.integers(1, 3), party=st.sampled_from([0, 1]), data=st.data())
def test_every_update_is_on_its_shards_reads_back_and_erasure_leaves_no_slice(tmp_path_factory, dim, k, seed,
                                                                              rounds, party, data):
    k = min(k, dim)
    root = str(tmp_path_factory.mktemp("sharded"))
    rng = np.random.default_rng(seed)
    store, shards = _open(root, dim, k, party)
    bounds = shard_bounds(dim, k)
    sent = {}
    with store:
        for r in range(1, rounds + 1):
            clients = sorted(data.draw(st.sets(st.integers(0, 6), min_size=1, max_size=4), label=f"round {r}"))
            shares = {}
            for j in clients:
                # server 0 may hold a seed (no file at all), as a client's upload gives it
                sent[(r, j)] = rng.bytes(16) if party == 0 and rng.random() < 0.4 else ring(rng, (dim,))
                shares[j] = ClientShares(sent[(r, j)], ring(rng, ()), ring(rng, ()))
            model, weights = np.full(dim, r, np.float32), {j: 1 / len(clients) for j in clients}
            if data.draw(st.booleans(), label="staged, then committed"):   # an FL round's path
                for j in clients:
                    store.stage_upload(r, j, shares[j].update, shares[j].norm, shares[j].delta)
                store.commit_round(r, model, clients, weights)
            else:                                                         # the lab's secure twin's
                store.append_round(r, model, clients, weights, shares)
        blobs = {}
        for (r, j), upd in sent.items():
            assert np.array_equal(store.update_share(r, j), expected_share(upd, (dim,)))
            ref = store.update_ref(r, j)
            if ref.startswith("blob:"):
                blobs[(r, j)] = ref[5:]
                # slice k on shard k is exactly numpy's slice of the update
                for (a, b), part in zip(bounds, _slices_on_disk(shards, ref[5:])):
                    assert np.array_equal(part, upd[a:b])
            else:
                assert ref == f"seed:{upd.hex()}"
        assert shards.names() == [set(blobs.values())] * k
        # the coordinator's own directory keeps models only: no m-long int64 file
        assert all(store.blobs.read(d).dtype != np.int64 for d in store.blobs.digests())
        assert store.verify() == []
        gone = sorted(data.draw(st.sets(st.sampled_from(sorted({j for _, j in sent})), min_size=1), label="forget"))
        report = store.adopt_unlearning(rounds + 1, np.zeros(dim, np.float32), job="job-1", forgotten=gone)
        kept = {d for (r, j), d in blobs.items() if j not in gone}
        assert shards.names() == [kept] * k
        assert report.blobs_removed == len({d for (r, j), d in blobs.items() if j in gone} - kept)
    # nothing of a forgotten client's slices anywhere under the store and its shards
    traces = [sent[(r, j)][a:b].astype("<i8").tobytes()[:16] for (r, j) in blobs if j in gone
              for a, b in bounds if b - a >= 2]
    traces = [t for t in traces if not any(t in sent[key][a:b].astype("<i8").tobytes()
                                           for key in blobs if key[1] not in gone for a, b in bounds)]
    assert find_traces(root, traces) == []


def test_a_crash_between_the_slices_and_the_catalog_leaves_nothing_after_the_next_open(tmp_path):
    dim, k = 23, 3
    store, shards = _open(tmp_path, dim, k)
    rng = np.random.default_rng(1)
    kept = ring(rng, (dim,))
    store.stage_upload(1, 4, kept, ring(rng, ()), ring(rng, ()))
    # what a writer killed after ``ShardFiles.put`` and before its catalog row leaves behind,
    # with a temporary file of a half-written slice
    orphan = ring(rng, (dim,))
    shards.put([(encode_blob(orphan).digest, orphan)])
    (shards.dirs[1].tmp / "blob-x.tmp").write_bytes(b"half")
    store.close()
    store, shards = _open(tmp_path, dim, k)
    with store:
        assert shards.names() == [{store.staged_update_ref(1, 4)[5:]}] * k
        assert all(list(d.tmp.iterdir()) == [] for d in shards.dirs)
        assert np.array_equal(store.staged_upload(1, 4).update, kept)


def test_a_damaged_swapped_or_missing_slice_is_named_in_one_line(tmp_path):
    dim, k = 30, 3
    store, shards = _open(tmp_path, dim, k, party=1)
    rng = np.random.default_rng(2)
    a, b = ring(rng, (dim,)), ring(rng, (dim,))
    with store:
        store.stage_upload(1, 0, a, ring(rng, ()), ring(rng, ()))
        store.stage_upload(1, 1, b, ring(rng, ()), ring(rng, ()))
        store.commit_round(1, np.ones(dim, np.float32), [0, 1], {0: 0.5, 1: 0.5})
        da, db = store.update_ref(1, 0)[5:], store.update_ref(1, 1)[5:]
        lo, hi = shard_bounds(dim, k)[2]
        # shard 2's slice of a replaced by b's, well formed: only the joined digest can tell
        swapped = named_blob(da, b[lo:hi])
        shards.dirs[2].path(da).write_bytes(bytes(swapped.prefix) + bytes(swapped.payload))
        with pytest.raises(BlobCorruptError, match=r"round 1 client 0 update: the shards' slices of blob"):
            store.update_share(1, 0)
        assert np.array_equal(store.update_share(1, 1), b)
        problems = store.verify()
        assert len(problems) == 1 and "do not join" in problems[0] and "\n" not in problems[0]
        # a flipped byte in a slice's payload: its own checksum
        p1 = shards.dirs[0].path(db)
        raw = bytearray(p1.read_bytes())
        raw[-1] ^= 1
        p1.write_bytes(bytes(raw))
        with pytest.raises(BlobCorruptError, match="payload checksum mismatch"):
            store.update_share(1, 1)
        p1.unlink()
        with pytest.raises(BlobMissingError, match=str(p1)):
            store.update_share(1, 1)
        assert len(store.verify()) == 2

@pytest.mark.parametrize("made, opened", [(1, 2), (2, 1), (3, 2)])
def test_a_store_cannot_change_its_number_of_shards(tmp_path, made, opened):
    dim = 10
    m0 = np.zeros(dim, np.float32)
    if made == 1:
        ShareStore(tmp_path / "store", party=0, initial_model=m0, server_lr=0.5).close()
    else:
        _open(tmp_path, dim, made, m0=m0)[0].close()
    with pytest.raises(StoreError) as err:
        if opened == 1:
            ShareStore(tmp_path / "store", party=0)
        else:
            _open(tmp_path, dim, opened, m0=m0)
    msg = str(err.value)
    assert f"on {made} shard(s)" in msg and f"runs {opened}" in msg and f"workers = {made}" in msg
    assert "\n" not in msg


class _FailingOnce(SliceDirs):
    """Shard directories whose next sweep fails once ``failed`` is False, as a worker that dies
    during an erasure."""

    failed = False

    def sweep(self, keep):
        if not self.failed:
            self.failed = True
            raise RuntimeError("sweep_slices failed on 1 of 2 workers: server1-w1 is gone")
        return super().sweep(keep)


def test_an_erasure_whose_shard_fails_finishes_at_the_replay_of_the_adoption(tmp_path):
    dim, k = 12, 2
    dirs = [tmp_path / "shards" / f"w{i}" for i in range(k)]
    shards = _FailingOnce(dirs, shard_bounds(dim, k))
    shards.failed = True              # the open's recovery sweep passes
    store = ShareStore(tmp_path / "store", party=1, initial_model=np.zeros(dim, np.float32), server_lr=0.5,
                       shards=shards)
    shards.failed = False             # the adoption's sweep fails once
    rng = np.random.default_rng(3)
    gone, kept = ring(rng, (dim,)), ring(rng, (dim,))
    with store:
        store.append_round(1, np.ones(dim, np.float32), [0, 1], {0: 0.5, 1: 0.5},
                           {0: ClientShares(gone, ring(rng, ()), ring(rng, ())),
                            1: ClientShares(kept, ring(rng, ()), ring(rng, ()))})
        with pytest.raises(RuntimeError, match="server1-w1 is gone"):
            store.adopt_unlearning(2, np.zeros(dim, np.float32), job="job-1", forgotten=[0])
        # committed: the catalog forgot client 0, its slices are still on the shards
        assert store.num_rounds == 2 and store.participants(1) == (1,)
        assert all(len(n) == 2 for n in shards.names())
        report = store.adopt_unlearning(2, np.zeros(dim, np.float32), job="job-1", forgotten=[0])
        assert report.replayed
        assert shards.names() == [{store.update_ref(1, 1)[5:]}] * k
        assert np.array_equal(store.update_share(1, 1), kept)
