"""The transport floor: mutually authenticated TLS 1.3 channels between named parties.

Certificates and revocation (``tls``, ``ca``), framing under a buffer budget (``frames``),
bounded accept loops and per-identity admission (``listening``, ``admission``), the channel
with metering and link emulation (``channel``, ``metering``, ``link``, ``inbox``), and how a
session finds its peer by ticket (``peer_accept``). Numpy, ``cryptography`` and the standard
library only: clients, servers, the dealer and the 2PC runtime all stand on it, and it imports
nothing of ours above it.
"""
