"""A full disk is a retryable refusal, and a forgotten client's `unlearn --wait` shows its
receipt (issue 25, finding 8).

Before: an upload during a full disk got ``internal`` (not retryable) and the simulated clients
exited on it (the store stayed consistent, nothing was lost); ``starfish unlearn --client ID
--job J --wait`` after the adoption exited 1 with "forgotten". Now the client API answers
``unavailable`` ("out of disk space; nothing was stored; retry later") for ENOSPC/EDQUOT and
SQLite's SQLITE_FULL, also when wrapped in another exception; ``ServiceClient.call(...,
retry_unavailable=True)``, which the simulator uses, re-sends it until its retry time is up; and
the command shows the job it names once the request is refused as ``forgotten``.
"""

from __future__ import annotations

import argparse
import errno
import sqlite3
import threading
import types

import pytest

from clients.service_client import ServiceClient, ServiceError
from common import wire
from servers.daemon.client_api import ClientAPI
from starfish import service_commands


def _api(fail: BaseException) -> ClientAPI:
    """A client API whose ``unlearn`` handler raises ``fail`` (the rest of the request path is real)."""
    api = ClientAPI.__new__(ClientAPI)
    api.party = 0
    api.max_bytes = 1 << 20
    api.cfg = types.SimpleNamespace(limits=types.SimpleNamespace(requests_per_second=50.0, request_burst=200))
    api._id_guard, api._id_locks, api._buckets = threading.Lock(), {}, {}
    api.state = types.SimpleNamespace(last_nonce=lambda who: 0, record_nonce=lambda who, n: None)
    api._authorize = lambda who, req: None

    def handler(who, f):
        raise fail
    api._ops = {"unlearn": handler}
    return api


def _wrapped() -> BaseException:
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("blob write failed") from inner
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize("fail", [OSError(errno.ENOSPC, "No space left on device"),
                                  OSError(errno.EDQUOT, "Disk quota exceeded"),
                                  sqlite3.OperationalError("database or disk is full"),
                                  _wrapped()], ids=["ENOSPC", "EDQUOT", "SQLITE_FULL", "wrapped"])
def test_a_full_disk_is_answered_unavailable_not_internal(fail):
    msg_id, payload = wire.make_request("unlearn", job="j-1", nonce=1)
    with pytest.raises(wire.WireError) as e:
        wire.check_reply(_api(fail).handle("client-1", payload), msg_id, 1 << 20)
    assert e.value.code == "unavailable" and "disk" in e.value.message


def test_another_failure_stays_internal():
    msg_id, payload = wire.make_request("unlearn", job="j-1", nonce=1)
    with pytest.raises(wire.WireError) as e:
        wire.check_reply(_api(RuntimeError("bug")).handle("client-1", payload), msg_id, 1 << 20)
    assert e.value.code == "internal"


def test_the_client_retries_unavailable_when_asked(monkeypatch):
    c = ServiceClient.__new__(ServiceClient)
    answers = [ServiceError("unavailable", "out of disk space")] * 2 + [{"ok": True, "stored": True}]
    sent = []

    def once(op, fields):
        sent.append(op)
        a = answers[len(sent) - 1]
        if isinstance(a, Exception):
            raise a
        return a
    monkeypatch.setattr(c, "_call_once", once, raising=False)
    assert c.call("upload", retry_seconds=5.0, retry_unavailable=True)["stored"] is True
    assert len(sent) == 3
    sent.clear()
    with pytest.raises(ServiceError):   # without the flag a reply is final, as before
        c.call("upload", retry_seconds=5.0)
    assert len(sent) == 1


class _Forgotten:
    """A server connection of a client whose job was adopted (it is forgotten now)."""

    def __init__(self, party: int) -> None:
        self.party = party

    def call(self, op, **fields):
        if op == "unlearn":
            raise ServiceError("forgotten", "client 3 was forgotten")
        assert op == "job_status" and fields["job"] == "j-3"
        return {"job": "j-3", "state": "done", "progress": 1.0, "requester": "client-3", "targets": [3],
                "receipt": {"adopted_round": 7, "clients": [3], "rounds_erased": [1, 2],
                            "confirmations": {"server0": {"share_rows": 2, "at": 0}}}}

    def close(self):
        pass


def test_unlearn_wait_after_the_adoption_shows_the_receipt(monkeypatch, capsys):
    monkeypatch.setattr(service_commands, "_config", lambda args: types.SimpleNamespace())
    monkeypatch.setattr(service_commands, "_connection", lambda cfg, p, args: _Forgotten(p))
    args = argparse.Namespace(command="unlearn", client=3, admin=False, targets=None, job="j-3",
                              wait=10.0, connect_timeout=1.0)
    assert service_commands.cmd_unlearn(args) == 0
    out = capsys.readouterr().out
    assert "server0: job j-3 done" in out and "server1: job j-3 done" in out
    assert "erasure receipt: model adopted as round 7" in out
    # a refusal without a job of that id stays a refusal
    monkeypatch.setattr(_Forgotten, "call", lambda self, op, **f: (_ for _ in ()).throw(
        ServiceError("forgotten" if op == "unlearn" else "not_found", op)))
    assert service_commands.cmd_unlearn(args) == 1



def test_a_failed_worker_is_answered_unavailable_in_one_line():
    """``[deployment] workers`` > 1: an upload whose slices a dead worker cannot store (issue 30) is
    retryable, not ``internal``; the message names the worker and says nothing was done."""
    from servers.workers.shard_worker import WorkerError

    fail = WorkerError("put_slices failed on 1 of 2 workers: server1-w1 is gone: ActorDiedError")
    msg_id, payload = wire.make_request("unlearn", job="j-1", nonce=1)
    with pytest.raises(wire.WireError) as e:
        wire.check_reply(_api(fail).handle("client-1", payload), msg_id, 1 << 20)
    assert e.value.code == "unavailable" and "\n" not in e.value.message
    assert "server 0's workers failed (put_slices failed on 1 of 2 workers: server1-w1 is gone" in e.value.message
    assert e.value.message.endswith("the request was not carried out; retry (new workers start)")
