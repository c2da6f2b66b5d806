"""Seeded shares: reproducible from the key and label, unrelated across labels, still correct."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from clients.share_seeds import disk_traces, find_traces, seeded_shares, share_seed
from common.prg import expand
from common.sharing import reconstruct

KEY = b"-----BEGIN PRIVATE KEY----- test key bytes"


@given(st.lists(st.floats(-1e4, 1e4), min_size=1, max_size=20), st.text(min_size=1, max_size=30))
def test_seeded_shares_reconstruct_and_repeat_exactly(values, label):
    v = {"update": np.array(values), "norm": np.array(float(np.linalg.norm(values)))}
    a = seeded_shares(KEY, label, v, 16)
    b = seeded_shares(KEY, label, v, 16)
    for name, x in v.items():
        s0 = expand(a[name].seed0, a[name].shape)
        assert np.allclose(reconstruct(s0, a[name].share1, 16), x, atol=2.0 ** -15)
        assert a[name].seed0 == b[name].seed0 and np.array_equal(a[name].share1, b[name].share1)
    assert a["update"].seed0 != a["norm"].seed0     # one seed per value, never shared


def test_seeds_depend_on_key_and_label_and_need_a_key():
    assert share_seed(KEY, "round/1/update") != share_seed(KEY, "round/2/update")
    assert share_seed(KEY, "round/1/update") != share_seed(KEY + b"x", "round/1/update")
    with pytest.raises(ValueError):
        share_seed(b"", "round/1/update")


def test_traces_are_found_in_files_that_hold_them(tmp_path):
    sh = seeded_shares(KEY, "round/3", {"update": np.arange(20.0), "norm": np.array(3.0)}, 16)
    tr = disk_traces(sh)
    (tmp_path / "a").write_bytes(b"xx" + tr[0][1] + b"yy")          # the seed in hex
    (tmp_path / "b").write_bytes(np.asarray(sh["update"].share1, "<i8").tobytes())
    (tmp_path / "c").write_bytes(b"nothing here")
    assert {p.rsplit("/", 1)[1] for p, _ in find_traces(tmp_path, tr[0])} == {"a"}
    assert {p.rsplit("/", 1)[1] for p, _ in find_traces(tmp_path, tr[1])} == {"b"}
