"""A long-lived pair of parties: many two-party calls on one session, without new processes.

Why: ``run_parties`` starts a dealer and two party processes and performs a TLS handshake
per call (about a second). Property-based tests and interactive exploration run hundreds of
small two-party computations; with :class:`PartyPair` they share one session, and each call
costs only its own protocol rounds.

    with PartyPair() as pair:
        v0, v1 = pair.call(program, *args)       # program(party, *args) in both processes

``program`` must be importable by the party processes (a module-level function). Both parties
run the calls in the same order. If a call raises in a party, the pair is closed (the other
party may be stuck waiting for a message) and the error is raised as :class:`PartyError`; the
next :meth:`call` starts a fresh session. Each call is metered as one step, returned by
:meth:`call_metered`. ``run_parties`` bounds a session's life at four times its ``timeout``, so
a pair older than ``max_age`` (default twice the timeout) starts a fresh session before its next
call: a pair may be kept as long as its user likes.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from .launcher import PartyError, PartyResults, mp_context, run_parties

__all__ = ["PartyPair"]

_STOP = "stop"


def _serve(party: Any, inbox: Any, outbox: Any) -> int:
    """Party side: run each (fn, args) from ``inbox`` and put (status, payload) in ``outbox``."""
    served = 0
    while True:
        item = inbox.get()
        if item == _STOP:
            return served
        fn, args, kwargs = pickle.loads(item)
        try:
            before = set(party.meters()["steps"])
            with party.meter(f"call-{served}"):
                value = fn(party, *args, **kwargs)
            steps = party.meters()["steps"]
            # the steps the program metered itself (nested under this call's step), so a test on
            # a shared session reads the same per-step figures as on its own ``run_parties`` session
            prefix = f"call-{served}/"
            step = dict(steps[f"call-{served}"],
                        steps={k[len(prefix):]: v for k, v in steps.items()
                               if k.startswith(prefix) and k not in before})
            outbox.put(("ok", pickle.dumps((value, step))))
        except BaseException:  # noqa: BLE001 - reported to the caller, then this party stops
            outbox.put(("error", traceback.format_exc()))
            return served
        served += 1


class PartyPair:
    """Two parties (and a dealer) kept alive across calls; see the module docstring."""

    def __init__(self, *, timeout: float = 120.0, max_age: float | None = None, **options: Any) -> None:
        """``options``: ``run_parties``' keywords (``offline=``, ``insecure_tfp=``, ``link=``, ...);
        ``max_age``: seconds after which the next call starts a fresh session (< 4 x timeout)."""
        self.timeout = timeout
        self.max_age = 2 * timeout if max_age is None else max_age
        if not 0 < self.max_age < 4 * timeout:
            raise ValueError(f"max_age must be in (0, 4 x timeout = {4 * timeout:.0f}) s, got {self.max_age}")
        self.options = options
        self._started = 0.0
        self._thread: threading.Thread | None = None
        self._boxes: tuple[Any, Any, Any, Any] | None = None
        self._outcome: list[PartyResults | BaseException] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        ctx = mp_context()
        in0, in1, out0, out1 = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
        self._boxes = (in0, in1, out0, out1)
        self._outcome = []
        self._started = time.monotonic()

        def run() -> None:
            try:
                self._outcome.append(run_parties(
                    _serve, timeout=self.timeout,
                    party_args=((in0, out0), (in1, out1)), **self.options))
            except BaseException as exc:  # noqa: BLE001 - kept for the caller
                self._outcome.append(exc)

        self._thread = threading.Thread(target=run, name="party-pair", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._boxes is None:
            return
        in0, in1, _, _ = self._boxes
        for box in (in0, in1):
            box.put(_STOP)
        if self._thread is not None:
            self._thread.join(self.timeout)
        self._boxes = None
        self._thread = None

    def __enter__(self) -> PartyPair:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ calls
    def call_metered(self, fn: Callable, *args: Any, **kwargs: Any) -> tuple[list[Any], list[dict]]:
        """Both parties' values and both meters of this call (online/offline bytes, rounds; under
        ``"steps"`` the steps the program metered for the first time in this call)."""
        if self._boxes is not None and time.monotonic() - self._started > self.max_age:
            self.close()
        if self._boxes is None:
            self.start()
        in0, in1, out0, out1 = self._boxes
        blob = pickle.dumps((fn, args, kwargs))
        in0.put(blob)
        in1.put(blob)
        answers = []
        for box in (out0, out1):
            try:
                answers.append(box.get(timeout=self.timeout * 4))
            except queue.Empty:
                answers.append(("error", "no answer in time (the session died?)"))
        errors = {r: payload for r, (status, payload) in enumerate(answers) if status != "ok"}
        if errors:
            self._abandon()
            first = min(errors)
            raise PartyError(f"party {first} failed: {errors[first].strip().splitlines()[-1]}", errors)
        decoded = [pickle.loads(payload) for _, payload in answers]
        return [d[0] for d in decoded], [d[1] for d in decoded]

    def call(self, fn: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(party, *args, **kwargs)`` as both parties; returns [value of 0, value of 1]."""
        return self.call_metered(fn, *args, **kwargs)[0]

    def _abandon(self) -> None:
        """After a failed call: stop what is left (the healthy party may wait on its peer)."""
        if self._boxes is not None:
            for box in self._boxes[:2]:
                box.put(_STOP)
        if self._thread is not None:
            self._thread.join(self.timeout * 4 + 10)
        self._boxes = None
        self._thread = None
