"""Progress bars of the long commands (``bench/progress.py``) and the ``--quiet`` of each command.

The bars must never reach stdout, must stay silent with ``--quiet`` or when stderr is not a
terminal, and on a terminal must show done/total and an estimate of the time left.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
import sys
import time

import pytest
import torch

from bench import lab, offline, progress
from starfish.cli import build_parser

torch.set_num_threads(1)

#: tqdm's "[elapsed<remaining" once it has a rate: the time-left estimate
ETA = re.compile(r"\[\d\d:\d\d<\d\d:\d\d")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def _drive(**kwargs) -> None:
    """What the commands do with a bar: total known late, postfix, steps."""
    with progress.progress(None, "FL", unit="round", **kwargs) as bar:
        report = progress.callback(bar)
        time.sleep(0.15)   # a measurable rate, so tqdm can estimate the rest
        report(2, 5, "|M_i - M_(i-1)| = 0.5")
        progress.step_hook(bar, count=False)("UE", False)
        report(3, 5)


def test_on_a_terminal_the_bar_shows_done_total_and_the_time_left(capsys):
    term = Terminal()
    _drive(stream=term)
    text = term.getvalue()
    assert "FL" in text and "2/5" in text and "3/5" in text
    assert ETA.search(text), text
    assert "|M_i - M_(i-1)| = 0.5" in text and "UE" in text
    assert capsys.readouterr().out == ""   # stdout carries tables and JSON only


@pytest.mark.parametrize("stream, quiet", [(Pipe(), False), (Terminal(), True), (io.StringIO(), False)])
def test_silent_when_quiet_or_not_a_terminal(stream, quiet, capsys):
    _drive(stream=stream, quiet=quiet)
    assert stream.getvalue() == ""
    assert capsys.readouterr().out == ""


def test_the_default_stream_is_stderr_and_follows_its_isatty(monkeypatch):
    pipe, term = Pipe(), Terminal()
    monkeypatch.setattr(sys, "stderr", pipe)
    _drive()
    assert pipe.getvalue() == "" and not progress.shown()
    monkeypatch.setattr(sys, "stderr", term)
    _drive()
    assert "3/5" in term.getvalue() and progress.shown() and not progress.shown(quiet=True)


def test_step_hook_counts_finished_top_level_steps():
    term = Terminal()
    with progress.progress(3, "steps", stream=term) as bar:
        hook = progress.step_hook(bar)
        hook("TD2", False)
        hook("TD2", True)
        bar.refresh()
        assert bar.n == 1
    assert "1/3" in term.getvalue() and "TD2" in term.getvalue()


def test_say_writes_a_line_unless_quiet():
    log = Pipe()
    progress.say("compute run took 3.0s", quiet=True, stream=log)
    assert log.getvalue() == ""
    progress.say("compute run took 3.0s", stream=log)   # a log line, also in CI logs
    assert log.getvalue() == "compute run took 3.0s\n"


def test_only_party_0_draws_and_only_when_the_parent_would(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    (p0,), (p1,) = progress.party_args("unlearning/mnist")
    assert (p0.show, p1.show) == (True, False)
    assert pickle.loads(pickle.dumps(p0)) == p0   # it travels to a party process
    (p0,), _ = progress.party_args("unlearning/mnist", quiet=True)
    assert not p0.show
    monkeypatch.setattr(sys, "stderr", Pipe())
    (p0,), _ = progress.party_args("unlearning/mnist")
    assert not p0.show


class _FakeParty:
    """Just enough of a party for ``offline.instrument``: a meter and a recorded plan."""

    recorded_plan: list = []

    @contextlib.contextmanager
    def meter(self, name):
        yield


def test_instrumented_party_reports_top_level_steps_only():
    seen = []
    p = offline.instrument(_FakeParty(), None, lambda name, finished: seen.append((name, finished)))
    with p.meter("UE"):
        with p.meter("UE/inverse"):
            pass
    with p.meter("TC"):
        pass
    assert seen == [("UE", False), ("UE", True), ("TC", False), ("TC", True)]


def test_in_round_bar_restarts_each_round_and_shows_clients_done_and_time_left():
    term = Terminal()
    with progress.progress(2, "FL", stream=term, unit="round") as outer, \
            progress.within("clients", stream=term, delay=0.0) as in_round:
        for _ in range(2):                       # two rounds of 3 clients, 6 local steps each
            for done in range(0, 7, 2):
                in_round(done, 6, f"{done // 2}/3 clients done")
                time.sleep(0.12)             # past tqdm's redraw interval (0.1 s)
            outer.update(1)
    text = term.getvalue()
    assert "clients" in text and "3/3 clients done" in text and ETA.search(text), text
    frames = re.findall(r"clients:\s+\d+%\|[^|]*\| (\d)/6", text)
    # a second round starts from 0 again: some frame after the first 6/6 is below 6
    first_full = frames.index("6")
    assert any(int(f) < 6 for f in frames[first_full + 1:]), frames
    pipe = Pipe()
    with progress.within("clients", stream=pipe, delay=0.0) as in_round:
        in_round(1, 2, "x")
    assert pipe.getvalue() == ""


# ------------------------------------------------------------------ every long command takes --quiet
COMMANDS = [["lab"], ["demo"]] + [["bench", b] for b in (
    "runtime", "primitives", "rs-switch", "steps", "unlearning", "truncation", "range-check", "scaling",
    "aggregation", "training")]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_quiet_is_accepted_and_documented_by_each_long_command(command, capsys):
    parser = build_parser()
    assert parser.parse_args(command + ["--quiet"]).quiet is True
    assert parser.parse_args(command).quiet is False
    with pytest.raises(SystemExit):
        parser.parse_args(command + ["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--quiet" in help_text and "no progress bars" in help_text


# ------------------------------------------------------------------ the lab's bars
_LAB = ["--dataset", "digits", "--clients", "4", "--rounds", "3", "--epochs", "1", "--train-limit", "120",
        "--test-limit", "40", "--targets", "0", "--method", "retrain,starfish"]


def test_lab_shows_fl_rounds_and_each_method_on_a_terminal(monkeypatch, capsys):
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert lab.main(_LAB) == 0
    text = term.getvalue()
    assert re.search(r"FL: .*3/3", text), text
    assert re.search(r"retrain: .*3/3", text) and re.search(r"starfish: .*2/2", text), text
    assert "retrain" in capsys.readouterr().out   # the table stays on stdout


def test_lab_quiet_writes_nothing_to_stderr(monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert lab.main(_LAB + ["--quiet"]) == 0
    assert term.getvalue() == ""
