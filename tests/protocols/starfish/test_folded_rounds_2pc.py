"""Folded replay rounds (issue 26) where the divergence guard redoes the round and a client gives
no answer: its estimate, never formed on its own in a folded round, is formed then. Oracle: the
same replay in the clear (its rounds never fold), on the same history and clients.

Both offline modes; only two-party mode folds (the dealer mode keeps its masked columns), so the
dealer run is the control that the scenario itself is replayed alike.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

import bench.lab as lab_cli
from bench.secure_lab import split_history
from common.prg import new_seed
from lab.fl import run_federated
from lab.recovery.base import ClientPool, PoolClients
from protocols.starfish.ports import remaining_clients
from tests.helpers import folded_programs

torch.set_num_threads(1)
ABSENT, SINCE = 2, 4      # client 2 answers in the warm-up (rounds 1-3), then never


@pytest.fixture(scope="module")
def lab():
    parser = argparse.ArgumentParser()
    lab_cli.add_arguments(parser)
    args = parser.parse_args(["--dataset", "digits", "--model", "logreg", "--clients", "4", "--rounds", "6",
                              "--train-limit", "160", "--test-limit", "50", "--seed", "7", "--quiet"])
    setup = lab_cli.build_setup(args)
    history = run_federated(setup.participants, setup.m0, args.rounds, setup.cfg.get("lr"), trainer=setup.trainer)
    rest = remaining_clients(history, [0])
    pool = ClientPool(setup.participants, rest, setup.trainer)
    plain = folded_programs.replay_all(history, rest, folded_programs.WithoutAnswer(PoolClients(pool), ABSENT, SINCE))
    return args, history, rest, plain


@pytest.mark.parametrize("offline", ["dealer", "two-party"])
def test_a_redone_folded_round_keeps_the_absent_clients_estimate(session_of, lab, offline):
    args, history, rest, plain = lab
    # the scenario: the guard redid every estimated round, and the absent client was asked in them
    estimated = [s for s, ids in plain["exact"].items() if s in plain["guard_steps"]]
    assert estimated and all(ABSENT in plain["absent"][s] for s in estimated)
    lab_args = {k: v for k, v in vars(args).items() if k != "func"}
    out0, out1 = session_of(offline).call(folded_programs.secure_program, split_history(history), lab_args,
                                          new_seed(), history.model(0).double().numpy(),
                                          float(history.server_lr), rest, ABSENT, SINCE)
    for out in (out0, out1):
        assert out["guard_steps"] == plain["guard_steps"]
        assert {int(k): v for k, v in out["absent"].items()} == plain["absent"]
        assert np.abs(out["model"] - plain["model"]).max() < 1e-3
    assert np.array_equal(out0["model"], out1["model"])
