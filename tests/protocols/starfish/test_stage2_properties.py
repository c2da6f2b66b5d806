"""Property: Stage II under 2PC equals its plaintext twin on random small lab configurations.

Each example builds a lab (digits, logreg or mlp), runs FedAvg, then Stage II twice on the same
history: in plaintext (``run_stage2(None, ...)`` with a ``PoolClients``) and under 2PC
(``bench.secure_lab.run_secure_starfish``: two server processes, TLS, dealer; one live
``PartyPair`` for all examples, whose parties keep the lab's data loaded). Both must select
the same rounds, raise the same correction flags, and end within ``MODEL_TOLERANCE`` (max abs
over the parameters) of each other.

Drawn: clients 3..8, rounds 4..12, one to three targets, sigma, alpha, beta, B in 1..3, the
round-selection method (ratio, divide, or auto with t_delta 0 -> divide or t_delta 10**6 ->
ratio), the model, local epochs and whether the targets carry the backdoor.

Cost: every example runs FL and a 2PC Stage II (about 5-10 s), so the number of examples is a
fraction of the active hypothesis profile's: ``default`` (30) -> 7 generated examples plus the
explicit ones below (about 70 s when all pass; 12 took 105 s, over the suite's budget),
``thorough`` (``--hypothesis-profile=thorough``, 400) -> 100 (about 10 minutes). Shrinking is
off (each shrink step is another 2PC run); a failure names its whole configuration and the
figures that differ instead (plaintext cosine ranking near the cut for RS, the differing
checks for TC, the parameter difference and each client's newest L-BFGS pair for UE).

Found (pinned as explicit examples) and fixed: with the mlp, a client's newest pair could have
y^T s ~ 0 or < 0 (cos(y, s) ~ 1e-3 or negative: the curvature condition of L-BFGS fails on a
non-convex model); the *plaintext* estimate was then 30 to over 1000 times the stored update and
fixed point could not follow it. Pairs are now kept only if cos(y, s) >= 0.01
(``protocols/starfish/pair_buffers.py``). Public decisions closer to their boundary than the
fixed-point grid can resolve (RS cut, a threshold check, the pair test) can legitimately come out
differently; such examples are discarded (``RS_MARGIN``, ``TC_MARGIN``, ``PAIR_MARGIN``) and
reported as hypothesis events. Inherent and not excluded: the mlp's exact local update is
discontinuous in the model (ReLU), so a 2**-16-scale model difference can change a client's exact
update by ~2e-2.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import numpy as np
import torch
from hypothesis import Phase, assume, event, example, given, note, settings
from hypothesis import strategies as st

torch.set_num_threads(1)

MODEL_TOLERANCE = 1e-2
#: A public decision whose plaintext margin is below these cannot be expected to come out the
#: same in 16-bit fixed point (values closer than the grid are equal there): such examples are
#: discarded (hypothesis ``assume``) and counted as an ``event``, never compared.
RS_MARGIN = 1e-3        # gap between the k-th and (k+1)-th cosine key
TC_MARGIN = 1e-3        # |max |g_hat| - delta| / delta of a client at a check
PAIR_MARGIN = 1e-3      # |cos(y, s) - MIN_COSINE| of an offered L-BFGS pair
EXAMPLES = max(1, settings.default.max_examples // 4)   # default 20 -> 5, thorough 400 -> 100
T_DELTA = {"small": 0, "large": 10**6}                  # auto: T >= 0 -> divide; T < 10**6 -> ratio


@dataclass(frozen=True)
class Config:
    clients: int
    rounds: int
    targets: tuple[int, ...]
    sigma: float
    alpha: float
    beta: float
    buffer: int
    method: str
    t_delta: str          # "small" | "large" (only read under method="auto")
    model: str
    epochs: int
    backdoor: bool
    seed: int

    def lab_argv(self) -> list[str]:
        argv = ["--dataset", "digits", "--clients", str(self.clients), "--rounds", str(self.rounds),
                "--targets", ",".join(map(str, self.targets)), "--model", self.model,
                "--epochs", str(self.epochs), "--train-limit", str(30 * self.clients),
                "--test-limit", "60", "--alpha", str(self.alpha), "--sigma", str(self.sigma),
                "--beta", str(self.beta), "--buffer", str(self.buffer),
                "--rs-method", self.method, "--method", "starfish", "--seed", str(self.seed),
                "--quiet"]
        return argv + ([] if self.backdoor else ["--no-backdoor"])


@st.composite
def configs(draw) -> Config:
    clients = draw(st.integers(3, 8))
    n_targets = draw(st.integers(1, min(3, clients - 1)))
    targets = tuple(sorted(draw(st.sets(st.integers(0, clients - 1), min_size=n_targets,
                                        max_size=n_targets))))
    rate = lambda lo: st.floats(lo, 1.0).map(lambda x: round(x, 3))  # noqa: E731
    return Config(
        clients=clients, rounds=draw(st.integers(4, 12)), targets=targets,
        sigma=draw(rate(0.1)), alpha=draw(st.floats(0.0, 0.9).map(lambda x: round(x, 3))),
        beta=draw(rate(0.05)), buffer=draw(st.integers(1, 3)),
        method=draw(st.sampled_from(["ratio", "divide", "auto"])),
        t_delta=draw(st.sampled_from(["small", "large"])),
        model=draw(st.sampled_from(["logreg", "mlp"])), epochs=draw(st.integers(1, 2)),
        backdoor=draw(st.booleans()), seed=draw(st.integers(0, 3)),
    )


def _params(cfg: Config):
    from protocols.starfish import StarfishParams

    return StarfishParams(sigma=cfg.sigma, alpha=cfg.alpha, beta=cfg.beta, buffer=cfg.buffer,
                          method=cfg.method, t_delta=T_DELTA[cfg.t_delta])


def _rs_figures(history, targets: list[int], k: int) -> str:
    """Plaintext cosine of every round with the targets' (weighted) update, ranked, cut marked."""
    rows = []
    for i in range(1, history.num_rounds + 1):
        w = history.weights(i)
        total = sum(w[t] for t in targets)
        g = sum((w[t] / total) * torch.as_tensor(history.update(i, t)).double() for t in targets)
        dm = torch.as_tensor(history.model_delta(i)).double()
        cos = float(torch.dot(g, dm) / (g.norm() * dm.norm())) if g.norm() * dm.norm() > 0 else 0.0
        rows.append((cos, i, float(g.norm()), float(dm.norm())))
    rows.sort(key=lambda r: (-r[0], r[1]))
    lines = [f"{'*' if n < k else ' '} round {i:>2}: cos {c:+.6f}  |g| {gn:.4g}  |dM| {dn:.4g}"
             for n, (c, i, gn, dn) in enumerate(rows)]
    return "plaintext ranking (* = the top k={}):\n".format(k) + "\n".join(lines)


def _run(cfg: Config, pair=None) -> dict:
    from bench import lab, secure_lab
    from lab import experiment
    from protocols.starfish import run_stage2
    from protocols.starfish.ports import remaining_clients
    from lab.fl import run_federated
    from lab.recovery.base import ClientPool, PoolClients

    parser = argparse.ArgumentParser()
    lab.add_arguments(parser)
    args = parser.parse_args(cfg.lab_argv())
    setup = experiment.build_setup(args)
    history = run_federated(setup.participants, setup.m0, args.rounds, setup.cfg.get("lr"))
    params = _params(cfg)
    pool = ClientPool(setup.participants, remaining_clients(history, setup.targets))
    with _decision_margins() as margins:
        plain = run_stage2(None, history, setup.targets, params, PoolClients(pool))
    near = _near_boundary(margins)
    if near:
        event(f"discarded: a decision within the fixed-point grid ({near})")
    assume(not near)
    out = secure_lab.run_secure_starfish(args, history, setup.targets, params, timeout=600.0, pair=pair)
    return {"history": history, "params": params, "targets": setup.targets, "plain": plain,
            "values": out["values"], "participants": setup.participants}


class _decision_margins:
    """Record the plaintext margin of every public decision of one Stage II run."""

    def __enter__(self) -> dict:
        from protocols.starfish import pair_buffers, round_selection, stage2

        self.mods = (round_selection, stage2, pair_buffers)
        self.orig = (round_selection.select_rounds, stage2.check_thresholds, pair_buffers.curvature_ok)
        margins: dict = {"rs": [], "tc": [], "pairs": []}

        def select_rounds(u, v, k, *a, **kw):
            keys = np.sort((torch.as_tensor(u).double() / torch.as_tensor(v).double()).numpy())[::-1]
            if 0 < k < len(keys):
                margins["rs"].append(float(keys[k - 1] - keys[k]))
            return self.orig[0](u, v, k, *a, **kw)

        def check_thresholds(est, thr):
            e = torch.as_tensor(est).double().abs().amax(dim=-1)
            d = torch.as_tensor(thr).double()
            margins["tc"].extend(float(x) for x in ((e - d).abs() / d.clamp(min=1e-12)))
            return self.orig[1](est, thr)

        def curvature_ok(s, ys, min_cos=pair_buffers.MIN_COSINE, masked=None):
            for y in ys:
                y = torch.as_tensor(y).double()
                den = float(y.norm() * s.double().norm())
                if den > 0:
                    margins["pairs"].append(abs(float(y @ s.double()) / den - min_cos))
            return self.orig[2](s, ys, min_cos, masked)

        round_selection.select_rounds = select_rounds
        stage2.check_thresholds = check_thresholds
        pair_buffers.curvature_ok = curvature_ok
        # starfish_select resolved select_rounds at import time in its own module (patched above)
        return margins

    def __exit__(self, *exc) -> None:
        rs, st2, pb = self.mods
        rs.select_rounds, st2.check_thresholds, pb.curvature_ok = self.orig


def _near_boundary(m: dict) -> str:
    for name, limit in (("rs", RS_MARGIN), ("tc", TC_MARGIN), ("pairs", PAIR_MARGIN)):
        if m[name] and min(m[name]) < limit:
            return f"{name} margin {min(m[name]):.2e} < {limit:g}"
    return ""


def _ue_figures(run: dict) -> str:
    """Per plaintext UE call: the curvature of each client's newest pair and how far the estimate
    strays from the stored update (an estimate many times the update comes from y^T s ~ 0)."""
    from protocols.starfish import replay as replay_mod
    from protocols.starfish import run_stage2
    from protocols.starfish.ports import remaining_clients
    from lab.recovery.base import ClientPool, PoolClients

    rest = remaining_clients(run["history"], run["targets"])
    lines, original = [], replay_mod.estimate_updates

    def recording(stored, s, S, Y, inverse=None, **kw):
        est = original(stored, s, S, Y, inverse, **kw)
        stored_t = torch.as_tensor(stored).double()
        for r, j in enumerate(rest):
            sk, yk = S[r, :, -1].double(), torch.as_tensor(Y)[r, :, -1].double()
            cos = float(yk @ sk / (yk.norm() * sk.norm())) if yk.norm() * sk.norm() > 0 else 0.0
            lines.append(f"  UE call {len(lines) // len(rest) + 1}, client {j}: newest pair y^T s "
                         f"{float(yk @ sk):+.3e}, cos(y, s) {cos:+.2e}; max |estimate| "
                         f"{float(est[r].abs().max()):.3g} vs max |stored| {float(stored_t[r].abs().max()):.3g}")
        return est

    replay_mod.estimate_updates = recording
    try:
        pool = ClientPool(run["participants"], rest)
        run_stage2(None, run["history"], run["targets"], run["params"], PoolClients(pool))
    finally:
        replay_mod.estimate_updates = original
    return "plaintext update estimation:\n" + "\n".join(lines)


def _compare(cfg: Config, run: dict) -> list[str]:
    """Every disagreement between the 2PC run and the plaintext twin, with its figures."""
    plain, (v0, v1) = run["plain"], run["values"]
    problems = []
    if not np.array_equal(v0["model"], v1["model"]):
        problems.append("the two servers revealed different models")
    if v0["selected_rounds"] != plain.selected_rounds or v1["selected_rounds"] != plain.selected_rounds:
        k = run["params"].num_selected(run["history"].num_rounds)
        problems.append(f"RS: 2PC selected {v0['selected_rounds']} (server 1: {v1['selected_rounds']}), "
                        f"plaintext {plain.selected_rounds}\n"
                        + _rs_figures(run["history"], run["targets"], k))
    flags = {int(s): ids for s, ids in v0["flags"].items()}
    if flags != plain.flags:
        steps = sorted(set(flags) | set(plain.flags))
        diff = [f"step {s}: 2PC {flags.get(s)} plaintext {plain.flags.get(s)}" for s in steps
                if flags.get(s) != plain.flags.get(s)]
        problems.append("TC: flags differ at " + "; ".join(diff))
    gap = np.abs(np.asarray(v0["model"], dtype=np.float64) - plain.model.double().numpy())
    if float(gap.max()) >= MODEL_TOLERANCE:
        problems.append(f"UE: max |2PC - plaintext| = {float(gap.max()):.3e} at parameter "
                        f"{int(gap.argmax())} (tolerance {MODEL_TOLERANCE}); plaintext |M| "
                        f"{float(plain.model.double().abs().max()):.3g}; warm-up steps 2PC "
                        f"{v0['warmup_steps']} plaintext {plain.warmup_steps}; estimated updates "
                        f"2PC {v0['estimated_updates']} plaintext {plain.estimated_updates}\n"
                        + _ue_figures(run))
    return problems


SPLIT = Config(clients=4, rounds=12, targets=(0, 1, 3), sigma=0.485, alpha=0.0, beta=0.128, buffer=2,
               method="auto", t_delta="small", model="mlp", epochs=1, backdoor=False, seed=2)


@settings(max_examples=EXAMPLES, phases=[Phase.explicit, Phase.generate])
# Disagreements found by this test (mlp, UE; see the report in the module docstring): pinned so
# that they run whatever examples the generator draws.
@example(Config(clients=5, rounds=5, targets=(3, 4), sigma=1.0, alpha=0.651, beta=1.0, buffer=2,
                method="ratio", t_delta="large", model="mlp", epochs=2, backdoor=True, seed=3))
@example(Config(clients=6, rounds=10, targets=(0,), sigma=0.5, alpha=0.0, beta=0.156, buffer=1,
                method="divide", t_delta="small", model="mlp", epochs=2, backdoor=False, seed=3))
@example(Config(clients=5, rounds=8, targets=(1, 2, 4), sigma=0.6, alpha=0.4, beta=0.25, buffer=2,
                method="auto", t_delta="small", model="mlp", epochs=1, backdoor=True, seed=1))
@example(Config(clients=4, rounds=6, targets=(0,), sigma=0.5, alpha=0.1, beta=0.2, buffer=1,
                method="auto", t_delta="large", model="logreg", epochs=1, backdoor=False, seed=0))
# Found 2026-11-27 when the example count was lowered and hypothesis drew another set; cause
# found the same day: with 3 of 4 clients forgotten, the last client's threshold check at step 6
# comes out flagged in plaintext (max |g_hat| 0.406 against delta 0.3575) and not under 2PC
# (0.338), and the models then differ by 5.5e-2. Neither UE nor TC is wrong: on the plaintext
# run's own inputs of that step (stored updates, s, S, Y, delta) the 2PC estimate is within
# 3.4e-4 of the plaintext one and flags the client too. The two runs' models had already split
# at step 3, an exact step: after steps 1-2 they differ only by the fixed-point encoding of the
# client's uploaded updates (~1e-5), and the MLP's exact update from those two models differs
# (aggregate sums -9.850 plaintext, -9.432 2PC, norms 0.8773 and 0.8776): the discontinuity of
# the module docstring ("Inherent and not excluded"). Pinned as an expected failure: hypothesis
# fails the run if it starts passing.
@example(SPLIT).xfail(raises=AssertionError, reason="the MLP trajectory splits at an exact step (see the comment)")
@given(cfg=configs())
def test_secure_stage2_equals_plaintext_twin(pair, cfg: Config):
    note(f"config: {asdict(cfg)}")
    # the fixed seed draws SPLIT again among the first generated examples at every count below 12
    # (7 and 8 tried): it is the pinned expected failure above, not a new finding
    if cfg == SPLIT:
        event("the pinned trajectory split drawn again")
        assume(False)
    run = _run(cfg, pair)     # one live pair of parties for every example (conftest's ``pair``)
    problems = _compare(cfg, run)
    assert not problems, f"config {asdict(cfg)}\n" + "\n".join(problems)
