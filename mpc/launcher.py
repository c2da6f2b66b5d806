"""``run_parties``: run one function as party 0 and party 1 in two local processes.

Starts the dealer (a third process), both parties, connects them over loopback TLS
with an ephemeral CA (or the given key directory), runs ``fn(party, *args, **kwargs)``
in each, and returns both results and both meters. Used by tests, benchmarks and by
users who try the primitives in their own two-party programs.

Processes come from a fork server that has already imported torch and CrypTen, so a
run costs a fork, not a fresh interpreter (a spawn costs seconds per process).

Without ``keys_dir`` each run makes its own throw-away CA and certificates and deletes them
when it ends, however it ends: nothing else needs them, and private keys must not pile up in
the temporary directory (a test suite used to leave dozens of CAs behind).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from net import tls
from net.channel import NO_LINK, LinkProfile, listen
from .dealer import DealerServer
from common.offline_mode import OfflineMode

from .session import open_party

_KEYS_DIR: str | None = None
_KEYS_LOCK = threading.Lock()
#: seconds the parties get to close their sessions after reporting (the two-party engine meets its
#: peer at a barrier, then removes its session's key directory) before they are ended
_CLOSE_GRACE = 30.0


class PartyError(RuntimeError):
    """A party raised; carries both parties' outcomes."""

    def __init__(self, message: str, errors: dict[int, str]):
        super().__init__(message)
        self.errors = errors


@dataclass
class PartyResults:
    values: list[Any]
    meters: list[dict]
    plans: list[list[tuple]] = field(default_factory=list)
    seconds: float = 0.0


def _make_keys(keep_ca_key: bool) -> str:
    """A new private directory (0700, files 0600) with a CA and every certificate."""
    d = tempfile.mkdtemp(prefix="starfish-keys-")  # mkdtemp makes it 0700
    try:
        tls.init_keys(d)
        if not keep_ca_key:
            os.remove(os.path.join(d, "ca.key"))  # every certificate is issued: drop the power to mint more
        for name in os.listdir(d):
            os.chmod(os.path.join(d, name), 0o600)
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    return d


def _remove_keys(path: str, owner: int) -> None:
    if os.getpid() == owner:  # a forked child inherits atexit handlers, not the directory
        shutil.rmtree(path, ignore_errors=True)


def ephemeral_keys() -> str:
    """A CA (key kept, so a test may issue more) and party/dealer certificates in a private
    temporary directory, made once per process and removed when the process exits."""
    global _KEYS_DIR
    with _KEYS_LOCK:
        if _KEYS_DIR is None:
            d = _make_keys(keep_ca_key=True)
            atexit.register(_remove_keys, d, os.getpid())
            _KEYS_DIR = d
        return _KEYS_DIR


def mp_context():
    """The multiprocessing context of the parties (queues passed to them must come from it)."""
    method = os.environ.get("STARFISH_START_METHOD", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["mpc.session"])
    return ctx


def _dealer_main(keys_dir: str, out: Any) -> None:
    server = DealerServer(tls.identity(keys_dir, tls.DEALER_NAME))
    out.put(("dealer", server.address[1]))
    server.serve_forever()


def _party_main(rank: int, fn: Callable, args: tuple, kwargs: dict, opts: dict, ports: Any, results: Any) -> None:
    # ended by the parent (a peer failed, or the grace ran out): still close the session below, so
    # that the two-party engine's private session key does not stay behind on disk
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    torch.set_num_threads(opts.get("threads", 1))
    party = None
    try:
        listener = None
        if rank == 1:
            listener = listen("127.0.0.1", 0)
            ports.put(("party1", listener.getsockname()[1]))
            peer = None
        else:
            peer = opts["peer_address"]
        party = open_party(
            rank,
            opts["keys_dir"],
            peer_listener=listener,
            peer_address=peer,
            dealer_address=opts.get("dealer_address"),
            offline=opts["offline"],
            insecure_tfp=opts["insecure_tfp"],
            link=opts["link"],
            dealer_link=opts["dealer_link"],
            timeout=opts["timeout"],
            truncation=opts["truncation"],
            ticket=opts.get("ticket"),
        )
        if opts.get("plan") is not None:
            with party.meter("prefill"):
                party.prefill(opts["plan"])
        value = fn(party, *args, *opts["own_args"], **kwargs)
        results.put(("ok", rank, pickle.dumps((value, party.meters(), party.recorded_plan))))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if party is not None:
            party.close()


def run_parties(
    fn: Callable,
    *args: Any,
    offline: OfflineMode | str = OfflineMode.DEALER,
    insecure_tfp: bool = False,
    link: LinkProfile = NO_LINK,
    dealer_link: LinkProfile = NO_LINK,
    timeout: float = 120.0,
    keys_dir: str | None = None,
    plan: list[tuple] | None = None,
    relay: Callable[[tuple[str, int]], tuple[str, int]] | None = None,
    threads: int = 1,
    party_args: tuple[tuple, tuple] = ((), ()),
    truncation: str = "wrapfree",
    ticket: bytes | None = None,
    **kwargs: Any,
) -> PartyResults:
    """Run ``fn(party, *args, **kwargs)`` as both parties; see the module docstring.

    offline: "dealer" (default: correlated randomness from a third process, the dealer) or
        "two-party" (no dealer: the two parties make everything between themselves with the
        two-party engine, ``mpc.spu_engine``; no third process is started).
    insecure_tfp: make the correlations with CrypTen's trusted-first-party provider instead of
        either mode (party 0 knows every triple; tests only; no dealer is started).
    link: emulated server<->server link (latency, bandwidth); dealer_link likewise.
    plan: a request list recorded by an earlier run (``results.plans[0]``); the dealer
        material for it is fetched before ``fn`` runs, metered as step "prefill".
    relay: maps party 1's listening address to the address party 0 should dial (a test
        can put a byte-counting proxy in between).
    timeout: seconds either party waits for a message before failing; also bounds the run.
    party_args: extra positional arguments for party 0 and for party 1 only (e.g. each
        server's own shares), appended after ``args``; the other party never receives them.
    truncation: "wrapfree" (default) or "local" (see ``mpc.session.open_party``).
    keys_dir: a key directory (``starfish keys init``); default: a throw-away one for this run.
    ticket: the session ticket both parties present (see ``mpc.session.open_party``).
    """
    mode = OfflineMode.of(offline)
    ctx = mp_context()
    ports, results = ctx.Queue(), ctx.Queue()
    procs: list[mp.Process] = []
    t0 = time.perf_counter()
    own_keys = None if keys_dir else _make_keys(keep_ca_key=False)
    try:
        opts: dict[str, Any] = {"keys_dir": keys_dir or own_keys, "offline": mode, "insecure_tfp": insecure_tfp, "link": link,
                                "dealer_link": dealer_link, "timeout": timeout, "plan": plan,
                                "threads": threads, "truncation": truncation, "ticket": ticket}
        if mode is OfflineMode.DEALER and not insecure_tfp:
            dealer = ctx.Process(target=_dealer_main, args=(opts["keys_dir"], ports), daemon=True, name="dealer")
            dealer.start()
            procs.append(dealer)
            opts["dealer_address"] = ("127.0.0.1", _await_port(ports, "dealer", timeout, procs))
        p1 = ctx.Process(target=_party_main, args=(1, fn, args, kwargs, {**opts, "own_args": party_args[1]}, ports, results), name="party1")
        p1.start()
        procs.append(p1)
        addr = ("127.0.0.1", _await_port(ports, "party1", timeout, procs))
        opts["peer_address"] = relay(addr) if relay else addr
        p0 = ctx.Process(target=_party_main, args=(0, fn, args, kwargs, {**opts, "own_args": party_args[0]}, ports, results), name="party0")
        p0.start()
        procs.append(p0)
        outcomes = _collect(results, timeout, [p0, p1])
        if all(status == "ok" for status, _ in outcomes.values()):
            deadline = time.monotonic() + _CLOSE_GRACE
            for p in (p0, p1):
                p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
        if own_keys is not None:
            shutil.rmtree(own_keys, ignore_errors=True)
    errors = {r: msg for r, (status, msg) in outcomes.items() if status == "error"}
    if errors:
        first = min(errors)
        raise PartyError(f"party {first} failed: {errors[first].splitlines()[0]}", errors)
    decoded = {r: pickle.loads(blob) for r, (_, blob) in outcomes.items()}
    return PartyResults(
        values=[decoded[0][0], decoded[1][0]],
        meters=[decoded[0][1], decoded[1][1]],
        plans=[decoded[0][2], decoded[1][2]],
        seconds=time.perf_counter() - t0,
    )


def _await_port(ports: Any, who: str, timeout: float, procs: list) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            name, port = ports.get(timeout=0.2)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise PartyError(
                    f"a process died before {who} was listening. If run_parties is called from a "
                    "script, the call must sit under `if __name__ == \"__main__\":` (the parties "
                    "re-import the main module)", {}) from None
            continue
        if name == who:
            return port
    raise PartyError(f"{who} did not start listening within {timeout:.0f}s", {})


def _collect(results: Any, timeout: float, parties: list) -> dict[int, tuple[str, Any]]:
    """Both outcomes, or as many as arrive; a party that dies silently is reported too."""
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout * 4
    grace_until = None
    while len(outcomes) < 2:
        now = time.monotonic()
        if now > deadline or (grace_until is not None and now > grace_until):
            break
        try:
            status, rank, payload = results.get(timeout=0.2)
            outcomes[rank] = (status, payload)
            if status == "error" and grace_until is None:
                grace_until = time.monotonic() + min(timeout, 30.0)
        except queue.Empty:
            for rank, p in ((0, parties[0]), (1, parties[1])):
                if rank not in outcomes and p.exitcode is not None:
                    # give the queue a moment: the result may still be in flight
                    try:
                        status, r, payload = results.get(timeout=1.0)
                        outcomes[r] = (status, payload)
                    except queue.Empty:
                        outcomes[rank] = ("error", f"party {rank} exited with code {p.exitcode} without a result")
    for rank in (0, 1):
        outcomes.setdefault(rank, ("error", f"party {rank} produced no result in time"))
    return outcomes
