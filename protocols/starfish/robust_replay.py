"""Stage II's replay of a robustly aggregated history with the rule that made each round.

Why: a history made by FedSECA or BRACE's sign vote (``[fl] aggregator``, the lab's
``--aggregator``) replayed as FedAvg lets every remaining Byzantine client's stored (or
estimated) update back in at full weight, updates the rule had outvoted in FL (docs/lab.md,
"Attacks and robust aggregators"). :class:`RuleCombine` is the replay's ``combine``
(``protocols.starfish.replay``): per replayed round t it applies the rule of round t to the
present clients' rows (estimates or exact updates), through ``protocols.robust_aggregation``,
which is written once over the plaintext twin and CrypTen shares. The lab
(``lab.aggregators.replay_rule``) and the servers (``servers.secure.unlearning_jobs``) build
the same object, so the twin and the 2PC job run the same lines.

Per replayed round (``rule_of(t)`` says which rule made round t, :class:`RoundRule`):

* ``fedavg``: sum_j w_j g_j with the renormalised weights, opened (the replay's own step);
* ``brace-sign``: BRACE's vote over the K present rows with lambda = lam, or lam_per_100 K / 100
  when lam is None (the rule's threshold for the replay's voters), opened, times the *FL
  round's* step scale / t**decay (``step``), so a replayed round moves as far as it did in FL;
* ``fedseca``: each row's sparsification threshold lambda_k = the gamma-quantile of its |g_hat|
  (``secure_quantile.secure_quantile_thresholds``: no client reported it for an estimate),
  then CRISE + RoCA (``robust_aggregation.fedseca``) with those thresholds, the aggregate
  opened, then server momentum in the clear: d = beta d_prev + (1 - beta) g_tilde, restarted
  (d_prev = 0) at the replay's first FedSECA round, after a replayed round of another rule, and
  at every round whose FL momentum restarted (``restart``: round 1, the round after an
  unlearning round), as in FL.

What is opened per round is the replayed direction, the same D values the FedAvg replay opens
(M_hat is public, so the direction is (M_hat_before - M_hat_after) / eta either way): BRACE's
+-1 vote, FedSECA's g_tilde (with momentum applied afterwards, in the clear). The thresholds,
signs, weights, clip factors, medians and counts stay shared.

Rows on coordinate shards (``protocols.starfish.on_shards``, ``[deployment] workers`` > 1): a BRACE
round's vote is coordinate-wise, so each worker pair votes on its shard and opens it
(``shard_steps.brace_program``, the same lines as below on the shard's coordinates); a FedSECA
round's thresholds, CRISE and clip norms sum over all coordinates, so each pair returns its
shares of its shard's parts and the coordinators add them (``ShardVector.fedseca_with``).

Rows in 2PC: an estimate is a raw sharing at 2F = 32 fractional bits (``update_estimation``);
the rules' bounded sign tests need 16-bit encodings below 2**14, so the estimated rows are
brought to F bits with one wrap-free truncation (within one unit; one call for all of them);
exact updates from the clients are already at F bits. Twin: the float64 rows as they are.

Accuracy against the twin. BRACE's vote and FedSECA's signs, keep bits and agreement bits are
exact functions of the encoded rows, so they equal the twin's wherever no row's estimate lies
within its fixed-point error (that of ``update_estimation`` plus the truncation's unit) of 0 or
of its threshold, and no vote total ends within that of BRACE's lambda. Where one does, one
coordinate of that round's direction differs: by 2 step for BRACE, by at most that
coordinate's clamp for FedSECA, and the runs go on from different models. The free-running
twin's distance is therefore reported as the fraction of coordinates that differ, not as an
elementwise bound. What is bounded, and checked at every replayed round by ``starfish bench
unlearning --aggregator`` (``bench/step_check.py``, the twin in lockstep with the servers):
the rows the servers feed the rule are within 1e-3 of the twin's on the same state, and the
opened value is the rule applied to those rows (exactly for BRACE, within
``robust_aggregation.fedseca_error_bound`` for FedSECA). ``observe`` is that check's hook.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from common.robust_rules import BRACE_LAMBDA, FEDSECA_BETA, FEDSECA_GAMMA, brace_lambda
from protocols import backend as B
from protocols.robust_aggregation import brace_sign, fedseca, momentum
from protocols.secure_quantile import secure_quantile_thresholds

from protocols.backend import reveal, weighted_sum
from protocols.sharded import is_sharded
from .replay import Meter, no_meter

__all__ = ["RoundRule", "RuleCombine", "FEDAVG", "rows_at_frac_bits"]

RULES = ("fedavg", "fedseca", "brace-sign")


@dataclass(frozen=True)
class RoundRule:
    """How one FL round was aggregated (public: the round's metadata or the lab's aggregator)."""

    aggregator: str = "fedavg"
    #: BRACE: the FL round's step factor scale / t**decay (``common.robust_rules.brace_step_scale``)
    step: float = 1.0
    #: BRACE: a fixed vote threshold, or None for ``lam_per_100`` per 100 voters
    lam: float | None = None
    lam_per_100: float = BRACE_LAMBDA
    #: FedSECA: sparsification factor and server momentum
    gamma: float = FEDSECA_GAMMA
    beta: float = FEDSECA_BETA
    #: FedSECA: the round's momentum restarted from zero in FL
    restart: bool = False

    def __post_init__(self) -> None:
        if self.aggregator not in RULES:
            raise ValueError(f"unknown aggregator {self.aggregator!r}; choose from {', '.join(RULES)}")

    def vote_lambda(self, voters: int) -> float:
        return brace_lambda(self.lam_per_100, voters) if self.lam is None else float(self.lam)


FEDAVG = RoundRule()


def rows_at_frac_bits(rows: list) -> Any:
    """The K rows stacked at F fractional bits (2PC: the raw 32-bit estimates truncated once)."""
    if not any(B.is_shared(r) for r in rows):
        return torch.stack([torch.as_tensor(r, dtype=torch.float64).reshape(-1) for r in rows])
    F = B.frac_bits()
    rows = [B.to_shared_like(r).reshape(-1) for r in rows]
    wide = [i for i, r in enumerate(rows) if B.bits_of(r) > F]
    if wide:
        top = max(B.bits_of(rows[i]) for i in wide)
        narrowed = B.rescale(B.stack([B.lift(rows[i], top) for i in wide]), F)
        for n, i in enumerate(wide):
            rows[i] = narrowed[n]
    return B.stack([B.lift(r, F) if B.bits_of(r) < F else r for r in rows])


class RuleCombine:
    """The replay's ``combine``: round t's rows under the rule ``rule_of(t)`` (module docstring).

    Callable as ``combine(rows, weights, present, t)``; returns the opened direction (float64).
    ``meter``: e.g. ``party.meter``; the rule's steps are metered inside the replay's
    ``aggregate`` step (``aggregate/rescale``, ``aggregate/quantile``, ``aggregate/signs``, ...).
    ``applied`` records (t, aggregator) per replayed round. ``observe(t, rule, G, opened)``, if
    given, sees each robust round's stacked rows and its opened value (before BRACE's step and
    FedSECA's momentum): the benchmark's step check (``bench/step_check.py``) records them there.
    """

    def __init__(self, rule_of: Callable[[int], RoundRule], meter: Meter | None = None,
                 observe: Callable[[int, RoundRule, Any, torch.Tensor], None] | None = None) -> None:
        self.rule_of = rule_of
        self.meter = meter or no_meter
        self.observe = observe
        self.buffer: torch.Tensor | None = None     # FedSECA's momentum after the last round
        self._last: str | None = None
        self.applied: list[tuple[int, str]] = []

    def reset(self) -> None:
        self.buffer, self._last, self.applied = None, None, []

    def __call__(self, rows: list, weights: list, present: list, t: int) -> torch.Tensor:
        rule = self.rule_of(t)
        self.applied.append((t, rule.aggregator))
        last, self._last = self._last, rule.aggregator
        if rule.aggregator == "fedavg":
            self.buffer = None
            return reveal(weighted_sum(rows, weights)).to(torch.float64)
        if any(is_sharded(r) for r in rows):
            opened = self._on_shards(rule, rows)
        else:
            with self.meter("rescale"):
                G = rows_at_frac_bits(rows)
            opened = self.open_rule(rule, G, t)
            if self.observe is not None:
                self.observe(t, rule, G, opened)
        if rule.aggregator == "brace-sign":
            return rule.step * opened
        prev = None if (rule.restart or last != "fedseca") else self.buffer
        self.buffer = momentum(prev, opened, beta=rule.beta)
        return self.buffer

    def _on_shards(self, rule: RoundRule, rows: list) -> torch.Tensor:
        """What a round of rows on coordinate shards (``protocols.starfish.on_shards``) opens, as
        :meth:`open_rule`: BRACE's vote is coordinate-wise, so each worker pair votes on its shard
        and opens it; FedSECA's thresholds, CRISE's S S^T and the clip norms sum over all
        coordinates, so each pair returns its shares of its shard's parts and the coordinators add
        them (``ShardVector.fedseca_with``). ``observe`` is not called: the rows stay at the workers."""
        if not all(is_sharded(r) for r in rows):
            raise ValueError("a round's rows are all on coordinate shards or none is")
        if rule.aggregator == "brace-sign":
            return rows[0].brace_with(rows, rule.vote_lambda(len(rows)))
        return rows[0].fedseca_with(rows, rule.gamma, self.meter)

    def open_rule(self, rule: RoundRule, G: Any, t: int) -> torch.Tensor:
        """What round ``t`` opens: BRACE's vote, FedSECA's g_tilde (float64, length D)."""
        if rule.aggregator == "brace-sign":
            vote = brace_sign(G, lam=rule.vote_lambda(G.shape[0]), meter=self.meter)
            with self.meter("open"):
                return reveal(vote).to(torch.float64)
        lam = secure_quantile_thresholds(G, rule.gamma, meter=self.meter)
        agg = fedseca(G, gamma=rule.gamma, thresholds=lam, meter=self.meter)
        with self.meter("open"):
            return reveal(agg).to(torch.float64)
