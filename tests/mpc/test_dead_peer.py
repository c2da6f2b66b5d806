"""A dead peer is noticed in seconds by a party that is not receiving (``Party.peer_alive``).

The party programs live here (module level, so the party processes import them by name).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from net import channel as chmod
from net import tls
from net.channel import KIND_OBJECT, Channel
from mpc.launcher import PartyError, ephemeral_keys, mp_context, run_parties
from common.offline_mode import OfflineMode
from mpc.session import Party

POLL = 0.01


def _wait_dead(party, limit=10.0) -> float:
    t0 = time.monotonic()
    while party.peer_alive() and time.monotonic() - t0 < limit:
        time.sleep(POLL)
    return time.monotonic() - t0


def kill_peer_and_watch(party, out):
    """Party 1 tells its pid and idles; party 0 SIGKILLs it while polling ``peer_alive``."""
    if party.rank == 1:
        party.channel.send_frame(KIND_OBJECT, str(os.getpid()).encode())
        time.sleep(60)  # killed long before
        return None
    pid = int(bytes(party.channel.recv_frame(KIND_OBJECT)))
    before = party.peer_alive()
    os.kill(pid, signal.SIGKILL)
    out.put((before, _wait_dead(party), party.peer_alive()))
    return "watched"


def watch_dealer(party, out):
    """Party 1 polls ``peer_alive`` while the test kills the dealer; party 0 waits for it."""
    if party.rank == 0:
        # party 0's own set-up with the dealer is over once its program runs; say so before the
        # kill (a loaded CI machine killed the dealer while party 0 was still being set up)
        party.channel.send_frame(KIND_OBJECT, b"set up")
        party.channel.recv_frame(KIND_OBJECT)
        alive = party.peer_alive()  # the dealer is not party 0's concern after setup
        # party 1 waits for this before it returns (and its process closes the channel): a
        # loaded machine once ran party 1's exit before party 0's check
        party.channel.send_frame(KIND_OBJECT, b"checked")
        return alive
    party.channel.recv_frame(KIND_OBJECT)
    before = party.peer_alive()
    out.put(("ready", before))
    waited = _wait_dead(party)
    out.put(("dead", waited))
    party.channel.send_frame(KIND_OBJECT, b"done")
    party.channel.recv_frame(KIND_OBJECT)
    return waited


def test_a_killed_peer_is_noticed_within_two_seconds():
    out = mp_context().Queue()
    with pytest.raises(PartyError) as info:  # party 1 was killed, so the run reports it
        run_parties(kill_peer_and_watch, party_args=((out,), (None,)), timeout=30)
    assert "exited with code" in info.value.errors[1]
    assert 0 not in info.value.errors  # party 0 finished its watch normally
    before, waited, after = out.get(timeout=5)
    assert before is True and after is False
    assert waited < 2.0, waited


def test_party_1_notices_a_killed_dealer():
    out = mp_context().Queue()
    outcome = {}
    kept = {p.pid for p in mp.active_children()}   # a shared session's dealer (tests/conftest.py)

    def run():
        try:
            outcome["res"] = run_parties(watch_dealer, party_args=((None,), (out,)), timeout=30)
        except Exception as exc:  # noqa: BLE001
            outcome["res"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    tag, before = out.get(timeout=30)
    assert (tag, before) == ("ready", True)
    dealers = [p for p in mp.active_children() if p.name == "dealer" and p.pid not in kept]
    assert len(dealers) == 1
    os.kill(dealers[0].pid, signal.SIGKILL)
    tag, waited = out.get(timeout=15)
    t.join(30)
    assert tag == "dead" and waited < 2.0, waited
    res = outcome["res"]
    assert not isinstance(res, Exception), res
    assert res.values == [True, waited]


def test_peer_closed_turns_when_the_other_end_goes_and_only_then():
    keys = ephemeral_keys()
    listener = chmod.listen()
    got: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: got.put(Channel.accept(
        listener, tls.server_context(tls.identity(keys, "server1")), "server0", timeout=10)), daemon=True).start()
    ch0 = Channel.connect(listener.getsockname(), tls.client_context(tls.identity(keys, "server0")), "server1",
                          timeout=10)
    ch1 = got.get(timeout=10)
    time.sleep(0.1)
    assert not ch0.peer_closed and not ch1.peer_closed
    ch1.close()
    t0 = time.monotonic()
    while not ch0.peer_closed and time.monotonic() - t0 < 2:
        time.sleep(POLL)
    assert ch0.peer_closed
    with pytest.raises(chmod.PeerDisconnected):
        ch0.recv_frame(KIND_OBJECT)
    ch0.close()
    listener.close()


def test_peer_alive_watches_the_dealer_only_where_it_stays_connected():
    def party(rank, peer_gone=False, dealer_gone=False):
        dealer = SimpleNamespace(channel=SimpleNamespace(peer_closed=dealer_gone))
        return Party(rank, SimpleNamespace(peer_closed=peer_gone), None, OfflineMode.DEALER, dealer)

    assert party(0).peer_alive() and party(1).peer_alive()
    assert not party(0, peer_gone=True).peer_alive() and not party(1, peer_gone=True).peer_alive()
    assert not party(1, dealer_gone=True).peer_alive()
    assert party(0, dealer_gone=True).peer_alive()  # the dealer hangs up on party 0 after the seed
    assert Party(1, SimpleNamespace(peer_closed=False), None, None).peer_alive()  # TFP: no dealer at all
