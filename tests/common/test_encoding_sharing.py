"""Client-side fixed-point encoding and sharing (numpy only) against CrypTen and numpy."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from common import encoding, prg, sharing

RNG = np.random.default_rng(7)


def _values(dtype):
    return np.concatenate([
        RNG.normal(size=500) * 1e4, -RNG.random(100) * 1e-4, [0.0, -0.0, 1.5, -1.5, 2**29, -(2**29), 1e-6],
    ]).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_encoding_is_bit_exact_with_crypten(dtype):
    from mpc.crypten_compat import crypten  # noqa: F401
    from crypten.encoder import FixedPointEncoder

    x = _values(dtype)
    theirs = FixedPointEncoder(precision_bits=16).encode(torch.from_numpy(x)).numpy()
    assert np.array_equal(encoding.encode(x), theirs)


def test_integer_encoding_and_decode_roundtrip():
    ints = np.array([-3, 0, 7, 2**20])
    assert np.array_equal(encoding.encode(ints), ints * 2**16)
    x = _values(np.float64)
    assert np.max(np.abs(encoding.decode(encoding.encode(x)) - x)) <= 2**-16


@pytest.mark.parametrize("bad", [[np.nan], [np.inf], [2.0**31], ["a"]])
def test_encoding_rejects_unrepresentable_input(bad):
    with pytest.raises(encoding.EncodingError):
        encoding.encode(np.array(bad))


@pytest.mark.parametrize("compress", [False, True])
def test_shares_reconstruct_and_each_share_alone_looks_uniform(compress):
    x = _values(np.float64)
    s = sharing.share(x, compress=compress)
    share0 = s.materialize_share0()
    assert np.max(np.abs(sharing.reconstruct(share0, s.share1) - x)) <= 2**-16
    # each share alone: about half of the bits set, whatever the value (x has many zeros/small values)
    for sh in (share0, s.share1):
        bits = np.unpackbits(sh.view(np.uint8))
        assert abs(bits.mean() - 0.5) < 0.02
    assert (s.seed0 is not None) == compress and (s.share0 is None) == compress


def test_seed_compressed_share_is_reproducible_and_stream_separated():
    seed = prg.new_seed()
    a = prg.expand(seed, (1000,))
    assert np.array_equal(a, prg.expand(seed, (1000,)))
    assert not np.array_equal(a, prg.expand(seed, (1000,), stream=1))
    assert not np.array_equal(a, prg.expand(prg.new_seed(), (1000,)))
    with pytest.raises(ValueError):
        prg.Prg(b"short")


def test_aes_ctr_prg_matches_a_known_answer():
    # NIST SP 800-38A F.5.1 (CTR-AES128.Encrypt) with our counter layout: nonce 0..0, counter 0.
    key = bytes.fromhex("2b7e151628aed2a6abf7158809cf4f3c")
    from Crypto.Cipher import AES

    expected = AES.new(key, AES.MODE_ECB).encrypt(bytes(16))  # keystream block 0 = E_k(0)
    got = prg.Prg(key, 0).ring((2,)).tobytes()
    assert got == expected


def test_client_side_modules_do_not_load_torch_or_crypten():
    code = (
        "import sys; import common.encoding, common.sharing, common.prg; "
        "bad=[m for m in ('torch','crypten') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
