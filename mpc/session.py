"""A two-party CrypTen session: TLS peer link, dealer link, communicator and provider.

``open_party`` is what a server process (or a test party) calls to become party 0 or 1.
CrypTen's ``crypten.init()`` is never called: it would start torch.distributed (gloo,
no TLS). Instead we install our communicator and provider through ``crypten_compat``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

import numpy as np
import torch

from . import crypten_compat as cc
from net import metering, tls
from net.channel import KIND_OBJECT, NO_LINK, Channel, LinkProfile
from .communicator import TwoPartyCommunicator
from .dealer import DealerLink
from .dealer_provider import NAME as DEALER, DealerProvider
from common.encoding import DEFAULT_PRECISION
from common.offline_mode import OfflineMode
from net.peer_accept import accept_peer, check_ticket, connect_peer
from .tfp import TestOnlyTFP
from .truncation import truncate_share
from .two_party_provider import NAME as TWO_PARTY, TwoPartyProvider

TFP = "TFP"
#: the CrypTen provider that makes each mode's correlations (TFP: ``insecure_tfp``, tests only)
_PROVIDERS = {OfflineMode.DEALER: DEALER, OfflineMode.TWO_PARTY: TWO_PARTY}
_provider = DealerProvider()
_two_party = TwoPartyProvider()
cc.register_provider(DEALER, _provider)
cc.register_provider(TWO_PARTY, _two_party)
cc.register_provider(TFP, TestOnlyTFP())  # CrypTen's TFP plus edabits; still refused by default


def session_source(cfg) -> dict:
    """``open_party`` keywords for a deployment's ``offline`` mode (``common.service_config``): the
    mode, and in dealer mode the dealer's address; in two-party mode this process's engine pool
    (a daemon's sessions share one engine per peer, ``shared_engine_pool``)."""
    if cfg.offline is OfflineMode.TWO_PARTY:
        return {"offline": OfflineMode.TWO_PARTY, "engine_pool": shared_engine_pool()}
    return {"offline": OfflineMode.DEALER, "dealer_address": cfg.dealer.endpoint().address}


_engine_pool = None


def shared_engine_pool():
    """The process's two-party engine pool (``mpc.engine_pool.EnginePool``), made on first use and
    closed when the process exits. Why process-wide: a server daemon runs its 2PC sessions one
    after another (FL rounds' range checks, robust aggregation, unlearning jobs), and an engine
    start (about 10 s: jax and SPU imports, TLS, CHEETAH's OT set-up) would otherwise be paid by
    every one of them."""
    global _engine_pool
    if _engine_pool is None:
        import multiprocessing.util

        from .engine_pool import EnginePool  # imports nothing of SPU: the engine process does

        _engine_pool = EnginePool()
        # closed by multiprocessing's exit function before it joins this process's children, the
        # engines among them: that function runs at a main process's exit (atexit) and at the end
        # of a multiprocessing child, which skips atexit (an atexit-only close left a benchmark's
        # coordinators joining their engines forever, until their parent killed them)
        multiprocessing.util.Finalize(None, _engine_pool.close, exitpriority=100)
    return _engine_pool


@dataclass
class Party:
    """Handle passed to two-party programs: rank, metering, and share helpers."""

    rank: int
    channel: Channel
    metering: metering.Meter
    #: where this session's correlations come from; None: the test-only TFP (party 0 makes them)
    offline: OfflineMode | None
    dealer: DealerLink | None = None
    extras: dict = field(default_factory=dict)
    engine: object | None = None   # the two-party engine (``mpc.spu_engine``) in two-party mode

    def meter(self, name: str):
        """``with party.meter("TD"): ...`` attributes traffic and time to step ``name``."""
        return self.metering.step(name)

    def meters(self) -> dict:
        return self.metering.as_dict()

    def peer_alive(self) -> bool:
        """False once the other server's connection, or party 1's dealer connection, is gone
        (a killed process's sockets are closed by its kernel, so this turns within moments).
        Cheap; meant to be polled while waiting on something else, e.g. clients. Party 0's
        dealer connection is not watched: the dealer hangs up once it has handed out seed 0."""
        if self.channel.peer_closed:
            return False
        return not (self.rank == 1 and self.dealer is not None and self.dealer.channel.peer_closed)

    @property
    def recorded_plan(self) -> list[tuple]:
        return list(_provider.recorded) if self.offline is OfflineMode.DEALER else []

    def prefill(self, plan: list[tuple]) -> None:
        """Fetch the dealer material for ``plan`` now (offline phase), before computing."""
        if self.offline is not OfflineMode.DEALER:
            raise RuntimeError("prefill needs the dealer provider")
        _provider.prefill(plan)

    @property
    def served_ahead(self) -> int:
        """Dealer corrections this session took from the background fetch (``fetch_ahead``)."""
        return _provider.served_ahead if self.offline is OfflineMode.DEALER else 0

    def fetch_ahead(self, plan: list[tuple], budget_bytes: int = 256 << 20) -> None:
        """Have the dealer material of ``plan`` (a ``recorded_plan`` of an earlier run of the same
        program) fetched in the background while this session computes, at most
        ``budget_bytes`` held at once. Dealer mode only; elsewhere nothing to fetch (a no-op).
        A plan that turns out wrong costs nothing but the fetch: the rest is made on demand."""
        if self.offline is OfflineMode.DEALER:
            _provider.fetch_ahead(plan, budget_bytes)

    def wrap_share(self, share, precision: int = DEFAULT_PRECISION):
        """This party's ring share (numpy int64 or torch long) as a CrypTen MPCTensor."""
        if isinstance(share, np.ndarray):
            # np.ascontiguousarray would turn a 0-d share (a norm) into shape (1,)
            t = torch.from_numpy(np.array(share, dtype=np.int64, order="C", copy=True))
        else:
            t = share
        if t.dtype != torch.long:
            raise TypeError("a share must be int64 ring elements")
        return cc.crypten.mpc.MPCTensor.from_shares(t, precision=precision)

    def close(self) -> None:
        if self.dealer is not None:
            _provider.detach()
            self.dealer.close()
        if self.engine is not None:
            _two_party.detach()
            self.engine.close()
        self.channel.close()
        TwoPartyCommunicator.shutdown()
        metering.set_current(None)


def open_party(
    rank: int,
    keys_dir: str | os.PathLike,
    *,
    peer_listener: socket.socket | None = None,
    peer_address: tuple[str, int] | None = None,
    dealer_address: tuple[str, int] | None = None,
    offline: OfflineMode | str = OfflineMode.DEALER,
    insecure_tfp: bool = False,
    link: LinkProfile = NO_LINK,
    dealer_link: LinkProfile = NO_LINK,
    timeout: float = 120.0,
    truncation: str = "wrapfree",
    ticket: bytes | None = None,
    engine_pool=None,
    worker: int | None = None,
) -> Party:
    """Join a two-party session as ``rank``; party 1 accepts, party 0 connects.

    ``ticket`` names this session attempt (e.g. ``b"job:<id>:attempt:<n>"``; at most 1024 bytes):
    party 1 admits only a ``server0`` connection that presents the same ticket, and skips
    anything else reaching its listener (``net.peer_accept``). ``None`` is the empty ticket.
    Both sides try until ``timeout`` seconds have passed, which also bounds each later receive.

    ``truncation``: "wrapfree" (default: every fixed-point truncation uses a dealer truncation
    pair and cannot wrap, ``mpc.truncation``) or "local" (CrypTen's share division, which wraps
    with probability about |x| / 2**64 per element; kept for measuring that risk).

    ``offline``: where the correlations come from (``common.offline_mode``; a string is read as
    its mode). ``insecure_tfp``: make them with CrypTen's trusted-first-party provider instead,
    so that party 0 knows every triple: for unit tests only, no daemon sets it.

    ``engine_pool`` (two-party mode): borrow the engine from this ``mpc.engine_pool.EnginePool``
    (both parties must pass one; ``shared_engine_pool()`` in a daemon) instead of starting one for
    this session; ``Party.close`` gives it back.

    ``worker`` (a server run as a coordinator and workers, issue 30): join as worker ``k`` of
    server ``rank`` (certificate ``server<rank>-w<k>``) and accept only the other server's worker
    ``k`` as the peer (``net.tls.party_name``); the dealer, if any, hands this pair its own seeds.
    """
    mode = None if insecure_tfp else OfflineMode.of(offline)
    if truncation not in ("wrapfree", "local"):
        raise ValueError(f"truncation must be 'wrapfree' or 'local', not {truncation!r}")
    provider = TFP if mode is None else _PROVIDERS[mode]
    wire_ticket = check_ticket(ticket)
    ident = tls.identity(keys_dir, tls.party_name(rank, worker))
    peer = tls.party_name(1 - rank, worker)
    meter = metering.Meter()
    metering.set_current(meter)
    ch: Channel | None = None
    dch: Channel | None = None
    engine = None
    try:
        with meter.step("setup"):
            if rank == 1:
                if peer_listener is None:
                    raise ValueError("party 1 needs a listening socket")
                ch = accept_peer(peer_listener, tls.server_context(ident), peer, wire_ticket,
                                 kind="online", meter=meter, link=link, timeout=timeout)
            else:
                if peer_address is None:
                    raise ValueError("party 0 needs the address of party 1")
                ch = connect_peer(peer_address, tls.client_context(ident), peer, wire_ticket,
                                  kind="online", meter=meter, link=link, timeout=timeout)
            if rank == 0:
                session_id = os.urandom(16)
                ch.send_frame(KIND_OBJECT, session_id)
            else:
                session_id = bytes(ch.recv_frame(KIND_OBJECT, 16))

            TwoPartyCommunicator.instance = TwoPartyCommunicator(rank, ch)
            cc.install_communicator(TwoPartyCommunicator)
            cc.seed_generators()

            dealer = None
            if mode is OfflineMode.DEALER:
                if dealer_address is None:
                    raise ValueError("the dealer provider needs the dealer's address")
                dch = Channel.connect(dealer_address, tls.client_context(ident), tls.DEALER_NAME,
                                      kind="offline", meter=meter, link=dealer_link, timeout=timeout)
                dealer = DealerLink(dch, rank, session_id)
                _provider.attach(rank, dealer)
            if mode is OfflineMode.TWO_PARTY:
                from .spu_engine import SpuEngine  # its engine process imports jax and SPU

                if engine_pool is not None:
                    engine = engine_pool.engine(rank, ch, meter, link=link, timeout=timeout)
                else:
                    engine = SpuEngine(rank, ch, meter, link=link, timeout=timeout)
                _two_party.attach(engine)
            cc.use_provider(provider)
            cc.replace_local_truncation(truncate_share if truncation == "wrapfree" else None)
    except BaseException:
        # a half-open session would keep the peer waiting on a live socket until its timeout
        if engine is not None:
            engine.close()
        _two_party.detach()
        for c in (dch, ch):
            if c is not None:
                c.close()
        _provider.detach()
        TwoPartyCommunicator.shutdown()
        metering.set_current(None)
        raise
    return Party(rank, ch, meter, mode, dealer, {"session_id": session_id.hex()}, engine)
