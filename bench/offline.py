"""Offline/online separation per step, and the runs every cost benchmark makes.

Why per step: ``run_parties(plan=...)`` fetches the dealer material of a *whole* run before it
starts. For a full Stage II on the MNIST shapes that is tens of GB of triples held in memory at
once (each SecTC alone needs ~330 bytes of material per compared coordinate and party, i.e.
~3.6 GB for 19 x 582,026 coordinates). So the benchmarks fetch, right before each top-level
step (``TD``, ``RS``, ``UE``, ``TC``, ``aggregate``, ...), exactly the material that step will
use: the paper's offline phase, cut into per-step pieces. It is metered as its own step
``offline:<name>`` (offline bytes, offline seconds) and ends with a one-byte barrier on the
server link, so that neither server starts the online step while the other is still fetching
(the barrier's few bytes are metered under ``offline:<name>``, never under the online step).

Request templates. A step's dealer requests depend only on shapes (and the round-selection
method), so every call of ``UE`` in a Stage II asks for the same list, and so does every
``TC``. A :class:`Schedule` therefore holds one request list per step *name*, recorded once:

1. Recording run (no schedule): :class:`RecordingParty` records the requests of each top-level
   step (material fetched online per request). A step whose calls asked for different lists is
   marked *variable* and is never prefetched. ``aliases`` renames recorded steps, so a short
   run of ``bench/steps.py`` (one call of each step) can serve as the recording for a whole
   Stage II (``bench/unlearning.py``) on the same shapes.
2. Measured runs (with the schedule): :class:`PrefetchingParty` prefills the step's template
   before each call and checks afterwards that the call used exactly that list; any other
   outcome (e.g. a data-dependent re-masked inversion) is reported as a mismatch, and the
   provider then fetches the material it needs online, so results stay correct.

Runs: *record*, *compute* (prefetched, no emulated link: each online step's seconds are its
compute time on loopback) and *link* (prefetched, with the profile's link on the server link
and the dealer link). Schedules and compute runs are cached on disk (:func:`measure`).

Two-party mode (``--offline two-party``): there is no dealer and nothing to record or prefetch.
The servers make each step's correlations between themselves while the step runs (the engine's
products, metered as the step's *offline* bytes: one link, so server 0's count, both
directions), and the engine's comparisons and truncations are the step's online bytes. A
step's seconds therefore include making its correlations; its offline seconds are 0.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mpc.launcher import run_parties
from net.channel import KIND_OBJECT, NO_LINK

from . import progress

OFFLINE_PREFIX = "offline:"

__all__ = ["Schedule", "RecordingParty", "PrefetchingParty", "instrument", "party_report", "Runs",
           "run_three", "measure", "wire_check", "summarize_steps", "peak_rss_bytes", "code_fingerprint",
           "OFFLINE_PREFIX"]


@dataclass
class Schedule:
    """One dealer-request list per top-level step name (see the module docstring)."""

    templates: dict[str, list[tuple]]
    variable: set[str] = field(default_factory=set)
    meta: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(v) for v in self.templates.values())

    def renamed(self, aliases: dict[str, str]) -> "Schedule":
        """A copy whose step ``new`` uses the recorded template of ``old`` (aliases new -> old)."""
        t = {new: self.templates[old] for new, old in aliases.items() if old in self.templates}
        v = {new for new, old in aliases.items() if old in self.variable}
        return Schedule(t, v, {**self.meta, "aliases": aliases})

    def save(self, path: str | os.PathLike) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_bytes(pickle.dumps({"templates": self.templates, "variable": sorted(self.variable),
                                      "meta": self.meta}))
        os.replace(tmp, p)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Schedule":
        d = pickle.loads(Path(path).read_bytes())
        return cls(d["templates"], set(d["variable"]), d.get("meta", {}))


#: sources whose changes can change the dealer requests of a benchmark run
_FINGERPRINTED = ("bench", "protocols", "mpc")


def code_fingerprint() -> str:
    """Hash of the source files a recorded schedule or compute run depends on.

    Used in cache keys, so an edited working tree (not only a new commit) invalidates them.
    Only ``.py`` files count (editing bench/README.md keeps the caches).
    """
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for rel in _FINGERPRINTED:
        p = root / rel
        files = sorted(p.rglob("*.py")) if p.is_dir() else [p]
        for f in files:
            if f.exists():
                h.update(str(f.relative_to(root)).encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _vm_hwm_bytes() -> int:
    """Peak resident set so far (VmHWM), bytes; 0 where /proc is unavailable."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (getrusage ru_maxrss, KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class _Proxy:
    """Forwards everything to the real party except ``meter``.

    ``on_step(name, finished)`` is told when each top-level step starts and ends (a progress
    bar's hook, ``bench.progress.step_hook``).
    """

    def __init__(self, party: Any, on_step: Callable[[str, bool], None] | None = None) -> None:
        self._party = party
        self._on_step = on_step
        self._depth = 0
        self.peaks: list[tuple[str, int]] = []   # (top-level step, VmHWM after it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._party, name)

    def _plan(self) -> list[tuple]:
        return self._party.recorded_plan

    def _before(self, name: str) -> None:
        pass

    def _after(self, name: str, used: list[tuple]) -> None:
        pass

    @contextlib.contextmanager
    def meter(self, name: str):
        top = self._depth == 0
        start = len(self._plan()) if top else -1
        if top:
            if self._on_step is not None:
                self._on_step(name, False)
            self._before(name)
        self._depth += 1
        try:
            with self._party.meter(name):
                yield
        finally:
            self._depth -= 1
            if top:
                self._after(name, self._plan()[start:])
                self.peaks.append((name, _vm_hwm_bytes()))
                if self._on_step is not None:
                    self._on_step(name, True)


class RecordingParty(_Proxy):
    def __init__(self, party: Any, on_step: Callable[[str, bool], None] | None = None) -> None:
        super().__init__(party, on_step)
        self.templates: dict[str, list[tuple]] = {}
        self.variable: set[str] = set()

    def _after(self, name: str, used: list[tuple]) -> None:
        if name not in self.templates:
            self.templates[name] = used
        elif self.templates[name] != used:
            self.variable.add(name)


#: Steps whose dealer requests depend on public but data-dependent counts (the pair test runs on
#: the clients a check flagged): their material is fetched online by design, reported as inline
#: offline bytes of the step, and not counted as a schedule mismatch.
ONLINE_MATERIAL_STEPS = frozenset({"pairs"})


class PrefetchingParty(_Proxy):
    def __init__(self, party: Any, schedule: Schedule,
                 on_step: Callable[[str, bool], None] | None = None) -> None:
        super().__init__(party, on_step)
        self.schedule = schedule
        self.mismatches: list[str] = []
        self.prefetched_requests = 0
        self.calls: dict[str, int] = {}

    def _barrier(self) -> None:
        ch = self._party.channel
        ch.send_frame(KIND_OBJECT, b"\x01")
        ch.recv_frame(KIND_OBJECT, 1)

    def _before(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        plan = self.schedule.templates.get(name)
        if not plan or name in self.schedule.variable:
            return  # nothing recorded to fetch: material (if any) is fetched online
        with self._party.meter(OFFLINE_PREFIX + name):
            self._party.prefill(plan)
            self.prefetched_requests += len(plan)
            self._barrier()

    def _after(self, name: str, used: list[tuple]) -> None:
        plan = self.schedule.templates.get(name)
        if name in ONLINE_MATERIAL_STEPS:
            return
        if plan is None or name in self.schedule.variable:
            if used:
                self.mismatches.append(f"{name}#{self.calls[name]}: {len(used)} requests fetched online "
                                       "(no template)")
        elif used != plan:
            self.mismatches.append(f"{name}#{self.calls[name]}: used {len(used)} requests, the template "
                                   f"has {len(plan)}; differing ones were fetched online")


def instrument(party: Any, schedule: Schedule | None,
               on_step: Callable[[str, bool], None] | None = None) -> _Proxy:
    return RecordingParty(party, on_step) if schedule is None else PrefetchingParty(party, schedule, on_step)


def party_report(proxy: _Proxy) -> dict:
    """What a party program returns besides its own values (templates, mismatches, memory)."""
    out = {"peak_rss_bytes": peak_rss_bytes(), "step_peaks": proxy.peaks}
    if isinstance(proxy, RecordingParty):
        out["templates"] = proxy.templates
        out["variable"] = sorted(proxy.variable)
    else:
        out["mismatches"] = proxy.mismatches
        out["prefetched_requests"] = proxy.prefetched_requests
    return out


# ----------------------------------------------------------------------------- parent side
@dataclass
class Runs:
    schedule: Schedule
    record: Any | None           # PartyResults of the recording run (None when cached)
    compute: Any | None          # PartyResults, prefetched, no link (None when skipped)
    link: Any | None             # PartyResults, prefetched, with the profile's link
    seconds: dict = field(default_factory=dict)
    offline: str = "dealer"      # "dealer" or "two-party" (see the module docstring)


def run_three(fn: Callable, args: tuple, *, link=None, schedule_path: str | os.PathLike | None = None,
              reuse_schedule: bool = True, compute_results: Any | None = None, timeout: float = 3600.0,
              party_args: tuple[tuple, tuple] = ((), ()), label: str = "",
              record: tuple[Callable, tuple] | None = None, aliases: dict[str, str] | None = None,
              skip_compute: bool = False, offline: str = "dealer", quiet: bool = False) -> Runs:
    """Record (or load) the schedule, then the compute run and, given ``link``, the link run.

    ``fn(party, *args, schedule, *own_args)`` must call :func:`instrument` and return a dict
    holding ``party_report(proxy)`` under ``"report"``. ``compute_results`` skips the compute
    run (e.g. reused from an earlier invocation on the same configuration). ``record`` =
    ``(fn, args)`` records with another (cheaper) program on the same shapes, whose steps are
    renamed by ``aliases`` (new name -> recorded name). ``quiet``: no line per run on stderr
    (the runs' own bars come with ``party_args``, see ``bench.progress.party_args``).
    """

    def _log(msg: str) -> None:
        progress.say(msg, quiet=quiet)

    secs: dict[str, float] = {}
    schedule = None
    recorded = None
    if offline == "two-party":
        schedule = Schedule({}, meta={"offline": "two-party: no dealer, nothing recorded or prefetched"})
    elif schedule_path is not None and reuse_schedule and Path(schedule_path).exists():
        schedule = Schedule.load(schedule_path)
        _log(f"{label}: reusing the recorded dealer schedule {schedule_path} "
             f"({schedule.num_requests} requests)")
    if schedule is None:
        _log(f"{label}: recording run (dealer material fetched online per request) ...")
        secs["record_load_before"] = os.getloadavg()
        t0 = time.perf_counter()
        rec_fn, rec_args = record if record is not None else (fn, args)
        recorded = run_parties(rec_fn, *rec_args, None, timeout=timeout, party_args=party_args)
        secs["record"] = time.perf_counter() - t0
        secs["record_load_after"] = os.getloadavg()
        r0, r1 = (v["report"] for v in recorded.values)
        if r0["templates"] != r1["templates"]:
            raise RuntimeError("the two parties recorded different dealer request lists")
        schedule = Schedule(r1["templates"], set(r1["variable"]),
                            {"recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                             "record_peak_rss_bytes": [r0["peak_rss_bytes"], r1["peak_rss_bytes"]]})
        if aliases:
            schedule = schedule.renamed(aliases)
        if schedule_path is not None:
            schedule.save(schedule_path)
        _log(f"{label}: recorded {schedule.num_requests} requests in {secs['record']:.1f}s")
    compute = compute_results
    if compute is None and not skip_compute:
        _log(f"{label}: compute run ({'no dealer: correlations made inside each step' if offline == 'two-party' else 'material prefetched per step'}, no emulated link) ...")
        secs["compute_load_before"] = os.getloadavg()
        t0 = time.perf_counter()
        compute = run_parties(fn, *args, schedule, timeout=timeout, party_args=party_args, offline=offline)
        secs["compute"] = time.perf_counter() - t0
        secs["compute_load_after"] = os.getloadavg()
        _log(f"{label}: compute run took {secs['compute']:.1f}s")
    linked = None
    if link is not None:
        _log(f"{label}: link run (emulated latency {link.latency * 1e3:.4g} ms one way, "
             f"bandwidth {link.bandwidth_bps / 1e6:.6g} Mbit/s; 0 = not emulated) ...")
        secs["link_load_before"] = os.getloadavg()
        t0 = time.perf_counter()
        linked = run_parties(fn, *args, schedule, link=link, dealer_link=link, timeout=timeout,
                             party_args=party_args, offline=offline)
        secs["link"] = time.perf_counter() - t0
        secs["link_load_after"] = os.getloadavg()
        _log(f"{label}: link run took {secs['link']:.1f}s")
    return Runs(schedule, recorded, compute, linked, secs, offline)


def summarize_steps(meters: list[dict], names: list[str] | None = None, offline: str = "dealer") -> dict[str, dict]:
    """Per top-level online step: rounds, bytes (online, per direction, offline), seconds.

    Online bytes are both directions of the server link (party 0's sent + received); offline
    bytes are the dealer traffic of both servers while prefetching the step (two-party mode:
    the correlations made inside the step, party 0's count of the one link); seconds are the
    larger of the two servers' (they run in lockstep).
    """
    inline_parties = (0,) if offline == "two-party" else (0, 1)
    m0, m1 = meters[0]["steps"], meters[1]["steps"]
    if names is None:
        names = [n for n in m0 if "/" not in n and not n.startswith(OFFLINE_PREFIX)
                 and n not in ("setup", "prefill")]
    out = {}
    for name in names:
        if name not in m0:
            continue
        a, b = m0[name], m1[name]
        row = {
            "calls": a["calls"],
            "rounds": max(a["online_rounds"], b["online_rounds"]),
            "online_bytes": a["online_bytes_sent"] + a["online_bytes_received"],
            "bytes_per_direction": max(a["online_bytes_sent"], a["online_bytes_received"]),
            "online_s": max(a["seconds"], b["seconds"]),
            # material fetched online inside the step (only when not prefetched)
            "inline_offline_bytes": sum(r["offline_bytes_sent"] + r["offline_bytes_received"]
                                        for r in ((a, b)[p] for p in inline_parties)),
        }
        off = OFFLINE_PREFIX + name
        if off in m0:
            oa, ob = m0[off], m1[off]
            row["offline_bytes"] = sum(r["offline_bytes_sent"] + r["offline_bytes_received"] for r in (oa, ob))
            # dealer round trips, plus the barrier's round on the server link
            row["offline_rounds"] = max(oa["offline_rounds"], ob["offline_rounds"]) + max(
                oa["online_rounds"], ob["online_rounds"])
            row["offline_bytes_to_party1"] = ob["offline_bytes_received"]
            row["offline_s"] = max(oa["seconds"], ob["seconds"])
        else:
            row.update(offline_bytes=row["inline_offline_bytes"], offline_rounds=0,
                       offline_bytes_to_party1=b["offline_bytes_received"], offline_s=0.0)
        out[name] = row
    return out


def measure(fn, args: tuple, *, profile, shaping, cache_dir: str | os.PathLike, key: str, prefix: str,
            fresh: bool = False, timeout: float = 3600.0, label: str = "",
            party_args: tuple[tuple, tuple] = ((), ()), record: tuple[Callable, tuple] | None = None,
            aliases: dict[str, str] | None = None, compute: bool = True, offline: str = "dealer",
            quiet: bool = False) -> Runs:
    """``run_three`` with on-disk caches: the recorded schedule and the compute run.

    The cache key must cover everything that changes the dealer requests (configuration,
    steps, code version); ``fresh`` ignores the caches. A later invocation with another profile
    on the same configuration then only makes the link run. Under netem (the whole process runs
    in a shaped namespace) the compute run must come from the cache: it was made outside.
    """
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    if offline != "dealer":
        key = f"{key}-{offline}"
    compute_path = cache / f"{prefix}-compute-{key}.pkl"
    compute_res = None
    if compute_path.exists() and not fresh:
        compute_res = pickle.loads(compute_path.read_bytes())
        progress.say(f"{label}: reusing the compute run {compute_path}", quiet=quiet)
    if shaping.method == "netem" and compute_res is None:
        raise RuntimeError("a netem-shaped run needs the compute run made outside the namespace first")
    link = None
    if profile.emulated:
        link = profile.link() if shaping.method == "link-emulation" else NO_LINK
    runs = run_three(fn, args, link=link, schedule_path=cache / f"{prefix}-schedule-{key}.pkl",
                     reuse_schedule=not fresh, compute_results=compute_res, timeout=timeout,
                     party_args=party_args, label=label, record=record, aliases=aliases,
                     skip_compute=not compute, offline=offline, quiet=quiet)
    if compute_res is None and runs.compute is not None:
        compute_path.write_bytes(pickle.dumps(runs.compute))
        runs.seconds["compute_cached_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    elif compute_res is not None:
        runs.seconds["compute_reused_from"] = str(compute_path)
    return runs


def add_cache_arguments(p) -> None:
    """--cache-dir, --fresh, --timeout: the options of every benchmark built on ``measure``."""
    p.add_argument("--cache-dir", default="out/bench-cache", help="synthetic data, schedules, compute runs")
    p.add_argument("--fresh", action="store_true", help="re-record the schedule and redo the compute run")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds a party waits for its peer")


def wire_check(meters: list[dict], offline: str = "dealer") -> dict:
    """Metered frame bytes vs TLS bytes counted at the sockets, per kind of traffic.

    Online: party 0's socket to party 1 (both directions). Offline: both servers' dealer
    sockets (two-party mode: party 0's engine link). The difference is TLS record overhead
    (~0.1%) plus the handshake; the engine's traffic is metered at its sockets, so it adds none.
    """
    out = {}
    for kind, parties in (("online", (0,)), ("offline", (0,) if offline == "two-party" else (0, 1))):
        metered = sum(meters[p]["total"][f"{kind}_bytes_sent"] + meters[p]["total"][f"{kind}_bytes_received"]
                      for p in parties)
        wire = sum(meters[p]["wire"][kind]["sent"] + meters[p]["wire"][kind]["received"] for p in parties)
        out[kind] = {"metered_bytes": metered, "socket_bytes": wire,
                     "relative_difference": (wire - metered) / metered if metered else None}
    return out
