"""The step check of a robust replay: every round the servers replayed, against the plaintext rule
on the same state (``starfish bench unlearning --aggregator fedseca|brace-sign``).

Why not only the free-running twin. A robust rule has edges (a sign at 0, a keep bit at lambda_k,
BRACE's vote total at lambda). The servers' rows carry the estimates' fixed-point error, so a
twin row within that error of an edge can fall on the other side in 2PC; that coordinate of the
round's direction then differs, the next M_hat differs, and the two runs go on along different
trajectories. On the synthetic MNIST history (updates about 1e-3, i.e. ~64 units of 2**-16)
that leaves 1-1.5% of the model's coordinates beyond 1e-3 of the free-running twin. So the check
splits the servers' promise in the two parts the code makes, and checks each at every round:

1. **rows**: the rows the servers fed to the rule are within ``TARGET_PLAINTEXT_DIFF`` of the
   twin's rows on the same state (same M_hat, same pairs);
2. **rule**: the value the servers opened is the plaintext rule applied to the servers' own rows:
   exactly for BRACE's vote, within ``fedseca_error_bound`` for FedSECA.

How. Each server process records, per robust round, the low 32 bits of its share of the rows
(the rows are 16-bit encodings below 2**14, so the two low halves add up to the value mod 2**32)
and the opened value (:class:`ShareRecorder`, ``RuleCombine``'s ``observe``). That opens the rows
to the benchmark, which plays both servers on a public synthetic history; no server's code path
builds a recorder. The twin then runs in lockstep (:class:`LockstepCombine`): at each robust round
it decides on its own rows (reported: the share of coordinates where that differs from the
servers'), checks 1 and 2, and goes on with the servers' opened value, so M_hat stays the servers'.
At the end its rounds, flags and model are compared with the servers' like the free-running twin's.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from protocols import backend as B
from protocols.robust_aggregation import fedseca_error_bound
from protocols.starfish import StarfishParams, run_stage2
from protocols.starfish.robust_replay import RoundRule, RuleCombine

from . import progress
from .synthetic import SyntheticClients, SyntheticConfig, SyntheticHistory, load_data, rule_of
from .twin_check import TARGET_PLAINTEXT_DIFF

__all__ = ["ShareRecorder", "StepRecords", "LockstepCombine", "step_check", "prune_records"]


class ShareRecorder:
    """``RuleCombine``'s ``observe`` in one server process: ``root/party<rank>-<id>/<n>.npz`` per
    robust round n (t, the rule, the fractional bits, the low 32 bits of this party's share of the
    rows, and on party 0 the opened value). ``path`` goes back to the benchmark in the party's result."""

    def __init__(self, root: str | Path, rank: int) -> None:
        self.rank = rank
        self.path = Path(root) / f"party{rank}-{uuid.uuid4().hex[:12]}"
        self.path.mkdir(parents=True)
        self.calls = 0

    def __call__(self, t: int, rule: RoundRule, G: Any, opened: torch.Tensor) -> None:
        if not B.is_shared(G):
            raise TypeError("the step check records the servers' shares; the twin has none")
        self.write(self.path, self.calls, t, rule.aggregator, B.bits_of(G), G.share.numpy(),
                   opened.numpy() if self.rank == 0 else None)
        self.calls += 1

    @staticmethod
    def write(path: Path, n: int, t: int, aggregator: str, frac_bits: int, share: np.ndarray,
              opened: np.ndarray | None) -> None:
        """One record: ``share`` is this party's int64 ring share of the K x D rows."""
        extra = {} if opened is None else {"opened": opened}
        np.savez(path / f"{n:05d}.npz", t=t, aggregator=aggregator, frac_bits=frac_bits,
                 low=share.astype(np.uint32), **extra)   # C cast: the share mod 2**32


class Step(NamedTuple):
    t: int
    aggregator: str
    rows: np.ndarray      # K x D, float64: the servers' rows, decoded
    opened: np.ndarray    # D: what the servers opened


class StepRecords:
    """Both parties' records of one run, read back a round at a time."""

    def __init__(self, party0: str | Path, party1: str | Path) -> None:
        self.dirs = (Path(party0), Path(party1))
        counts = [len(list(d.glob("*.npz"))) for d in self.dirs]
        if counts[0] != counts[1]:
            raise ValueError(f"the two servers recorded {counts[0]} and {counts[1]} robust rounds")
        self.count = counts[0]

    def __len__(self) -> int:
        return self.count

    def load(self, n: int) -> Step:
        if n >= self.count:
            raise IndexError(f"the twin replays more robust rounds than the servers did ({self.count})")
        a, b = (np.load(d / f"{n:05d}.npz") for d in self.dirs)
        if int(a["t"]) != int(b["t"]) or int(a["frac_bits"]) != int(b["frac_bits"]):
            raise ValueError(f"robust round {n}: the servers recorded different rounds")
        value = (a["low"] + b["low"]).view(np.int32)      # uint32 adds wrap: the value mod 2**32
        rows = value.astype(np.float64) / float(2 ** int(a["frac_bits"]))
        return Step(int(a["t"]), str(a["aggregator"]), rows, a["opened"])


class LockstepCombine(RuleCombine):
    """The twin's combine that decides on its own rows, checks the servers' step, and follows it."""

    def __init__(self, rule_of, records: StepRecords) -> None:
        super().__init__(rule_of)
        self.records = records
        self.steps: list[dict] = []

    def open_rule(self, rule: RoundRule, G: Any, t: int) -> torch.Tensor:
        own = super().open_rule(rule, G, t).numpy()
        step = self.records.load(len(self.steps))
        if step.t != t or step.aggregator != rule.aggregator or step.rows.shape != tuple(G.shape):
            raise ValueError(f"robust round {len(self.steps)}: the twin replays round {t} ({rule.aggregator}, "
                             f"{tuple(G.shape)}), the servers replayed round {step.t} ({step.aggregator}, "
                             f"{step.rows.shape})")
        rows = torch.from_numpy(step.rows)
        on_theirs = super().open_rule(rule, rows, t).numpy()
        bound = (np.zeros(step.opened.shape) if rule.aggregator == "brace-sign"
                 else fedseca_error_bound(rows).numpy())
        self.steps.append({
            "t": t, "aggregator": rule.aggregator, "clients": int(G.shape[0]),
            "rows_max_diff": float(np.abs(step.rows - G.numpy()).max()),
            # > 0: the servers opened something the rule does not give on their own rows
            "rule_excess": float((np.abs(on_theirs - step.opened) - bound).max()),
            "twin_decision_differs": float((np.abs(own - step.opened) > bound).mean()),
        })
        return torch.from_numpy(step.opened)


def step_check(cfg: SyntheticConfig, data_path: str, method: str, t_delta: int, party0: dict, party1: dict,
               aggregator: str, quiet: bool = True) -> dict:
    """The lockstep twin on the servers' records (module docstring): per-round rows and rule
    checks, then rounds, flags and the model against the servers' (``party0``'s result)."""
    records = StepRecords(party0["step_records"], party1["step_records"])
    hist = SyntheticHistory(cfg, load_data(data_path), None)
    params = StarfishParams(sigma=cfg.sigma, beta=cfg.beta, buffer=cfg.buffer, method=method, t_delta=t_delta)
    combine = LockstepCombine(rule_of(aggregator), records)
    t0 = time.perf_counter()
    with progress.progress(None, "lockstep twin", quiet=quiet, unit="round") as bar:
        plain = run_stage2(None, hist, list(cfg.targets), params, SyntheticClients(hist),
                           progress=progress.callback(bar), combine=combine)
    steps = combine.steps
    diff = float(np.abs(plain.model.double().numpy() - party0["model"].astype("float64")).max())
    rows = max((s["rows_max_diff"] for s in steps), default=0.0)
    excess = max((s["rule_excess"] for s in steps), default=float("-inf"))
    out = {
        "robust_rounds": len(steps), "recorded_rounds": len(records),
        "rows_max_diff": rows, "rule_max_excess": excess,
        "rule_held": excess <= 0.0,
        "twin_decision_differs_max": max((s["twin_decision_differs"] for s in steps), default=0.0),
        "selected_rounds_equal": plain.selected_rounds == party0["selected_rounds"],
        "flags_equal": {str(k): v for k, v in plain.flags.items()} == party0["flags"],
        "max_abs_diff": diff, "target": TARGET_PLAINTEXT_DIFF, "steps": steps,
        "seconds": time.perf_counter() - t0,
    }
    out["met"] = (len(steps) == len(records) and out["rule_held"] and rows <= TARGET_PLAINTEXT_DIFF
                  and out["selected_rounds_equal"] and out["flags_equal"] and diff <= TARGET_PLAINTEXT_DIFF)
    return out


def prune_records(root: str | Path, keep: set[str]) -> None:
    """Remove every run's records under ``root`` but those in ``keep`` (the cached compute run's)."""
    root = Path(root)
    if root.is_dir():
        for d in root.iterdir():
            if str(d) not in keep:
                shutil.rmtree(d, ignore_errors=True)
