"""Starting the service's daemons as real processes on loopback, for the service tests."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from clients.service_client import ServiceClient
from net.channel import ChannelError
from common.service_config import ServiceConfig, load_config, write_scratch_deployment
from starfish.demo import ProcessGroup


class Deployment:
    """A scratch deployment plus the processes started for it (stopped by ``close``).

    Dealer mode unless a test asks for two-party (the product's default): most service tests are
    about the daemons, not the correlations, and a dealer session costs seconds less to start;
    the two-party service has tests of its own (``test_service_two_party.py`` and others)."""

    def __init__(self, root: Path, *, clients: int, overrides: dict[str, dict[str, Any]],
                 offline: str = "dealer") -> None:
        self.root = root
        self.config_path = write_scratch_deployment(root, clients=clients, overrides=overrides,
                                                    offline=offline)
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
