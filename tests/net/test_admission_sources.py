"""The handshake pool's per-source policy against a plaintext model (issue 25, finding 7).

``net.admission`` keeps its pending handshakes in O(1) structures (``net.source_limits``); the
model here keeps plain lists and scans them, and says what the policy is:

* the pool never holds more than ``max_handshakes``; when it is full, the victim is the oldest
  handshake of the source holding the most (ties: the source that has held that many longest),
  among sources that never authenticated while any of theirs is pending; a known source's
  handshake goes only when no unknown one is left;
* an unknown source gets a thread (``offer_batch`` returns it) only with a token of its bucket
  (``rate`` a second, ``burst`` at once); the rest wait, at most ``max_handshakes`` of them, and
  are handed out newest first when a token comes (``take_waiting``), or closed: pushed out of
  the waiting room (the same victim rule) or at their deadline;
* a socket dropped before any thread had it is ``close()``d, one a thread has is ``shutdown()``;
* IPv6 addresses count per /64.

Hypothesis draws arrival sequences (sources, bursts, times, authentications, releases) and
compares every socket's fate, and what each call returns, with the model.
"""

from __future__ import annotations

import socket
import types
from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from net import admission as admission_mod
from net.admission import Admission, Refused
from net.source_limits import source_key

#: addresses as a peer reports them -> the source they count as
HOSTS = {"10.0.0.1": "10.0.0.1", "10.0.0.2": "10.0.0.2", "::ffff:10.0.0.3": "10.0.0.3",
         "2001:db8::1": "2001:db8::/64", "2001:db8::2:1": "2001:db8::/64"}
TIMEOUT = 5.0


class FakeSock:
    """What the pool touches of a socket: its peer, ``close`` and ``shutdown``."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.closed = False
        self.shut = False

    def getpeername(self):
        return (self.host, 40000, 0, 0) if ":" in self.host else (self.host, 40000)

    def close(self) -> None:
        self.closed = True

    def shutdown(self, how: int) -> None:
        self.shut = True


class Model:
    """The policy, said plainly (see the module docstring)."""

    def __init__(self, max_handshakes: int, rate: float, burst: int) -> None:
        self.max = max_handshakes
        self.rate, self.burst = rate, burst
        self.pending: list[list] = []     # [sock, key, deadline], in the order they were added
        self.waiting: list[list] = []
        self.known: set[str] = set()
        self.buckets: dict[str, tuple[float, float]] = {}
        self.seq = 0
        self.stamps: dict[tuple[str, str], int] = {}   # (room, key) -> when it reached its count
        self.fate: dict[FakeSock, str] = {}

    def _stamp(self, room: str, key: str) -> None:
        self.seq += 1
        self.stamps[(room, key)] = self.seq

    def allow(self, key: str, now: float) -> bool:
        if self.rate <= 0:
            return True
        tokens, at = self.buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        ok = tokens >= 1.0
        self.buckets[key] = (tokens - 1.0 if ok else tokens, now)
        return ok

    def victim(self, room: str, entries: list[list]) -> list:
        counts: dict[str, int] = {}
        for _, key, _ in entries:
            counts[key] = counts.get(key, 0) + 1
        unknown = [k for k in counts if room == "waiting" or k not in self.known]
        pool = unknown or list(counts)
        top = max(counts[k] for k in pool)
        key = min((k for k in pool if counts[k] == top), key=lambda k: self.stamps[(room, k)])
        return next(e for e in entries if e[1] == key)

    def remove(self, room: str, entries: list[list], entry: list) -> None:
        entries.remove(entry)
        if any(e[1] == entry[1] for e in entries):
            self._stamp(room, entry[1])       # it moved to a smaller count just now

    def add(self, room: str, entries: list[list], entry: list) -> None:
        entries.append(entry)
        self._stamp(room, entry[1])

    def admit_all(self, socks: list[list]) -> list[FakeSock]:
        fresh = []
        for entry in socks:
            fresh.append(entry[0])
            while len(self.pending) >= self.max:
                victim = self.victim("pending", self.pending)
                if victim[1] in self.known:     # stated on its own: known ones go last
                    assert all(k in self.known for _, k, _ in self.pending)
                self.remove("pending", self.pending, victim)
                if victim[0] in fresh:
                    fresh.remove(victim[0])
                    self.fate[victim[0]] = "closed"
                else:
                    self.fate[victim[0]] = "shut"
            self.add("pending", self.pending, entry)
            self.fate[entry[0]] = "pending"
        return fresh

    def offer_batch(self, socks: list[FakeSock], now: float) -> list[FakeSock]:
        admitted = []
        for s in socks:
            key = HOSTS[s.host]
            if key in self.known or self.allow(key, now):
                admitted.append([s, key, now + TIMEOUT])
                continue
            while len(self.waiting) >= self.max:
                victim = self.victim("waiting", self.waiting)
                self.remove("waiting", self.waiting, victim)
                self.fate[victim[0]] = "closed"
            self.add("waiting", self.waiting, [s, key, now + TIMEOUT])
            self.fate[s] = "waiting"
        return self.admit_all(admitted)

    def take_waiting(self, now: float) -> list[FakeSock]:
        ready = []
        for entry in reversed(list(self.waiting)):
            if entry[1] in self.known or self.allow(entry[1], now):
                ready.append(entry)
                self.remove("waiting", self.waiting, entry)
        return self.admit_all(ready)

    def expire(self, now: float) -> None:
        for entry in [e for e in self.pending if e[2] <= now]:
            self.remove("pending", self.pending, entry)
            self.fate[entry[0]] = "shut"
        for entry in [e for e in self.waiting if e[2] <= now]:
            self.remove("waiting", self.waiting, entry)
            self.fate[entry[0]] = "closed"

    def authenticate(self, s: FakeSock) -> None:
        key = HOSTS[s.host]
        if key not in self.known:
            self.known.add(key)
            if any(e[1] == key for e in self.pending):
                self._stamp("pending", key)   # its handshakes move to the known tier now
        entry = next(e for e in self.pending if e[0] is s)
        self.remove("pending", self.pending, entry)
        self.fate[s] = "done"

    def release(self, s: FakeSock) -> None:
        entry = next(e for e in self.pending if e[0] is s)
        self.remove("pending", self.pending, entry)
        self.fate[s] = "done"


def _observed(s: FakeSock, adm: Admission) -> str:
    if adm.pending(s):
        return "pending"
    if s.closed:
        return "closed"
    if s.shut:
        return "shut"
    return "waiting-or-done"


op = st.one_of(
    st.tuples(st.just("batch"), st.lists(st.sampled_from(sorted(HOSTS)), min_size=1, max_size=6)),
    st.tuples(st.just("offer"), st.sampled_from(sorted(HOSTS))),
    st.tuples(st.just("tick"), st.sampled_from([0.0, 0.01, 0.1, 0.4, 1.0, 6.0])),
    st.tuples(st.just("take"), st.none()),
    st.tuples(st.just("expire"), st.none()),
    st.tuples(st.just("auth"), st.integers(0, 50)),
    st.tuples(st.just("release"), st.integers(0, 50)),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_handshakes=st.integers(1, 5), rate=st.sampled_from([0.0, 2.0, 10.0]), burst=st.integers(1, 3),
       ops=st.lists(op, max_size=60))
def test_the_pool_follows_the_plaintext_policy(max_handshakes, rate, burst, ops):
    clock = [1000.0]
    fake_time = types.SimpleNamespace(monotonic=lambda: clock[0])
    with mock.patch.object(admission_mod, "time", fake_time):
        adm = Admission("test", max_handshakes=max_handshakes, handshake_timeout=TIMEOUT,
                        max_connections=1000, max_per_identity=1000, source_rate=rate, source_burst=burst)
        model = Model(max_handshakes, rate, burst)
        socks: list[FakeSock] = []
        for kind, arg in ops:
            now = clock[0]
            if kind == "batch":
                batch = [FakeSock(h) for h in arg]
                socks += batch
                assert adm.offer_batch(batch) == model.offer_batch(batch, now)
            elif kind == "offer":
                s = FakeSock(arg)
                socks.append(s)
                adm.offer(s)
                model.admit_all([[s, HOSTS[arg], now + TIMEOUT]])   # no rate: its thread starts anyway
            elif kind == "tick":
                clock[0] += arg
            elif kind == "take":
                assert adm.take_waiting()[0] == model.take_waiting(now)
            elif kind == "expire":
                adm.expire()
                model.expire(now)
            elif model.pending:
                s = model.pending[arg % len(model.pending)][0]
                if kind == "auth":
                    with adm.connection(s, "client-1"):
                        pass
                    model.authenticate(s)
                else:
                    adm.release(s)
                    model.release(s)
            counts = adm.counts()
            assert counts["handshakes"] == len(model.pending) <= max_handshakes
            assert counts["waiting"] == len(model.waiting) <= max_handshakes
            for s in socks:
                want = model.fate[s]
                got = _observed(s, adm)
                assert got == (want if want in ("pending", "closed", "shut") else "waiting-or-done"), \
                    (kind, s.host, want, got)


def test_a_handshake_that_outlived_its_slot_is_refused_but_its_address_becomes_known():
    adm = Admission("test", max_handshakes=1, handshake_timeout=TIMEOUT, source_rate=1.0, source_burst=1)
    a, b = FakeSock("10.0.0.1"), FakeSock("10.0.0.1")
    adm.offer_batch([a])
    adm.offer_batch([b])                # over the rate: parked, no thread
    assert adm.counts()["waiting"] == 1 and not b.closed
    adm.expire(now=10**9)               # a's deadline passes while its TLS finishes
    try:
        adm.connection(a, "client-1")
        raise AssertionError("a late handshake was admitted")
    except Refused as exc:
        assert exc.code == "handshake_timeout"
    assert b.closed                     # parked past its deadline: closed, never a thread
    c = FakeSock("10.0.0.1")
    assert adm.offer_batch([c]) == [c]  # known now: no rate applies to it any more


def test_sources_are_addresses_and_ipv6_counts_per_64():
    assert [source_key(FakeSock(h)) for h in HOSTS] == list(HOSTS.values())
    a, b = socket.socketpair()
    with a, b:
        assert source_key(a) == ""      # no IP peer: one source for all such sockets
