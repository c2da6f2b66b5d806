"""The plaintext twin of a benchmark's Stage II: the same synthetic history in the clear.

Why a module of its own: ``bench unlearning`` (one process per server) and ``bench unlearning
--workers`` (coordinators and workers, ``bench/worker_unlearning.py``) hold their 2PC result to
the same oracle: ``run_stage2`` with ``party=None`` on the same history, the same rounds and
flags, and the model within ``TARGET_PLAINTEXT_DIFF``.
"""

from __future__ import annotations

import time

from protocols.starfish import StarfishParams, run_stage2
from protocols.starfish.robust_replay import RuleCombine

from . import progress
from .synthetic import SyntheticClients, SyntheticConfig, SyntheticHistory, load_data, rule_of

__all__ = ["TARGET_PLAINTEXT_DIFF", "replay_combine", "plaintext_check"]

TARGET_PLAINTEXT_DIFF = 1e-3   # max |2PC - plaintext| over the model (issue 12)


def replay_combine(aggregator: str, meter=None, observe=None) -> RuleCombine | None:
    """The replay's combine for a synthetic history made by ``aggregator`` (None: FedAvg);
    ``observe``: ``RuleCombine``'s (the step check's recorder)."""
    if aggregator == "fedavg":
        return None
    return RuleCombine(rule_of(aggregator), meter=meter, observe=observe)


def plaintext_check(cfg: SyntheticConfig, data_path: str, method: str, t_delta: int, party0: dict,
                    quiet: bool = True, aggregator: str = "fedavg") -> dict:
    """The plaintext twin (``run_stage2`` with ``party=None``) on the same synthetic history:
    same selected rounds, same flags, and max |2PC - plaintext| over the model."""
    hist = SyntheticHistory(cfg, load_data(data_path), None)
    params = StarfishParams(sigma=cfg.sigma, beta=cfg.beta, buffer=cfg.buffer, method=method, t_delta=t_delta)
    t0 = time.perf_counter()
    with progress.progress(None, "plaintext twin", quiet=quiet, unit="round") as bar:
        plain = run_stage2(None, hist, list(cfg.targets), params, SyntheticClients(hist),
                           progress=progress.callback(bar), combine=replay_combine(aggregator))
    gap = abs(plain.model.double().numpy() - party0["model"].astype("float64"))
    diff = float(gap.max())
    flags = {str(k): v for k, v in plain.flags.items()}
    return {"selected_rounds_equal": plain.selected_rounds == party0["selected_rounds"],
            "flags_equal": flags == party0["flags"], "max_abs_diff": diff,
            "target": TARGET_PLAINTEXT_DIFF, "met": diff <= TARGET_PLAINTEXT_DIFF,
            # a robust replay's opened votes / bits may differ where an estimate is within its
            # fixed-point error of 0 (protocols/starfish/robust_replay.py): the share of such coordinates
            "differing_fraction": float((gap > TARGET_PLAINTEXT_DIFF).mean()),
            # SecTC compares in a 32-bit ring: |g_hat| must stay below 2**14 (docs/protocols.md)
            "largest_estimate": plain.largest_estimate, "sectc_domain": float(2**14),
            "plaintext_seconds": time.perf_counter() - t0}


