"""The 2PC runtime on CrypTen and the share-level protocols.

The runtime: a party session between the two servers (``session``, ``launcher``), CrypTen's
communicator and the correlated-randomness providers (``dealer_provider``; the dealer-free
``two_party_provider`` over the SPU engine, ``spu_engine``/``spu_process``). The share-level
protocols: the sign test (``nonnegative``), wrap-free and exact truncation, table comparisons.
Only servers, the dealer and benchmarks import this package; clients never do (they stand on
``common`` and ``net``), so importing CrypTen here eagerly costs a client nothing.
"""

from __future__ import annotations

from net.link import LinkProfile
from net.metering import meter

from .launcher import PartyError, PartyResults, run_parties
from .session import open_party

__all__ = ["run_parties", "open_party", "meter", "LinkProfile", "PartyResults", "PartyError"]
