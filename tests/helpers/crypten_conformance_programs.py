"""CrypTen's operator set as a user's program runs it (``run_parties``), and its torch twin.

``CASES`` maps an operator to (CrypTen call, torch call, input names). The CrypTen call gets
CrypTensors (party 0 owns every input but those in ``OWNED_BY_1``, the private kernels and
second operands) or, for a name prefixed ``pub:``, the plain tensor (suffixed ``@20``: encoded
with 20 fractional bits instead of 16); the torch call gets plain
tensors throughout. ``conformance`` runs every case in one session (starting the parties is the
expensive part), each metered as its own step, and returns the opened results; the test holds
them to CrypTen's tolerance against the torch call.

Input domains keep each approximation inside the range CrypTen documents for it (log on
[1e-4, 250], reciprocal on about [0.1, 100], exp below about 7 with its default 8 iterations;
``exp_12_iterations_20_bits`` shows the documented way past that). Most inputs share one shape, so the
two-party engine compiles fewer programs.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from mpc.crypten_compat import cfg, crypten

OWNED_BY_1 = {"y", "m2", "ker", "ker1", "kerg", "kert"}


def inputs(seed: int = 7) -> dict[str, torch.Tensor]:
    """The cases' inputs (float64 is not needed: CrypTen encodes float32)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    def uniform(lo, hi, *shape):
        return lo + (hi - lo) * torch.rand(*shape, generator=g)

    x, y = randn(3, 5, scale=3.0), randn(3, 5, scale=3.0)
    y[:, :2] = x[:, :2]    # ties: eq, ne, ge and le must get equal values right
    return {
        "x": x,
        "y": y,
        "m1": randn(3, 4),
        "m2": randn(4, 2),
        "img": randn(1, 3, 6, 6),
        "ker": randn(4, 3, 3, 3),
        "kerg": randn(6, 1, 3, 3),                 # groups=3: one 3x3 kernel per (in, out) pair
        "kert": randn(3, 2, 3, 3),                 # conv_transpose2d: 3 in, 2 out channels
        "sig": randn(1, 3, 8),
        "ker1": randn(4, 3, 3),
        "pos": uniform(0.5, 20.0, 3, 5),           # reciprocal, log
        "base": uniform(0.5, 8.0, 3, 5),           # pos_pow: exp(1.5 log x) stays below e**3.2
        "small": uniform(-4.0, 4.0, 3, 5),         # exp, sigmoid, tanh, softmax
        "wide": uniform(-3000.0, 3000.0, 3, 5),    # division by integers across a wide range
        "exp_high": uniform(6.0, 10.0, 3, 5),      # exp beyond its default iterations
    }


def _one_hot_argmax(t: torch.Tensor, dim=None) -> torch.Tensor:
    if dim is None:
        return F.one_hot(t.flatten().argmax(), t.numel()).reshape(t.shape).to(t.dtype)
    return F.one_hot(t.argmax(dim), t.shape[dim]).movedim(-1, dim).to(t.dtype)


def _exp_more_iterations(x):
    # CrypTen's exp is (1 + x / 2**n)**(2**n): more iterations shrink the approximation's error
    # (x**2 / 2**(n + 1)) but multiply the first truncation's by 2**n, so past n = 10 they pay
    # only with more fractional bits (the input is encoded with 20: "@20")
    with cfg.temp_override({"functions.exp_iterations": 12}):
        return x.exp()


_SAME = None   # the torch call is the CrypTen call (CrypTensors mirror torch's methods)

CASES: dict[str, tuple] = {
    # arithmetic
    "add": (lambda x, y: x + y, _SAME, ("x", "y")),
    "sub": (lambda x, y: x - y, _SAME, ("x", "y")),
    "mul": (lambda x, y: x * y, _SAME, ("x", "y")),
    "mul_public": (lambda x, y: x * y, _SAME, ("x", "pub:y")),
    "mul_float": (lambda x: x * 0.37, _SAME, ("x",)),
    "mul_scalars": (lambda x, y: x.sum() * y.sum(), _SAME, ("x", "y")),   # 0-d shares keep their shape
    "neg": (lambda x: -x, _SAME, ("x",)),
    "square": (lambda x: x.square(), _SAME, ("x",)),
    "sum_dim": (lambda x: x.sum(1), _SAME, ("x",)),
    "matmul": (lambda a, b: a.matmul(b), _SAME, ("m1", "m2")),
    "matmul_public": (lambda a, b: a.matmul(b), _SAME, ("m1", "pub:m2")),
    # convolutions
    "conv2d_public": (lambda x, k: x.conv2d(k, padding=1), lambda x, k: F.conv2d(x, k, padding=1),
                      ("img", "pub:ker")),
    "conv2d_private": (lambda x, k: x.conv2d(k, padding=1), lambda x, k: F.conv2d(x, k, padding=1),
                       ("img", "ker")),
    "conv2d_private_stride_dilation": (lambda x, k: x.conv2d(k, stride=2, padding=2, dilation=2),
                                       lambda x, k: F.conv2d(x, k, stride=2, padding=2, dilation=2),
                                       ("img", "ker")),
    "conv2d_private_groups": (lambda x, k: x.conv2d(k, groups=3), lambda x, k: F.conv2d(x, k, groups=3),
                              ("img", "kerg")),
    "conv1d_private": (lambda x, k: x.conv1d(k, stride=2, padding=1),
                       lambda x, k: F.conv1d(x, k, stride=2, padding=1), ("sig", "ker1")),
    "conv_transpose2d_private": (lambda x, k: x.conv_transpose2d(k, stride=2, padding=1),
                                 lambda x, k: F.conv_transpose2d(x, k, stride=2, padding=1), ("img", "kert")),
    # comparisons
    "ge": (lambda x, y: x >= y, lambda x, y: (x >= y).to(x.dtype), ("x", "y")),
    "gt": (lambda x, y: x > y, lambda x, y: (x > y).to(x.dtype), ("x", "y")),
    "le": (lambda x, y: x <= y, lambda x, y: (x <= y).to(x.dtype), ("x", "y")),
    "lt": (lambda x, y: x < y, lambda x, y: (x < y).to(x.dtype), ("x", "y")),
    "eq": (lambda x, y: x.eq(y), lambda x, y: (x == y).to(x.dtype), ("x", "y")),
    "eq_self": (lambda x: x.eq(x), lambda x: (x == x).to(x.dtype), ("x",)),
    "ne": (lambda x, y: x.ne(y), lambda x, y: (x != y).to(x.dtype), ("x", "y")),
    "ne_self": (lambda x: x.ne(x), lambda x: (x != x).to(x.dtype), ("x",)),
    "eq_public": (lambda x: x.eq(0.0), lambda x: (x == 0.0).to(x.dtype), ("x",)),
    "relu": (lambda x: x.relu(), _SAME, ("x",)),
    "abs": (lambda x: x.abs(), _SAME, ("x",)),
    # max / argmax
    "max": (lambda x: x.max(), _SAME, ("x",)),
    "argmax": (lambda x: x.argmax(), lambda x: _one_hot_argmax(x), ("x",)),
    "max_dim": (lambda x: x.max(dim=1), lambda x: (x.max(1).values, _one_hot_argmax(x, 1)), ("x",)),
    "argmax_dim": (lambda x: x.argmax(dim=0), lambda x: _one_hot_argmax(x, 0), ("x",)),
    "max_pool2d": (lambda x: x.max_pool2d(2), lambda x: F.max_pool2d(x, 2), ("img",)),
    "max_pool2d_k3_pad": (lambda x: x.max_pool2d(3, padding=1, stride=2),
                          lambda x: F.max_pool2d(x, 3, padding=1, stride=2), ("img",)),
    # approximations
    "reciprocal": (lambda x: x.reciprocal(), _SAME, ("pos",)),
    "sigmoid": (lambda x: x.sigmoid(), _SAME, ("small",)),
    "tanh": (lambda x: x.tanh(), _SAME, ("small",)),
    "exp": (lambda x: x.exp(), _SAME, ("small",)),
    "exp_12_iterations_20_bits": (_exp_more_iterations, lambda x: x.exp(), ("exp_high@20",)),
    "log": (lambda x: x.log(), _SAME, ("pos",)),
    "pos_pow": (lambda x: x.pos_pow(1.5), lambda x: x.pow(1.5), ("base",)),
    "softmax": (lambda x: x.softmax(1), lambda x: x.softmax(1), ("small",)),
    "log_softmax": (lambda x: x.log_softmax(1), lambda x: x.log_softmax(1), ("small",)),
    # indexing
    "index_slice": (lambda x: x[1:3, ::2], _SAME, ("x",)),
    "index_select": (lambda x: x.index_select(1, torch.tensor([0, 4, 2])), _SAME, ("x",)),
    "gather": (lambda x: x.gather(1, torch.tensor([[0, 1], [4, 2], [3, 3]])), _SAME, ("x",)),
    # statistics, pooling, division by public integers
    "mean": (lambda x: x.mean(), _SAME, ("x",)),
    "mean_dim": (lambda x: x.mean(1), _SAME, ("x",)),
    # CrypTen 0.4.1 reads its ``unbiased`` flag inverted: by default it divides by n - 1
    "var": (lambda x: x.var(), lambda x: x.var(), ("x",)),
    "var_dim": (lambda x: x.var(0), lambda x: x.var(0), ("x",)),
    "avg_pool2d_k2": (lambda x: x.avg_pool2d(2), lambda x: F.avg_pool2d(x, 2), ("img",)),
    "avg_pool2d_k3": (lambda x: x.avg_pool2d(3), lambda x: F.avg_pool2d(x, 3), ("img",)),
    "div_3": (lambda x: x / 3, _SAME, ("wide",)),
    "div_7": (lambda x: x.div(7), _SAME, ("wide",)),
    "div_120": (lambda x: x.div(120), _SAME, ("wide",)),
    "div_1000": (lambda x: x / 1000, _SAME, ("wide",)),
    "div_65535": (lambda x: x / 65535, _SAME, ("wide",)),
    "div_int_tensor": (lambda x: x.div(torch.tensor([3, 8, 10, 1, 9])), _SAME, ("wide",)),
}


def _plain_name(name: str) -> str:
    return name.removeprefix("pub:").split("@")[0]


def plain(name: str, data: dict):
    """The torch twin of case ``name`` on the plain inputs."""
    secure, twin, names = CASES[name]
    return (twin or secure)(*[data[_plain_name(n)] for n in names])


def _secure_arg(name: str, data: dict, cache: dict):
    if name.startswith("pub:"):
        return data[name[4:]]
    if name not in cache:
        base, _, bits = name.partition("@")
        cache[name] = crypten.cryptensor(data[base], src=1 if base in OWNED_BY_1 else 0,
                                         precision=int(bits) if bits else None)
    return cache[name]


def _open(value):
    if isinstance(value, (tuple, list)):
        return tuple(_open(v) for v in value)
    return value.get_plain_text().double().numpy().copy()


def conformance(party, data: dict, names: list[str]) -> dict:
    """Every case in ``names`` on encrypted inputs: per case its opened result (or the error it
    raised) and its seconds; bytes and rounds are the session meter's steps. After an error the
    remaining cases are not run: a party that failed may have left the other mid-exchange."""
    encrypted: dict = {}
    out = {}
    failed = None
    for name in names:
        if failed is not None:
            out[name] = {"error": f"not run: {failed} failed before it", "seconds": 0.0}
            continue
        secure, _, arg_names = CASES[name]
        t0 = time.perf_counter()
        try:
            args = [_secure_arg(n, data, encrypted) for n in arg_names]
            t0 = time.perf_counter()
            with party.meter(name):
                value = _open(secure(*args))
            out[name] = {"value": value, "seconds": time.perf_counter() - t0}
        except Exception as exc:  # noqa: BLE001 - reported per case by the test
            out[name] = {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0}
            failed = name
    return out


def divide_ring(party, share0: np.ndarray, share1: np.ndarray, divisor, precision: int = 0):
    """Open x / divisor for a ring sharing (CrypTen's ``div`` at the given precision, so at 0 the
    ring integers themselves are divided); returns the opened ring integers and the step's
    meter."""
    mine = share0 if party.rank == 0 else share1
    x = crypten.mpc.MPCTensor.from_shares(torch.from_numpy(np.ascontiguousarray(mine)), precision=precision)
    d = torch.as_tensor(divisor) if isinstance(divisor, np.ndarray) else divisor
    with party.meter("div"):
        key = party.metering.open_steps()[-1]
        q = x.div(d)
    opened = q.reveal().numpy().copy() if q.share.numel() else np.zeros(q.share.shape, np.int64)
    return opened, party.meters()["steps"][key]
