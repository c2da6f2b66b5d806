"""docs/protocol.md is enough to write a client: tests/helpers/doc_only_client.py, written from it
alone (no import of this project), joins a real deployment (dealer and both servers as processes),
uploads in both share forms, answers correction tasks, is forgotten and checks its receipt."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from tests.helpers import doc_only_client
from tests.helpers.doc_only_client import DocOnlyClient, Refused
from tests.helpers.service_harness import Deployment

ROUNDS = 4


def test_the_doc_only_client_imports_nothing_of_this_project():
    tree = ast.parse(Path(doc_only_client.__file__).read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    allowed = {"__future__", "hashlib", "os", "socket", "ssl", "struct", "time", "pathlib", "typing",
               "msgpack", "numpy"}
    assert roots <= allowed, roots - allowed


def _wait(what, cond, timeout: float = 120.0, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(step)


@pytest.fixture
def deployment(tmp_path):
    dep = Deployment(tmp_path, clients=2,
                     overrides={"fl": {"rounds": ROUNDS, "clients_expected": 2, "round_deadline": 120.0}})
    dep.start("dealer", ["dealer"])
    dep.start_server(1)
    dep.start_server(0)
    try:
        dep.wait_ready(timeout=120)
        yield dep
    finally:
        dep.close()


def test_doc_only_client_joins_uploads_both_forms_corrects_and_is_forgotten(deployment):
    dep = deployment
    addresses = [dep.cfg.server(p).api().address for p in (0, 1)]
    clients = [DocOnlyClient(i, dep.cfg.keys_dir, addresses) for i in (0, 1)]
    target, other = clients
    try:
        st = target.state
        assert st["alpha"] == dep.cfg.unlearning.alpha and st["dim"] == 650
        assert [p["shape"] for p in st["model"]["layout"]] == [[10, 64], [10]]

        for r in range(1, ROUNDS + 1):
            for c in clients:   # full shares and seeds, alternating between the clients and rounds
                assert c.upload_round(seed_form=(r + c.id) % 2 == 1) == r
            _wait(f"round {r}", lambda: all(s["T"] == r for s in target.both("state")))
            info = target.conns[1].request("round_info", round=r)
            assert info["participants"] == [0, 1] and info["refused"] == [], (info, dep.log("server0"))

        job = "forget-doc-client-0"
        target.request_unlearning(job)
        answered = 0

        def finished() -> bool:
            nonlocal answered
            answered += other.answer_tasks(seed_form=answered % 2 == 1)
            states = [r["state"] for r in target.both("job_status", job=job)]
            assert "failed" not in states, dep.log("server0")
            return all(s == "done" for s in states)

        _wait("the unlearning job", finished, timeout=300, step=0.5)
        assert answered >= 1, "no correction task reached the remaining client"
        receipt = target.receipt_checks(job)
        assert receipt["clients"] == [0] and receipt["rounds_erased"] == list(range(1, ROUNDS + 1))
        assert target.conns[0].request("state")["forgotten"] is True
        with pytest.raises(Refused) as exc:
            target.upload_round(seed_form=False)
        assert exc.value.code in ("forgotten", "closed")
    finally:
        for c in clients:
            c.close()
