"""``starfish bench shard-store``: one server's stored updates on K workers' shard directories.

Oracles: the bench checks every read against the array it staged (numpy) and exits 1 otherwise;
here the tiny shapes' files are counted against the shard plan (each directory holds its slice
of every update, the coordinator none) and a bad option is refused in one line."""

from __future__ import annotations

import json

import pytest

from bench import shard_store
from bench.synthetic import config
from servers.workers.shards import shard_bounds


def test_the_updates_are_in_the_shard_directories_and_read_back_at_the_workers(tmp_path, capsys):
    pytest.importorskip("ray")
    out = tmp_path / "store.json"
    assert shard_store.main(["--config", "tiny", "--workers", "2", "--rounds", "2", "--quiet", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["result"]
    cfg = config("tiny")
    # each shard directory: its slice (8 bytes a coordinate) of the 2 x N stored updates, plus the
    # blob format's header per file; the coordinator keeps 3 float32 models and its catalog
    for k, (a, b) in enumerate(shard_bounds(cfg.num_params, 2)):
        payload = 2 * cfg.clients * (b - a) * 8
        assert payload <= res["disk_bytes"]["shards"][k] <= payload + 2 * cfg.clients * 200
        # client 0's two updates erased from every shard
        assert res["disk_bytes"]["shards"][k] - res["disk_bytes_after_erasure"]["shards"][k] >= 2 * (b - a) * 8
    assert res["erased_blobs"] == 2 and res["read_round_at_workers_s"] is not None
    assert "each worker its slices" in capsys.readouterr().out


def test_a_bad_option_is_refused_in_one_line(capsys):
    assert shard_store.main(["--config", "tiny", "--workers", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("starfish bench shard-store: --workers must be 1..")
