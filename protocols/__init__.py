"""Secure building blocks on CrypTen tensors, each with a plaintext twin behind the same call.

Pass torch tensors to run the plaintext twin, CrypTen MPCTensors to run the two-party protocol
(inside a party function started by :func:`mpc.launcher.run_parties`). See docs/protocols.md for the
rounds, bytes and leakage of every primitive.
"""

from .backend import is_shared
from .compare import compare_exchange, ge, ge_ratio, select
from .division import divide, reciprocal
from .inner_product import inner
from .inverse import inverse_masked, inverse_newton
from .maximum import max as secure_max
from .sort import bitonic_sort, ge_comparator, ratio_comparator, top_k
from .threshold import any_exceeds

__all__ = [
    "is_shared",
    "inner",
    "ge",
    "ge_ratio",
    "select",
    "compare_exchange",
    "bitonic_sort",
    "top_k",
    "ge_comparator",
    "ratio_comparator",
    "secure_max",
    "inverse_masked",
    "inverse_newton",
    "reciprocal",
    "divide",
    "any_exceeds",
]
