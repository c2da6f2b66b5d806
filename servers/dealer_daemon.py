"""``starfish dealer``: the correlated-randomness daemon at the config's address.

Why a separate process: the dealer is the third non-colluding party (docs/design.md 4.3). It
receives no data, only the request sizes of each 2PC session, and serves any number of
sessions (one per unlearning job) with ``mpc.dealer.DealerServer``; only certificates
``server0``/``server1`` of the deployment's CA are accepted, each for its own rank. Anyone
else costs at most a few seconds of one of a few handshake slots (``mpc.dealer.DEALER_CAPS``,
``limits.handshake_timeout``); see docs/service.md, "Limits and abuse".
"""

from __future__ import annotations

import logging
import threading

from net import tls
from mpc.dealer import DealerServer

from common.service_config import ServiceConfig

__all__ = ["run_dealer"]

log = logging.getLogger("starfish.dealer")


def run_dealer(cfg: ServiceConfig, stop: threading.Event) -> None:
    """Serve until ``stop`` is set (refuses a key directory holding the CA key)."""
    for problem in tls.check_key_dir(cfg.keys_dir):   # raises tls.KeyDirError if ca.key is there
        log.warning("%s", problem)
    lim = cfg.limits
    server = DealerServer(tls.identity(cfg.keys_dir, tls.DEALER_NAME), host=cfg.dealer.host,
                          port=cfg.dealer.port, timeout=cfg.dealer.timeout,
                          max_frame=lim.max_frame_bytes, handshake_timeout=lim.handshake_timeout,
                          max_buffered=lim.max_buffered_bytes,
                          max_buffered_per_identity=lim.max_buffered_per_identity)
    t = threading.Thread(target=server.serve_forever, name="dealer", daemon=True)
    t.start()
    log.info("dealer ready on %s:%d", *server.address)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
        t.join(5)
