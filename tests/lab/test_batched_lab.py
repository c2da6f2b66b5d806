"""The lab with its clients trained together equals the lab training them one after another.

Oracle: the same FL run and the same unlearning methods with the default trainer
(``lab.fl.SequentialTrainer``: ``p.train`` one participant after another). Models are float64
so that the two computations differ only by summation order; every method must then reach the
same model and report the same client work, and the batched trainer must really have batched
(a spy counts the clients of each batched group).
"""

from __future__ import annotations

import pytest
import torch

from clients.attacks import AlieClient, ScalingClient
from clients.backdoor import BackdoorClient, default_trigger
from clients.batched_training import ClientTrainer
from clients.models import build_model, flatten_params
from clients.training import LocalClient
from lab.fl import SequentialTrainer, run_federated
from lab.recovery import FedEraser, FedRecover, Retrain, Starfish
from lab.recovery.base import ClientPool
from lab.recovery.crab import Crab
from lab.recovery.fedadp import FedADP
from protocols.starfish.params import StarfishParams

torch.set_num_threads(1)

SHAPE = (1, 4, 4)


class SpyTrainer(ClientTrainer):
    """A batched trainer that records how many clients each batched program trained."""

    def __init__(self) -> None:
        super().__init__("auto")
        self.group_sizes: list[int] = []

    def _train_group(self, key, jobs, round_idx, tracker):
        self.group_sizes.append(len(jobs))
        return super()._train_group(key, jobs, round_idx, tracker)


def federation(attack: str = "none"):
    def factory():
        return build_model("mlp", SHAPE, 3, l2=1e-2, hidden=6)().double()

    gen = torch.Generator().manual_seed(7)
    clients = []
    for j, n in enumerate([24, 17, 30, 9, 21]):
        x = torch.rand(n, *SHAPE, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (n,), generator=gen)
        clients.append(LocalClient(j, x, y, factory, epochs=2, lr=0.1, batch_size=8, alpha=0.4, seed=1))
    clients[0] = BackdoorClient.from_clean(clients[0], default_trigger(SHAPE), 0, 0.5, boost=3.0, seed=1)
    if attack == "scaling":
        clients[1] = ScalingClient(clients[1], scale=5.0)
    if attack == "alie":
        clients[1] = AlieClient(clients[1], seed=1)
    torch.manual_seed(0)
    return clients, flatten_params(factory())


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-9) -> bool:
    return float((a - b).abs().max()) <= rtol * max(1.0, float(a.abs().max()))


@pytest.mark.parametrize("attack", ["none", "scaling", "alie"])
def test_fl_batched_equals_one_after_another(attack):
    clients, m0 = federation(attack)
    spy = SpyTrainer()
    seq = run_federated(clients, m0, 4, 0.1)
    bat = run_federated(clients, m0, 4, 0.1, trainer=spy)
    for t in range(1, 5):
        assert close(seq.model(t), bat.model(t))
        for j in seq.participants(t):
            assert close(torch.as_tensor(seq.update(t, j)), torch.as_tensor(bat.update(t, j)))
    # every round trained its non-omniscient clients as one batched program
    trained = 4 if attack == "alie" else 5
    assert spy.group_sizes == [trained] * 4


METHODS = {
    "retrain": Retrain,
    "federaser": FedEraser,
    "fedrecover": lambda: FedRecover(buffer=2, beta=0.25, warmup=2, final_tuning=1),
    "crab": Crab,
    "fedadp": lambda: FedADP(seed=3),
    "starfish": lambda: Starfish(StarfishParams(sigma=0.6, alpha=0.4, beta=0.25, buffer=2)),
}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_batched_equals_one_after_another(name):
    clients, m0 = federation()
    hist = run_federated(clients, m0, 6, 0.1)
    plain_model, plain_cost = METHODS[name]().unlearn(hist, [0], clients)
    method = METHODS[name]()
    method.trainer = spy = SpyTrainer()
    model, cost = method.unlearn(hist, [0], clients)
    assert close(plain_model, model)
    assert cost.client_computations == plain_cost.client_computations
    assert cost.client_epochs == plain_cost.client_epochs
    if cost.total_client_computations():
        assert spy.group_sizes and max(spy.group_sizes) > 1   # the requests were batched


def test_pool_counts_batched_requests_like_single_ones():
    clients, m0 = federation()
    one = ClientPool(clients, [1, 2, 3])
    many = ClientPool(clients, [1, 2, 3], ClientTrainer("batched"))
    singles = {j: one.exact(j, m0, 2, epochs=0.5 * j) for j in (1, 3)}
    batched = many.exact_many([1, 3], m0, 2, epochs={1: 0.5, 3: 1.5})
    assert all(close(singles[j], batched[j]) for j in (1, 3))
    assert one.computations == many.computations == {1: 1, 2: 0, 3: 1}
    assert one.epochs == many.epochs == {1: 0.5, 2: 0.0, 3: 1.5}
    assert SequentialTrainer().train([clients[2]], {2: m0}, 1, {2: None})[2].num_samples == 30
