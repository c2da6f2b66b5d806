"""The only module that touches CrypTen internals.

Why it exists: CrypTen 0.4.1 predates torch 2.13. ``import crypten`` imports
``crypten.nn.onnx_converter``, which needs the ``onnx`` package and
``torch.onnx._internal.registration`` (removed from torch). We never convert ONNX
models (the servers compute on shares, not on CrypTen models), so instead of
installing ``onnx`` and faking torch internals we register a stand-in converter module
whose functions raise a clear error. ``tests/mpc/test_crypten_compat.py`` fails as soon as
plain ``import crypten`` starts to work (shim no longer needed) or the shim stops
making it work.

CrypTen 0.4.1 also decodes negative fixed-point values wrongly: its
``FixedPointEncoder.decode`` floor-divides negatives by ``scale - 1``, so e.g. the ring
element of -3966.977 decodes to -3967.976 (about 5% of products of N(0, 100^2) inputs
are off by one whole unit). ``_decode_fixed`` replaces it; the test keeps a known-bad
value so the patch is dropped once CrypTen fixes the bug.

Every other seam into CrypTen (installing our communicator, registering our
correlated-randomness provider, seeding its generators) is here too, so an upgrade of
CrypTen has one file to review.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

_STUB_NAME = "crypten.nn.onnx_converter"


def _onnx_unavailable(*_args: Any, **_kwargs: Any) -> None:
    raise NotImplementedError(
        "CrypTen's ONNX model conversion is disabled in this project: CrypTen 0.4.1's "
        "converter does not work with torch 2.13, and Starfish does not need it."
    )


def _install_onnx_stub() -> None:
    if _STUB_NAME in sys.modules:
        return
    stub = types.ModuleType(_STUB_NAME)
    stub.__doc__ = "Stand-in installed by mpc.crypten_compat; see its docstring."
    stub.from_onnx = _onnx_unavailable
    stub.from_pytorch = _onnx_unavailable
    stub.from_tensorflow = _onnx_unavailable
    stub.TF_AND_TF2ONNX = False
    sys.modules[_STUB_NAME] = stub


_install_onnx_stub()  # before ``import crypten``: it imports crypten.nn.onnx_converter

import crypten  # noqa: E402
import crypten.communicator as _comm_pkg  # noqa: E402
import crypten.mpc as _crypten_mpc  # noqa: E402
from crypten.common import serial as _serial  # noqa: E402
from crypten.communicator import Communicator as CommunicatorBase  # noqa: E402
from crypten.config import cfg  # noqa: E402
from crypten.mpc.primitives import ArithmeticSharedTensor, BinarySharedTensor  # noqa: E402
from crypten.mpc.provider.provider import TupleProvider as TupleProviderBase  # noqa: E402
from crypten.mpc.provider.tfp_provider import TrustedFirstParty  # noqa: E402

__all__ = [
    "crypten",
    "cfg",
    "CommunicatorBase",
    "TupleProviderBase",
    "TrustedFirstParty",
    "ArithmeticSharedTensor",
    "BinarySharedTensor",
    "install_communicator",
    "register_provider",
    "use_provider",
    "seed_generators",
    "restricted_loads",
    "observe_truncations",
    "replace_local_truncation",
]

from crypten.encoder import FixedPointEncoder  # noqa: E402

_original_decode = FixedPointEncoder.decode


def _decode_fixed(self, tensor):
    """Floor-split into integer and fraction parts (correct sign handling).

    The result is float32, like CrypTen's API; decode with ``common.encoding.decode`` (float64)
    when the last bits matter (e.g. 30000 - 2^-16 rounds to 30000 in float32).
    """
    if tensor is None:
        return None
    if self._scale <= 1:
        return _original_decode(self, tensor)
    integer = tensor.div(self._scale, rounding_mode="floor")
    fraction = tensor - integer * self._scale
    return (integer.float() + fraction.float() / self._scale).data


FixedPointEncoder.decode = _decode_fixed

# CrypTen wraps every attribute access of an MPCTensor in a check of
# ``cfg.debug.validation_mode``, which goes through OmegaConf each time and costs about half
# the CPU time of small operations (a 64-entry sort: 1.44 s -> 0.44 s without it). This
# project never uses CrypTen's validation mode, so the check reads a constant instead.
import crypten.debug as _crypten_debug  # noqa: E402

_crypten_debug.cfg = types.SimpleNamespace(
    debug=types.SimpleNamespace(validation_mode=False, debug_mode=False)
)

# CrypTen's module-level provider table; name is not mangled at module level.
_PROVIDERS: dict = getattr(_crypten_mpc, "__SUPPORTED_PROVIDERS")


def install_communicator(cls: type) -> None:
    """Make ``crypten.communicator.get()`` return ``cls.get()``.

    ``crypten.communicator.get`` looks up the name ``DistributedCommunicator`` in its
    module globals at call time, so rebinding it is enough; we never call
    ``crypten.init()`` and so never start torch.distributed.
    """
    _comm_pkg.DistributedCommunicator = cls
    # crypten.communicator keeps a module flag choosing its in-process communicator.
    setattr(_comm_pkg, "__use_threads", False)


def register_provider(name: str, provider: Any) -> None:
    _PROVIDERS[name] = provider


def use_provider(name: str) -> None:
    if name not in _PROVIDERS:
        raise KeyError(f"unknown CrypTen tuple provider {name!r}; known: {sorted(_PROVIDERS)}")
    cfg.mpc.provider = name


def seed_generators() -> None:
    """Seed CrypTen's torch generators through the installed communicator.

    CrypTen draws the seeds from ``os.urandom`` and exchanges them with the peer. In
    two-party computation both parties know both pairwise seeds, so CrypTen's
    pseudo-random zero sharings (PRZS) are known to both servers and hide nothing; a
    value shared with ``src=i`` is security-equivalent to a trivial sharing (x, 0).
    Nothing in this project relies on those generators for secrecy: secret-hiding
    randomness comes from clients' CSPRNG shares and the dealer's AES-CTR streams.
    """
    crypten._setup_prng()


def restricted_loads(buf: bytes) -> Any:
    """Unpickle a peer's object with CrypTen's allow-list unpickler (no arbitrary code)."""
    return _serial.restricted_loads(buf)


# ------------------------------------------------------------------ two-party truncation
# CrypTen divides a sharing by a public integer by dividing each party's share locally
# (``ArithmeticSharedTensor.div_``): wrong by about 2**64 / divisor with probability about
# |x| / 2**64 per element. ``replace_local_truncation`` routes powers of two (every fixed-point
# product ends with one) to a protocol that cannot wrap (``mpc.truncation``), and every other
# integer divisor (CrypTen's ``mean``, ``var``, ``avg_pool2d``, ``log``) to three such truncations
# (``mpc.public_division``). ``observe_truncations`` (audit only) sees the local ones that remain.
from .public_division import divide_share as _divide_share  # noqa: E402

_ORIGINAL_DIV = ArithmeticSharedTensor.div_
_wrapfree_truncation: Any = None
_truncation_observers: list = []


def _integer_divisor(y: Any) -> Any:
    if isinstance(y, float) and int(y) == y:
        return int(y)
    if torch.is_tensor(y) and y.is_floating_point() and y.frac().eq(0).all():
        return y.long()
    return y


def _power_of_two_exponents(d: Any) -> Any:
    """log2 of a positive power-of-two divisor (int or int tensor), else None."""
    t = torch.as_tensor(d)
    if bool((t <= 0).any()) or bool(((t & (t - 1)) != 0).any()):
        return None
    return torch.log2(t.double()).round().long()


def _divide_wrapfree(share: torch.Tensor, d: Any) -> torch.Tensor:
    """Share of x / d for a public int (or int tensor) d that is not all powers of two.

    A tensor divisor is broadcast to the share and divided value by value (the divisor is
    public, so its distinct values are too): three truncations per distinct value.
    """
    if not torch.is_tensor(d) or d.dim() == 0:
        return _divide_share(share, int(d), _wrapfree_truncation)
    divisors = d.expand(share.shape)
    out = torch.empty_like(share)
    for n in torch.unique(divisors).tolist():
        where = divisors == n
        out[where] = _divide_share(share[where], int(n), _wrapfree_truncation)
    return out


def _div_(self: Any, y: Any) -> Any:
    d = _integer_divisor(y)
    integer = isinstance(d, int) or (torch.is_tensor(d) and not d.is_floating_point())
    if integer and crypten.communicator.get().get_world_size() == 2:
        if _wrapfree_truncation is not None:
            exps = _power_of_two_exponents(d)
            if exps is None:
                self.share = _divide_wrapfree(self.share, d)
            elif exps.dim() or int(exps):
                self.share = _wrapfree_truncation(self.share, exps if exps.dim() else int(exps))
            return self
        for observe in _truncation_observers:
            observe(crypten.communicator.get().all_reduce(self.share.clone()), d)
    return _ORIGINAL_DIV(self, y)


ArithmeticSharedTensor.div_ = _div_


# ------------------------------------------------------------------ comparisons, two-party mode
# Every CrypTen comparison (ge, lt, sign, relu, abs, max, ...) ends in ``MPCTensor._ltz``, a
# binary circuit fed by binary triples and B2A randomness. The two-party mode makes neither
# (``mpc.two_party_provider``): its provider offers the whole sign test instead, and ``_ltz`` is
# routed to it whenever the active provider has one. Other providers keep CrypTen's circuit.
_ORIGINAL_LTZ = _crypten_mpc.MPCTensor._ltz


def _ltz(self: Any) -> Any:
    direct = getattr(crypten.mpc.get_default_provider(), "nonnegative_share", None)
    if direct is None:
        return _ORIGINAL_LTZ(self)
    ge = direct(self.share)
    below = (1 - ge) if crypten.communicator.get().get_rank() == 0 else -ge
    return _crypten_mpc.MPCTensor.from_shares(below, precision=0)


# CrypTen's two-party equality (``eq``, ``ne``; inside ``max``/``argmax`` along a dimension,
# ``max_pool2d``, ``softmax``) compares the two parties' shares as bit strings, another binary
# circuit. With a sign test at hand: [z == 0] = [z >= 0] + [-z >= 0] - 1, both tests in one call
# (exact for every z but -2**63, whose negation is itself; CrypTen's values stay below 2**62).
_ORIGINAL_EQZ = _crypten_mpc.MPCTensor._eqz_2PC


def _eqz_2PC(self: Any) -> Any:
    direct = getattr(crypten.mpc.get_default_provider(), "nonnegative_share", None)
    if direct is None:
        return _ORIGINAL_EQZ(self)
    both = direct(torch.stack([self.share, -self.share]))
    equal = both[0] + both[1]
    if crypten.communicator.get().get_rank() == 0:
        equal = equal - 1
    return _crypten_mpc.MPCTensor.from_shares(equal, precision=0)


_crypten_mpc.MPCTensor._eqz_2PC = _eqz_2PC


_crypten_mpc.MPCTensor._ltz = _ltz

# ------------------------------------------------------------------ products, two-party mode
# A Beaver product opens both operands masked (x - a, y - b) after the triple (a, b, ab) was
# made. Where the provider can compute the product of two sharings directly (two-party mode:
# the engine's HE product), making the triple costs the same as the product itself, so the
# Beaver step is skipped: no openings at all. ``direct_product(op, x_share, y_share, *args,
# **kwargs)`` returns this party's share of ``op(x, y)`` in the ring (convolutions with torch's
# arguments, ``mpc.ring_conv``); other providers keep CrypTen's Beaver.
from crypten.mpc.primitives import beaver as _beaver  # noqa: E402

_PRODUCTS = ("mul", "matmul", "square", "conv1d", "conv2d", "conv_transpose1d", "conv_transpose2d")
_ORIGINAL_BEAVER = {name: getattr(_beaver, name) for name in _PRODUCTS}


def _direct_or_beaver(name: str) -> Any:
    def product(x: Any, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        direct = getattr(crypten.mpc.get_default_provider(), "direct_product", None)
        if direct is None:
            if name == "square":
                return _ORIGINAL_BEAVER[name](x)
            return _ORIGINAL_BEAVER[name](x, y, *args, **kwargs)
        if name == "square":
            share = direct("mul", x.share, x.share)
        else:
            share = direct(name, x.share, y.share, *args, **kwargs)
        return ArithmeticSharedTensor.from_shares(share, precision=0)
    product.__name__ = name
    return product


for _name in _PRODUCTS:
    setattr(_beaver, _name, _direct_or_beaver(_name))


def replace_local_truncation(fn: Any) -> None:
    """Every later two-party ``div_`` by a power of two 2**d runs ``fn(share, d)``, and by any
    other integer three such calls (``mpc.public_division``); None restores CrypTen's local one."""
    global _wrapfree_truncation
    _wrapfree_truncation = fn


@contextlib.contextmanager
def observe_truncations(callback: Any) -> Iterator[None]:
    """Audit only: ``callback(ring_values, divisor)`` before every *local* two-party truncation.

    To measure the wrap risk the hook *opens* x (an extra exchange of the shares, so it reveals
    the values: never inside a deployment). Local truncations happen only while no wrap-free
    truncation is installed (``mpc.truncation``); both parties must run the same code.
    """
    _truncation_observers.append(callback)
    try:
        yield
    finally:
        _truncation_observers.remove(callback)
