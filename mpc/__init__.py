"""The 2PC runtime on CrypTen and the share-level protocols.

The runtime: a party session between the two servers (``session``: ``open_party``; ``launcher``:
``run_parties``), CrypTen's communicator and the correlated-randomness providers
(``dealer_provider``; the dealer-free ``two_party_provider`` over the SPU engine,
``spu_engine``/``spu_process``). The share-level protocols: the sign test (``nonnegative``),
wrap-free and exact truncation, table comparisons. Only servers, the dealer and benchmarks import
this package; clients never do (they stand on ``common`` and ``net``; tests/test_architecture.py).

This file imports nothing: the two-party engine runs in a spawned process that imports
``mpc.spu_process``, hence this file, and needs neither torch nor CrypTen (importing them would
cost every engine start 1.8 s of CPU; ``tests/mpc/test_engine_imports.py`` keeps it so). Import
what you use from its module: ``from mpc.launcher import run_parties``.
"""
