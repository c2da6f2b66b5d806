"""The options every benchmark shares, defined once: ``--profile`` (with ``--latency-ms``,
``--bandwidth-mbps``, ``--bandwidth-reading`` and, where the bench can re-run itself under netem,
``--shaping``), ``--offline``, ``--quiet``, ``--out`` and ``--seed``.

Why one module: issue 27 found ``bench aggregation`` without ``--quiet`` and ``--offline`` and
with another default profile than the rest, because each bench had written its own
``add_argument`` lines. A user who has learnt one bench should know these options in all of them:
same names, help, units and defaults. Each bench calls the helpers for the options that mean
something to it: a plaintext bench has no ``--offline``, a bench that measures on loopback and
predicts link times analytically has no ``--profile``, and its description says why.
"""

from __future__ import annotations

import argparse
import sys

from common.offline_mode import OFFLINE_CHOICES, OfflineMode

from .profiles import READINGS, SHAPING_MODES, NetworkProfile, resolve

DEFAULT_PROFILE = "lan"
PROFILES = ("lan", "wan", "none", "custom")
#: a bench accepts the deployment's offline modes (``common.offline_mode.OFFLINE_CHOICES``); its
#: default is the dealer, the faster mode, where the service's is two-party
DEFAULT_OFFLINE = OfflineMode.DEALER.value
DEFAULT_SEED = 0

PROFILE_HELP = (f"link profile of the server link and the dealer link (default {DEFAULT_PROFILE}): lan = 0.17 ms "
                "round trip, 1 Gbit/s; wan = 72 ms round trip, 100 Mbit/s; none = loopback; custom = "
                "--latency-ms/--bandwidth-mbps (either alone implies custom)")
MODES_HELP = ("dealer = a third process makes the correlated randomness; two-party = no dealer, the two "
              "servers make it between themselves (mpc/spu_engine.py; the service's default)")
OFFLINE_HELP = f"where the correlated randomness comes from (default {DEFAULT_OFFLINE}): {MODES_HELP}"
_TFP_HELP = "; tfp = CrypTen's trusted first party (insecure: party 0 knows every triple), a reference only"
QUIET_HELP = ("no progress bars and no status lines on stderr (bars are drawn only when stderr is a "
              "terminal; tables, JSON and errors are unaffected)")

__all__ = ["add_profile", "profile_of", "add_offline", "add_quiet", "add_out", "add_seed", "refuse",
           "DEFAULT_PROFILE", "PROFILES", "DEFAULT_OFFLINE", "DEFAULT_SEED",
           "PROFILE_HELP", "MODES_HELP", "OFFLINE_HELP", "QUIET_HELP"]


class _ChosenProfile(argparse.Action):
    # remembers that --profile was typed, so that a lone --latency-ms means custom (as it did
    # before these benches had profiles) while "--profile lan --latency-ms 5" stays an error
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.profile_chosen = True


def add_profile(p, *, netem: bool = False) -> None:
    """``--profile`` and its companions; ``netem``: the bench can re-run itself in a netem-shaped
    namespace (``profiles.run_under_netem``), so it also takes ``--shaping``."""
    p.add_argument("--profile", default=DEFAULT_PROFILE, choices=list(PROFILES), action=_ChosenProfile,
                   help=PROFILE_HELP)
    p.add_argument("--bandwidth-reading", default="bits", choices=list(READINGS),
                   help="read the paper's '1 GB/s' and '100 MB/s' as bits (1 Gbit/s, 100 Mbit/s; default) "
                        "or as bytes (8 Gbit/s, 800 Mbit/s)")
    p.add_argument("--latency-ms", type=float, default=None, help="custom profile: one-way latency in ms")
    p.add_argument("--bandwidth-mbps", type=float, default=None,
                   help="custom profile: bandwidth in Mbit/s (0 = unlimited)")
    if netem:
        p.add_argument("--shaping", default="auto", choices=list(SHAPING_MODES),
                       help="auto (default): tc netem if the kernel has it, else the transport's link "
                            "emulation; emulate: always the transport's emulation; netem: fail without netem")


def profile_of(args: argparse.Namespace) -> NetworkProfile:
    """The profile ``add_profile``'s options name; ValueError with a one-line reason if they conflict."""
    custom = args.latency_ms is not None or args.bandwidth_mbps is not None
    name = args.profile if getattr(args, "profile_chosen", False) or not custom else "custom"
    return resolve(name, latency_ms=args.latency_ms, bandwidth_mbps=args.bandwidth_mbps,
                   reading=args.bandwidth_reading)


def _modes(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        modes = [m.strip() for m in text.split(",") if m.strip()]
        bad = [m for m in modes if m not in allowed]
        if bad or not modes:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)} (comma list)")
        return modes
    return parse


def add_offline(p, *, several: str | None = None, tfp: bool = False) -> None:
    """``--offline``: one mode (``args.offline`` a string), or with ``several`` (its default) a
    comma list of modes the bench measures side by side (``args.offline`` a list); ``tfp``
    also accepts the insecure reference provider."""
    if several is None:
        p.add_argument("--offline", choices=list(OFFLINE_CHOICES), default=DEFAULT_OFFLINE, help=OFFLINE_HELP)
        return
    allowed = OFFLINE_CHOICES + (("tfp",) if tfp else ())
    p.add_argument("--offline", type=_modes(allowed), default=several, metavar="MODE[,MODE]",
                   help=f"comma list of where the correlated randomness comes from, each measured in turn "
                        f"(default {several}): {MODES_HELP}{_TFP_HELP if tfp else ''}")


def add_quiet(p) -> None:
    p.add_argument("--quiet", action="store_true", help=QUIET_HELP)


def add_out(p, default: str | None, *, shown: str | None = None, beside: str = "") -> None:
    """``--out``: where the JSON result goes; ``shown`` names a default made from other options."""
    more = f"; {beside}" if beside else ""
    p.add_argument("--out", default=default, help=f"JSON output (default {shown or default}){more}")


def add_seed(p, what: str) -> None:
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"seed of {what} (default {DEFAULT_SEED})")


def refuse(prog: str, why: str) -> int:
    """A combination of options the bench cannot honour: one line on stderr, exit status 2."""
    print(f"{prog}: {why}", file=sys.stderr)
    return 2


def parse(prog: str, doc: str | None, add_arguments, argv: list[str] | None,
          args: argparse.Namespace | None = None) -> argparse.Namespace:
    """``args`` as given (the ``starfish bench`` CLI parsed them already), else ``argv`` parsed
    by the bench's own parser: the preamble every bench's ``main`` shares."""
    if args is not None:
        return args
    parser = argparse.ArgumentParser(prog=prog, description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser.parse_args(argv)
