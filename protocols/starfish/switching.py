"""T_delta, the switch between round-selection Methods 1 and 2, from measured costs.

Method 1 (division-free ratio comparator) costs one more round per sorting layer and two
multiplications per comparison; Method 2 costs one secure division per round. Which is
cheaper depends on T and on the link. ``bench/rs_switch.py`` measures both under 2PC and
stores rounds, bytes and compute seconds per T in ``rs_switch.json`` beside this file;
here each method's time on a link is predicted as

    rounds x one-way latency + bytes per direction x 8 / bandwidth + compute seconds

and T_delta is the smallest measured T from which Method 2 is predicted faster by more
than ``MARGIN`` (10%): at about equal cost Method 1 is preferred, as in the paper, because
secure division adds fixed-point error and a 2% difference is within our timing noise.
"""

from __future__ import annotations

import json
from pathlib import Path

MEASUREMENT = Path(__file__).with_name("rs_switch.json")

#: The paper's link settings: round-trip 0.17 ms / 72 ms (one way is half), 1 Gbit/s / 100 Mbit/s.
MARGIN = 0.10

PROFILES: dict[str, tuple[float, float]] = {
    "lan": (0.17e-3 / 2, 1e9),
    "wan": (72e-3 / 2, 100e6),
}


def predicted_seconds(row: dict, latency: float, bandwidth_bps: float) -> float:
    return row["rounds"] * latency + (row["online_bytes"] / 2) * 8 / bandwidth_bps + row["seconds"]


def t_delta_from(rows: list[dict], latency: float, bandwidth_bps: float) -> int | None:
    """Smallest measured T where Method 2 ("divide") beats Method 1 ("ratio") by MARGIN, else None."""
    by_t: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_t.setdefault(int(r["T"]), {})[r["method"]] = r
    for T in sorted(by_t):
        m = by_t[T]
        if "ratio" in m and "divide" in m and (
            predicted_seconds(m["divide"], latency, bandwidth_bps)
            < (1.0 - MARGIN) * predicted_seconds(m["ratio"], latency, bandwidth_bps)
        ):
            return T
    return None


def default_t_delta(profile: str = "lan", path: Path = MEASUREMENT) -> int:
    """T_delta for ``method="auto"`` on ``profile``.

    If Method 1 won at every measured T, return twice the largest measured T (we have no
    evidence that Method 2 ever wins). Without a measurement file, 64.
    """
    if not path.exists():
        return 64
    rows = json.loads(path.read_text())["rows"]
    found = t_delta_from(rows, *PROFILES[profile])
    if found is None:
        return 2 * max(int(r["T"]) for r in rows)
    return found
