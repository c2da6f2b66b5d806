"""Property: UE's estimate and the pairs' curvature test on shares equal their oracles whatever
the pairs' length.

Why: a robustly aggregated history (BRACE moves every coordinate by its full step) gives L-BFGS
pairs hundreds of times longer than FedAvg's; before ``update_estimation.pair_scales`` the small
system's W^{-1} and the public 1 / s_B^T s_B fell below the 2**-16 grid there (on the MNIST
shapes' BRACE replay sigma was off by 5%). The domain drawn here: ||s_k|| from 2**-2 to 2**10
(per pair, independently), curvature a from 2**-3 to 2**3 (y = a s plus a perturbation, so
y^T s > 0), ||v|| from 2**-4 to 1 times the pairs' length, B = 1..3, 1..3 rows, m = 8..48.

The oracle: ``dense_bfgs`` (float64, the BFGS recursion; ``test_update_estimation.py``) on the
inputs as the shares hold them (Y and the stored rows put on the 2**-16 grid). Accuracy: the
small system is solved at 16 fractional bits on unit-length pairs, so the coefficients carry a
relative error of about 2**-16 times W's condition; 2e-3 of max(1, |H v|) per entry covers
the drawn domain (the measured worst is in the hypothesis notes).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from protocols.starfish.pair_buffers import MIN_COSINE
from protocols.starfish.update_estimation import estimate_updates, pair_scales
from tests.helpers import secure_programs
from tests.protocols.starfish.test_update_estimation import dense_bfgs

torch.set_num_threads(1)

TOL = 2e-3


def grid(x: np.ndarray) -> np.ndarray:
    """What a sharing holds: CrypTen's encoder truncates x * 2**16."""
    return np.trunc(x * 2.0 ** 16) / 2.0 ** 16


@st.composite
def cases(draw):
    rows = draw(st.integers(1, 3), label="rows")
    m = draw(st.integers(8, 48), label="m")
    b = draw(st.integers(1, 3), label="B")
    log_len = draw(st.lists(st.floats(-2.0, 10.0), min_size=b, max_size=b), label="log2 ||s_k||")
    log_a = draw(st.floats(-3.0, 3.0), label="log2 curvature")
    log_v = draw(st.floats(-4.0, 0.0), label="log2 ||v|| / max ||s_k||")
    seed = draw(st.integers(0, 2 ** 32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    S = rng.normal(size=(rows, m, b))
    S *= 2.0 ** np.array(log_len) / np.linalg.norm(S, axis=1, keepdims=True)
    a = 2.0 ** log_a
    # a mildly anisotropic quadratic: y = a (1 + 0.2 u) * s coordinate-wise, u in [-1, 1]
    Y = grid(a * (1.0 + 0.2 * rng.uniform(-1, 1, size=(rows, m, 1))) * S)
    v = rng.normal(size=m)
    v *= 2.0 ** (log_v + max(log_len)) / np.linalg.norm(v)
    stored = grid(rng.normal(size=(rows, m)) * 0.1)
    return {"stored": stored, "v": v, "S": S, "Y": Y}


def oracle(c: dict) -> np.ndarray:
    S, Y = torch.from_numpy(c["S"]), torch.from_numpy(c["Y"])
    v = torch.from_numpy(c["v"])
    return np.stack([c["stored"][j] + (dense_bfgs(S[j], Y[j]) @ v).numpy() for j in range(S.shape[0])])


#: 4 cases a 2PC call, a quarter of the profile's examples (default 20 -> 5 calls, 20 cases a
#: mode): a two-party estimate costs about 0.5 s a case here, and the suite has 10 minutes
@settings(deadline=None, max_examples=max(5, settings.default.max_examples // 4))
@given(st.lists(cases(), min_size=4, max_size=4))
def test_estimates_equal_the_dense_oracle_for_every_pair_length(pair_in_each_mode, batch):
    want = [oracle(c) for c in batch]
    # the plaintext twin runs the same scaled solve: float64 rounding only
    for c, w in zip(batch, want):
        plain = estimate_updates(torch.from_numpy(c["stored"]), torch.from_numpy(c["v"]),
                                 torch.from_numpy(c["S"]), torch.from_numpy(c["Y"])).numpy()
        np.testing.assert_allclose(plain, w, rtol=1e-7, atol=1e-7 * (1 + np.abs(w).max()))
    cases_t = [{k: torch.from_numpy(np.ascontiguousarray(x)) for k, x in c.items()} for c in batch]
    got = pair_in_each_mode.call(secure_programs.estimates_of, cases_t)[0]
    for c, g, w in zip(batch, got, want):
        hv = np.abs(w - c["stored"]).max()
        err = np.abs(g - w).max()
        note(f"||s|| {np.linalg.norm(c['S'], axis=1).round(3).tolist()}, max|Hv| {hv:.3g}, error {err:.3g}")
        assert err <= TOL * max(1.0, hv), (err, hv)


def test_pair_scales_are_powers_of_two_near_the_inverse_length():
    sts = torch.diag_embed(torch.tensor([[0.0, 2.0 ** -20, 1.0, 3.0, 2.0 ** 20, 2.0 ** 40]]))
    c = pair_scales(sts)[0]
    # 0-length: 1; clamps at 2**8 and 2**-16; otherwise 2**-round(log2 ||s||)
    assert c.tolist() == [1.0, 2.0 ** 8, 1.0, 2.0 ** -1, 2.0 ** -10, 2.0 ** -16]


@st.composite
def secants(draw):
    """A public s of length 2**-2..2**10 and secants y with cos(y, s) across the test's edge
    (negative, near 0, just below and above MIN_COSINE, large) and ||y|| / ||s|| in 2**-3..2**3."""
    m = draw(st.integers(8, 48), label="m")
    k = draw(st.integers(1, 6), label="secants")
    log_len = draw(st.floats(-2.0, 10.0), label="log2 ||s||")
    cosines = draw(st.lists(st.one_of(st.floats(-0.9, 0.9), st.floats(0.0, 0.02)), min_size=k, max_size=k),
                   label="cos(y, s)")
    ratios = draw(st.lists(st.floats(-3.0, 3.0), min_size=k, max_size=k), label="log2 ||y|| / ||s||")
    seed = draw(st.integers(0, 2 ** 32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    s = rng.normal(size=m)
    s *= 2.0 ** log_len / np.linalg.norm(s)
    unit = s / np.linalg.norm(s)
    ys = []
    for cos, r in zip(cosines, ratios):
        p = rng.normal(size=m)
        p -= (p @ unit) * unit
        p /= np.linalg.norm(p)
        ys.append(grid(2.0 ** (r + log_len) * (cos * unit + np.sqrt(1 - cos * cos) * p)))
    return {"s": s, "Y": np.stack(ys)}


def curvature_oracle(s: np.ndarray, y: np.ndarray) -> tuple[bool, bool]:
    """(the rule on the encoded secant, whether it is within fixed point's reach of the edge)."""
    cos = float(y @ s) / (np.linalg.norm(y) * np.linalg.norm(s))
    return bool(cos >= MIN_COSINE and y @ s > 0), abs(cos - MIN_COSINE) < 1e-3


@settings(deadline=None, max_examples=max(5, settings.default.max_examples // 4))
@given(st.lists(secants(), min_size=8, max_size=8))
def test_curvature_test_equals_the_rule_for_every_pair_length(pair_in_each_mode, batch):
    cases_t = [{"s": torch.from_numpy(c["s"]), "Y": torch.from_numpy(c["Y"])} for c in batch]
    got = pair_in_each_mode.call(secure_programs.curvature_of, cases_t)[0]
    for c, bits in zip(batch, got):
        for y, bit in zip(c["Y"], bits):
            want, edge = curvature_oracle(c["s"], y)
            note(f"||s|| {np.linalg.norm(c['s']):.3g}, y^T s {float(y @ c['s']):.3g}, want {want}, got {bit}")
            if not edge:
                assert bit == want
