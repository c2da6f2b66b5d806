"""The 2PC runtime on CrypTen and the share-level protocols.

The runtime: a party session between the two servers (``session``, ``launcher``), CrypTen's
communicator and the correlated-randomness providers (``dealer_provider``; the dealer-free
``two_party_provider`` over the SPU engine, ``spu_engine``/``spu_process``). The share-level
protocols: the sign test (``nonnegative``), wrap-free and exact truncation, table comparisons.
Only servers, the dealer and benchmarks import this package; clients never do (they stand on
``common`` and ``net``).

Why ``run_parties`` and ``open_party`` are looked up on first use (PEP 562) rather than imported
here: the two-party engine runs in a spawned process that imports ``mpc.spu_process``, hence this
file, and needs neither torch nor CrypTen. Importing them eagerly cost every engine start 1.8 s
of CPU (measured with ``python -X importtime -c "import mpc.spu_process"``), paid by each
session and each daemon. ``tests/mpc/test_engine_imports.py`` keeps it so.
"""

from __future__ import annotations

from importlib import import_module

from net.link import LinkProfile
from net.metering import meter

__all__ = ["run_parties", "open_party", "meter", "LinkProfile", "PartyResults", "PartyError"]

_LAZY = {"run_parties": "launcher", "PartyResults": "launcher", "PartyError": "launcher",
         "open_party": "session"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
