"""Starting the service's daemons as real processes on loopback, for the service tests."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from clients.initial_model import initial_model
from clients.service_client import ServiceClient
from net.channel import ChannelError
from common.service_config import ServiceConfig, load_config, write_scratch_deployment
from servers.store.share_store import ShareStore
from servers.workers.shard_store_files import local_files
from starfish.demo import ProcessGroup


class Deployment:
    """A scratch deployment plus the processes started for it (stopped by ``close``).

    Dealer mode unless a test asks for two-party (the product's default): most service tests are
    about the daemons, not the correlations, and a dealer session costs seconds less to start;
    the two-party service has tests of its own (``test_service_two_party.py`` and others)."""

    def __init__(self, root: Path, *, clients: int, overrides: dict[str, dict[str, Any]],
                 offline: str = "dealer", workers: int = 1) -> None:
        self.root = root
        self.config_path = write_scratch_deployment(root, clients=clients, overrides=overrides,
                                                    offline=offline, workers=workers)
        self.cfg: ServiceConfig = load_config(self.config_path)
        self.procs = ProcessGroup(root / "logs")
        self.env = {k: v for k, v in os.environ.items() if k != "STARFISH_CRASH_AT"}

    @classmethod
    def open_existing(cls, root: Path) -> Deployment:
        """A deployment whose keys, config and data are already in ``root`` (e.g. a copy)."""
        dep = cls.__new__(cls)
        dep.root = root
        dep.config_path = root / "config.toml"
        dep.cfg = load_config(dep.config_path)
        dep.procs = ProcessGroup(root / "logs")
        dep.env = {k: v for k, v in os.environ.items() if k != "STARFISH_CRASH_AT"}
        return dep

    def start(self, name: str, argv: list[str], crash_at: str | None = None):
        env = dict(self.env)
        if crash_at:
            env["STARFISH_CRASH_AT"] = crash_at
        return self.procs.start(name, argv + ["--config", str(self.config_path)], env)

    def start_server(self, party: int, crash_at: str | None = None):
        return self.start(f"server{party}", ["server", "--party", str(party)], crash_at)

    def store(self, party: int) -> ShareStore:
        """Server ``party``'s store, opened here (its daemon stopped); with workers, their shard
        directories are read from this machine (``servers.workers.shard_store_files.local_files``)."""
        shards = None
        if self.cfg.workers > 1:
            shards = local_files(self.cfg, party, int(initial_model(self.cfg.model).size))
        return ShareStore(self.cfg.data_dir(party) / "store", party=party, shards=shards)

    def client(self, identity: str, party: int, **kw: Any) -> ServiceClient:
        return ServiceClient(self.cfg.keys_dir, identity, party, self.cfg.server(party).api().address,
                             max_bytes=self.cfg.limits.max_frame_bytes, **kw)

    def wait_ready(self, parties=(0, 1), timeout: float = 60.0) -> None:
        """Poll each server's API as admin until it answers (fails fast if it died)."""
        deadline = time.monotonic() + timeout
        for p in parties:
            while True:
                proc = self.procs.procs[f"server{p}"]
                assert proc.poll() is None, self.log(f"server{p}")
                assert time.monotonic() < deadline, f"server{p} not ready\n{self.log(f'server{p}')}"
                try:
                    with self.client("admin", p, connect_timeout=1.0) as c:
                        c.call("status")
                    break
                except ChannelError:
                    continue  # connect() itself waited up to a second for the port

    def log(self, name: str, lines: int = 40) -> str:
        path = self.root / "logs" / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def close(self) -> None:
        self.procs.stop_all()


def job_model(rec: dict) -> Any:
    """The model of a ``job_status`` reply (``with_model=True``) as a numpy array."""
    from common import wire  # noqa: PLC0415
    return wire.decode_tensor(rec["model"], "model", ("<f8",), tuple(rec["model"]["shape"]))


def stage2_twin(dep: Deployment, summary: dict, result: dict, targets: list[int], clients: int,
                erased: tuple[int, ...] = ()) -> Any:
    """The plaintext Stage II of a job the servers ran (``result``: its ``job_status`` result):
    the same rounds of the clients' twin history, less ``erased``, with the same parameters and
    the simulated clients' exact updates (the oracle of the service tests)."""
    import argparse  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from clients.simulator import build_federation  # noqa: PLC0415
    from lab.history import NpzHistory  # noqa: PLC0415
    from protocols.starfish import run_stage2  # noqa: PLC0415
    from protocols.starfish.ports import history_prefix, without_clients  # noqa: PLC0415
    from servers.secure.unlearning_jobs import starfish_params  # noqa: PLC0415
    from starfish.service_commands import federation_spec  # noqa: PLC0415

    args = argparse.Namespace(dataset=None, data_dir=None, n=clients, seed=None, backdoor="0",
                              epochs=None, lr=None, train_limit=None)
    fed = build_federation(federation_spec(dep.cfg, args))

    class Plain:
        def exact_updates(self, r, model, ids):
            return {j: fed.clients[j].train(model, r).update.to(torch.float64) for j in ids}

    seen = without_clients(history_prefix(NpzHistory(summary["twin_dir"]), result["rounds"]), erased)
    return run_stage2(None, seen, list(targets), starfish_params(dep.cfg), Plain())
