"""Network profiles of the benchmarks, how they are applied, and the analytic time model.

Profiles (the paper's Sec. VI-A settings; its latencies are SecureML's round-trip times):

* ``lan``: 0.17 ms round trip, bandwidth written "1 GB/s" in the paper;
* ``wan``: 72 ms round trip, bandwidth written "100 MB/s";
* ``none``: loopback at full speed (no emulation; the "compute" baseline);
* ``custom``: ``--latency-ms`` (one way) and ``--bandwidth-mbps`` (megabits per second; 0 =
  unlimited); the options themselves are ``bench/common_options.py``'s.

The paper's "GB/s" and "MB/s" are ambiguous. ``--bandwidth-reading bits`` (default) takes them as
the usual network rates 1 Gbit/s and 100 Mbit/s; ``bytes`` takes them literally (8 Gbit/s and
800 Mbit/s). Every report states the reading used.

Applying a profile for real. Where the kernel has ``tc netem`` the benchmark can run inside a
fresh network namespace whose loopback carries ``netem delay <one-way> rate <bandwidth>`` (so
both the server<->server and the dealer traffic are shaped). This machine's kernel has no
netem (``tc qdisc add ... netem`` fails with "Specified qdisc kind is unknown"); the probe
below detects that at run time in a throwaway namespace, removes the namespace again, and the
benchmark falls back to the transport's own link emulation (``net.link.LinkProfile``, applied by
each receiver as a FIFO link) on the server link and on the dealer link. Reports name the
method that was used and why.

Analytic time of a step (what the emulation should produce if nothing overlaps):

    rounds x one-way latency + bytes per direction x 8 / bandwidth + compute,

where *compute* is the step's seconds measured with no emulated link, and *bytes per
direction* is the larger of the bytes sent and received by one server (the exchanges are
symmetric, so both directions are nearly equal and travel in parallel).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass

from net.channel import NO_LINK, LinkProfile

#: name -> (round-trip seconds, bandwidth as written in the paper, per second)
PAPER_PROFILES: dict[str, tuple[float, float]] = {
    "lan": (0.17e-3, 1e9),
    "wan": (72e-3, 100e6),
}
READINGS = ("bits", "bytes")
SHAPING_MODES = ("auto", "emulate", "netem")
#: set by the netem re-execution: the namespace is already shaped, do not emulate again
NETEM_ENV = "STARFISH_BENCH_NETEM"


@dataclass(frozen=True)
class NetworkProfile:
    name: str
    one_way_latency_s: float
    bandwidth_bps: float          # bits per second; 0 = unlimited
    reading: str                  # "bits", "bytes" (paper profiles) or "custom"/"none"

    @property
    def rtt_s(self) -> float:
        return 2.0 * self.one_way_latency_s

    @property
    def emulated(self) -> bool:
        return self.one_way_latency_s > 0 or self.bandwidth_bps > 0

    def link(self):
        """The transport's LinkProfile for this profile (server link and dealer link)."""
        return LinkProfile(self.one_way_latency_s, self.bandwidth_bps)

    def describe(self) -> str:
        if not self.emulated:
            return f"{self.name}: loopback, no emulated latency or bandwidth limit"
        bw = "unlimited" if self.bandwidth_bps <= 0 else _rate(self.bandwidth_bps)
        text = (f"{self.name}: {self.rtt_s * 1e3:.3g} ms round trip ({self.one_way_latency_s * 1e3:.4g} ms "
                f"one way), {bw}")
        if self.reading in READINGS:
            written = "1 GB/s" if self.name == "lan" else "100 MB/s"
            text += f" (the paper's '{written}' read as {self.reading})"
        return text

    def to_json(self) -> dict:
        return {**asdict(self), "rtt_s": self.rtt_s, "description": self.describe()}


def _rate(bps: float) -> str:
    for unit, f in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= f:
            return f"{bps / f:.4g} {unit}"
    return f"{bps:.4g} bit/s"


def resolve(name: str, *, latency_ms: float | None = None, bandwidth_mbps: float | None = None,
            reading: str = "bits") -> NetworkProfile:
    """The profile called ``name``; ``--latency-ms``/``--bandwidth-mbps`` make it ``custom``."""
    if reading not in READINGS:
        raise ValueError(f"bandwidth reading must be one of {READINGS}, not {reading!r}")
    custom_given = latency_ms is not None or bandwidth_mbps is not None
    if name in PAPER_PROFILES:
        if custom_given:
            raise ValueError(f"--latency-ms/--bandwidth-mbps define a custom profile; "
                             f"drop them or use --profile custom instead of {name!r}")
        rtt, written = PAPER_PROFILES[name]
        bps = written if reading == "bits" else written * 8.0
        return NetworkProfile(name, rtt / 2.0, bps, reading)
    if name == "none" and not custom_given:
        return NetworkProfile("none", 0.0, 0.0, "none")
    if name in ("custom", "none"):
        lat = float(latency_ms or 0.0)
        mbps = float(bandwidth_mbps or 0.0)
        if lat < 0 or mbps < 0:
            raise ValueError("latency and bandwidth must be non-negative")
        return NetworkProfile("custom", lat / 1e3, mbps * 1e6, "custom")
    raise ValueError(f"unknown profile {name!r}; choose lan, wan, none or custom")


def analytic_seconds(rounds: float, bytes_per_direction: float, compute_s: float,
                     profile: NetworkProfile) -> float:
    """rounds x one-way latency + bytes per direction x 8 / bandwidth + compute."""
    transfer = bytes_per_direction * 8.0 / profile.bandwidth_bps if profile.bandwidth_bps > 0 else 0.0
    return rounds * profile.one_way_latency_s + transfer + compute_s


def analytic_overlap_seconds(rounds: float, bytes_per_direction: float, compute_s: float,
                             profile: NetworkProfile) -> float:
    """Lower bound: rounds x one-way latency + max(compute, transfer).

    On loopback the compute seconds already contain the real transfer of the same bytes (TLS,
    copies, on the same cores), and the receiver-side emulation delays a frame only beyond its
    real arrival, so emulated and real transfer overlap instead of adding up. When the real
    pipeline is slower than the emulated link (LAN on this machine) the link adds ~nothing.
    """
    transfer = bytes_per_direction * 8.0 / profile.bandwidth_bps if profile.bandwidth_bps > 0 else 0.0
    return rounds * profile.one_way_latency_s + max(transfer, compute_s)


def relative_difference(measured: float, analytic: float) -> float | None:
    """(measured - analytic) / analytic; None when the analytic time is 0."""
    if analytic <= 0:
        return None
    return (measured - analytic) / analytic


# ------------------------------------------------------------------------------ shaping
@dataclass(frozen=True)
class Shaping:
    method: str      # "none", "netem" or "link-emulation"
    reason: str

    def to_json(self) -> dict:
        return asdict(self)


def _run(cmd: list[str], timeout: float = 10.0) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def probe_netem() -> tuple[bool, str]:
    """Can this kernel shape traffic with netem? Tried in a throwaway namespace, removed after."""
    if os.environ.get(NETEM_ENV):
        return True, "already running inside a netem-shaped namespace"
    if not shutil.which("ip") or not shutil.which("tc"):
        return False, "ip/tc (iproute2) not installed"
    ns = f"starfish-probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        made = _run(["ip", "netns", "add", ns])
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"cannot create a network namespace: {exc}"
    if made.returncode != 0:
        return False, f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
    try:
        r = _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "10ms"])
        if r.returncode != 0:
            return False, f"tc netem unavailable: {r.stderr.strip() or r.returncode}"
        return True, "tc netem works in a network namespace"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"tc netem unavailable: {exc}"
    finally:
        try:
            _run(["ip", "netns", "del", ns])
        except (OSError, subprocess.TimeoutExpired):
            pass


def choose_shaping(profile: NetworkProfile, mode: str = "auto", probe=probe_netem) -> Shaping:
    """How ``profile`` is applied: netem when requested/available, else link emulation."""
    if mode not in SHAPING_MODES:
        raise ValueError(f"shaping must be one of {SHAPING_MODES}")
    if not profile.emulated:
        return Shaping("none", "no link profile: loopback at full speed")
    if os.environ.get(NETEM_ENV):
        return Shaping("netem", "tc netem on the loopback of this network namespace")
    if mode == "emulate":
        return Shaping("link-emulation", "requested (--shaping emulate): the transport's LinkProfile "
                                         "on the server link and the dealer link")
    ok, why = probe()
    if ok:
        return Shaping("netem", why)
    if mode == "netem":
        raise RuntimeError(f"--shaping netem requested, but {why}")
    return Shaping("link-emulation", f"{why}; fell back to the transport's LinkProfile emulation "
                                     "on the server link and the dealer link")


def netem_commands(namespace: str, profile: NetworkProfile) -> list[list[str]]:
    """Commands that create ``namespace`` with a shaped loopback.

    On loopback one qdisc sees every packet once, so ``delay`` is the one-way latency; the
    ``rate`` is shared by both directions (a half-duplex approximation of the paper's links).
    """
    netem = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
             "delay", f"{profile.one_way_latency_s * 1e3:.6g}ms"]
    if profile.bandwidth_bps > 0:
        netem += ["rate", f"{int(round(profile.bandwidth_bps))}bit"]
    return [["ip", "netns", "add", namespace],
            ["ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up"],
            netem]


def run_under_netem(profile: NetworkProfile, argv: list[str]) -> int:
    """Re-run this benchmark command inside a netem-shaped namespace; returns its exit code.

    Not exercised on the development machine (its kernel has no netem); the namespace is
    removed afterwards whatever happens.
    """
    ns = f"starfish-bench-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        for cmd in netem_commands(ns, profile):
            r = _run(cmd)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
        env = {**os.environ, NETEM_ENV: ns}
        return subprocess.call(["ip", "netns", "exec", ns, sys.executable, "-m", "starfish.cli", *argv], env=env)
    finally:
        _run(["ip", "netns", "del", ns])


def forwarded_argv(command: list[str], argv: list[str] | None) -> list[str]:
    """The ``starfish`` arguments that re-run this benchmark (``command`` e.g. ["bench", "steps"])."""
    if argv is not None:
        return [*command, *argv]
    args = sys.argv[1:]
    last = command[-1]
    return [*command, *args[args.index(last) + 1:]] if last in args else [*command, *args]


def effective_link(profile: NetworkProfile, shaping: Shaping):
    """The LinkProfile to hand to the transport: none when netem (or nothing) shapes the link."""
    return profile.link() if shaping.method == "link-emulation" else NO_LINK


__all__ = ["NetworkProfile", "PAPER_PROFILES", "resolve", "analytic_seconds", "analytic_overlap_seconds",
           "relative_difference",
           "Shaping", "probe_netem", "choose_shaping", "netem_commands", "run_under_netem",
           "forwarded_argv", "effective_link"]
