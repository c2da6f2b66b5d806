"""`make demo` / `starfish demo`: the whole service on this machine, end to end.

What it does (docs/design.md 4.4, issue 6):

1. writes a scratch deployment: a CA and certificates (servers, dealer, admin, 20 clients)
   and a config on free loopback ports;
2. starts the dealer and both servers as separate processes (``starfish dealer``,
   ``starfish server --party 1|0``), waits until both answer;
3. runs 20 simulated clients on the digits (``starfish clients``; client 0 poisons half its
   data with a backdoor trigger and boosts its update): 40 rounds of FL on secret shares,
   then client 0 asks to be forgotten and the servers run Starfish under 2PC, the other
   clients answering the correction tasks; both servers adopt the unlearned model as
   M_41, erase client 0 and FL goes on for 5 more rounds from it; client 0's next upload
   is refused (``forgotten``);
4. compares, on the plaintext twin the simulator recorded: plaintext retraining,
   FedRecover and the plaintext Starfish, with the 2PC result (TER, BA-ASR), and the model
   after the 5 further rounds;
5. prints the report (selected rounds, per-step communication, wall time, the erasure
   receipt), scans every byte under both servers' data directories for client 0's shares
   (recomputed from its key and the twin) and stops every process it started, also on
   Ctrl-C or failure.

``starfish demo --aggregator fedseca|brace-sign`` runs the same with a Byzantine-robust rule
computed by the two servers in 2PC at every round's close (``[fl] aggregator``): the FL models
are then checked against the rule run in the clear on the decoded uploads, the report adds the
rule's per-round 2PC cost, and retraining uses the same rule (Stage II replays the history as
FedAvg, docs/unlearning.md).

``starfish demo --runtime`` is the older demonstration of the 2PC runtime alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import common_options, progress
from clients.service_client import ServiceClient
from clients.share_seeds import disk_traces, find_traces, seeded_shares
from net import tls
from common import wire
from net.channel import ChannelError
from common.offline_mode import DEFAULT_OFFLINE, OFFLINE_CHOICES
from common.service_config import AGGREGATORS, load_config, write_scratch_deployment
from protocols.starfish.ports import History
from lab.history import NpzHistory
from starfish import runtime_demo
from starfish.demo_baselines import baselines, robust_twin_error

__all__ = ["add_arguments", "main", "ProcessGroup"]


class ProcessGroup:
    """Child processes of the demo, each logging to its own file; stopped together."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        p = subprocess.Popen([sys.executable, "-m", "starfish.cli", *argv], stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env=env)
        log.close()
        self.procs[name] = p
        return p

    def check_alive(self, *names: str) -> None:
        for n in names:
            rc = self.procs[n].poll()
            if rc is not None:
                tail = (self.log_dir / f"{n}.log").read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError(f"{n} exited with code {rc}:\n  " + "\n  ".join(tail))

    def stop(self, name: str, grace: float = 10.0) -> None:
        p = self.procs.get(name)
        if p is not None:
            _terminate([p], grace)

    def stop_all(self, grace: float = 10.0) -> None:
        """All at once: each shutdown (a server's link and engine close, about a second) overlaps
        the others' instead of adding to them."""
        _terminate(list(self.procs.values()), grace)


def _terminate(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM to each live process, then wait for all within ``grace`` s; kill what is left."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in alive:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtime", action="store_true", help="the 2PC runtime demo instead of the service")
    p.add_argument("--offline", choices=OFFLINE_CHOICES, default=DEFAULT_OFFLINE.value,
                   help="where correlated randomness comes from: nobody (two-party, the default: the "
                        "two servers make it between themselves, no third process) or a dealer process "
                        "(faster, but a third party to trust)")
    p.add_argument("--aggregator", choices=AGGREGATORS, default="fedavg",
                   help="how each round's uploads become the next model: fedavg (default: the exact "
                        "ring sum) or a Byzantine-robust rule the two servers compute in 2PC at every "
                        "round's close (fedseca, brace-sign; [fl] aggregator)")
    p.add_argument("--clients", type=int, default=20, help="simulated clients (20)")
    p.add_argument("--rounds", type=int, default=40, help="FL rounds before the request (40)")
    p.add_argument("--after", type=int, default=5, help="FL rounds after the adoption (5)")
    p.add_argument("--attackers", type=int, default=0,
                   help="backdoor attackers among the remaining clients (0): clients 1..A carry client "
                        "0's backdoor and stay in FL; with a robust --aggregator, the report adds the "
                        "plaintext FedAvg replay of the same history (what the attackers get back when a "
                        "robust history is replayed as FedAvg)")
    p.add_argument("--workdir", help="deployment directory (default: a new temporary one, removed "
                                     "after a successful run)")
    p.add_argument("--keep", action="store_true", help="keep the temporary deployment directory")
    p.add_argument("--timeout", type=float, default=None,
                   help="give up after this many seconds (540; 1800 with --offline two-party, whose 2PC "
                        "steps are slower: the servers make every correlation between themselves)")
    p.add_argument("--n", type=int, default=8, help="--runtime: vector length (8)")
    p.add_argument("--seed", type=int, default=4, help="--runtime: seed of the input values (4)")
    common_options.add_quiet(p)


def _say(msg: str) -> None:
    progress.say(msg, stream=sys.stdout)   # the report: stdout, above any bar on stderr


class ClientsProgress:
    """The clients' log as bars: FL rounds before the request, the unlearning job, FL rounds after.

    The clients run in their own process and their log is all the demo sees of them, so the
    round and job lines that ``clients/simulator.py`` writes drive the bars, one phase after the
    other; every other line is an event of the report.
    """

    ROUND = re.compile(r"clients: round (\d+): ")
    JOB = re.compile(r"clients: job \S+: (\w+) (\d+)% ")
    ADOPTED = re.compile(r"client \d+: job \S+ adopted as round ")

    def __init__(self, rounds: int, after: int, quiet: bool = False) -> None:
        self.rounds, self.after, self.quiet = rounds, after, quiet
        self._stack = contextlib.ExitStack()
        self._phase: str | None = None
        self._bar = None

    def _enter(self, phase: str, total: int, desc: str, unit: str) -> None:
        if self._phase == phase:
            return
        self.close()
        self._phase = phase
        # leave=False: once done, the terminal shows the report alone
        self._bar = self._stack.enter_context(progress.progress(total, desc, quiet=self.quiet, unit=unit,
                                                                leave=False))

    # Each phase's bar opens when the phase begins, not at its first line: the log is read in
    # bursts, and a bar's rate (hence its time left) counts from its opening.
    def start(self) -> None:
        self._enter("fl", self.rounds, "FL rounds", "round")

    def line(self, text: str) -> bool:
        """Feed one log line; True if it was progress (drawn as a bar, not printed)."""
        if self.ADOPTED.match(text):
            self._enter("after", self.after, "FL rounds after the adoption", "round")
            return False
        if m := self.ROUND.match(text):
            r = int(m.group(1))
            if r <= self.rounds:
                self._enter("fl", self.rounds, "FL rounds", "round")
                done = r
            else:   # round rounds + 1 is the unlearning round, the clients train none of it
                self._enter("after", self.after, "FL rounds after the adoption", "round")
                done = r - self.rounds - 1
        elif m := self.JOB.match(text):
            self._enter("job", 100, "unlearning job (2PC)", "%")
            self._bar.set_postfix_str(m.group(1), refresh=False)
            done = int(m.group(2))
        else:
            return False
        if done > self._bar.n:
            self._bar.update(done - self._bar.n)
            self._bar.refresh()   # lines arrive in bursts at each poll; show each, not every 0.1 s
        if self._phase == "fl" and done >= self.rounds:
            self._enter("job", 100, "unlearning job (2PC)", "%")   # the request comes next
        return True

    def close(self) -> None:
        self._stack.close()
        self._bar = None


def _daemons(cfg: Any) -> tuple[str, ...]:
    return ("server0", "server1") if cfg.offline == "two-party" else ("dealer", "server0", "server1")


def _wait_ready(cfg: Any, procs: ProcessGroup, deadline: float) -> None:
    """Poll both servers' client API (as admin) until they answer."""

    for p in (0, 1):
        while True:
            procs.check_alive(*_daemons(cfg))
            if time.monotonic() > deadline:
                raise TimeoutError(f"server {p} did not answer in time")
            try:
                with ServiceClient(cfg.keys_dir, "admin", p, cfg.server(p).api().address,
                                   connect_timeout=1.0) as c:
                    c.call("status")
                break
            except ChannelError:
                continue  # connect() already waited up to 1 s for the port


def _follow(path: Path, offset: int, shown: ClientsProgress) -> int:
    """Show the lines appended to ``path`` since ``offset`` (progress as bars, events printed);
    return the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset
    end = data.rfind(b"\n") + 1
    for line in data[:end].decode(errors="replace").splitlines():
        if (line.startswith("clients:") or line.startswith("client ")) and not shown.line(line):
            _say("  " + line)
    return offset + end


def _fetch_results(cfg: Any, job: str) -> list[dict]:

    out = []
    for p in (0, 1):
        with ServiceClient(cfg.keys_dir, "admin", p, cfg.server(p).api().address) as c:
            rec = c.call("job_status", job=job, with_model=True)
        t = rec["model"]
        rec["model"] = wire.decode_tensor(t, "model", ("<f8",), tuple(t["shape"])).astype(np.float64)
        out.append(rec)
    return out


def _comm_table(meters0: dict, meters1: dict, two_party: bool = False) -> list[str]:
    """Per step. Offline: dealer<->servers (both servers' links), or in two-party mode the
    correlations made between the servers (one link: server 0's count, both directions)."""
    offline_of = (lambda a, b: (a,)) if two_party else (lambda a, b: (a, b))
    rows = ["step          rounds   online bytes  offline bytes   seconds",
            "------------  ------  -------------  -------------  --------"]
    order = ["setup", "TD", "RS", "UE", "TC", "correction", "pairs", "aggregate"]
    steps = [s for s in order if s in meters0["steps"]] + sorted(
        s for s in meters0["steps"] if s not in order and "/" not in s)
    for s in steps:
        a, b = meters0["steps"][s], meters1["steps"].get(s, {})
        online = a["online_bytes_sent"] + a["online_bytes_received"]
        offline = sum(r.get("offline_bytes_sent", 0) + r.get("offline_bytes_received", 0) for r in offline_of(a, b))
        rows.append(f"{s:<12}  {a['online_rounds']:>6}  {online:>13,}  {offline:>13,}  "
                    f"{max(a['seconds'], b.get('seconds', 0.0)):>8.2f}")
    t0, t1 = meters0["total"], meters1["total"]
    rows.append(f"{'total':<12}  {t0['online_rounds']:>6}  "
                f"{t0['online_bytes_sent'] + t0['online_bytes_received']:>13,}  "
                f"{sum(t['offline_bytes_sent'] + t['offline_bytes_received'] for t in offline_of(t0, t1)):>13,}  "
                f"{max(t0['seconds'], t1['seconds']):>8.2f}")
    return rows


#: server 0's log line for each robust round (``servers.daemon.round_coordinator``)
_AGG_LINE = re.compile(r"round (\d+) aggregated by (\S+) in 2PC: (\d+) clients checked, (\d+) kept; "
                       r"online_bytes=(\d+) offline_bytes=(\d+) rounds=(\d+) seconds=([\d.]+)")


def _aggregation_costs(log_dir: Path) -> dict[str, float] | None:
    """Mean per-round cost of the robust aggregation sessions, from both servers' logs (the
    last session of each round, i.e. the one its model came from). Online: server 0's count
    (both directions of the server link); offline: both servers' dealer links, as in the job's
    table."""
    per_round: list[dict[int, tuple]] = []
    for p in (0, 1):
        path = log_dir / f"server{p}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        per_round.append({int(m.group(1)): m.groups() for m in _AGG_LINE.finditer(text)})
    rounds = sorted(per_round[0])
    if not rounds:
        return None
    n = len(rounds)
    first = [per_round[0][r] for r in rounds]
    offline = sum(int(per_round[p][r][5]) for p in (0, 1) for r in rounds if r in per_round[p])
    return {"rounds_aggregated": n,
            "dropped": sum(int(x[2]) - int(x[3]) for x in first),
            "online_bytes": sum(int(x[4]) for x in first) / n,
            "offline_bytes": offline / n,
            "online_rounds": sum(int(x[6]) for x in first) / n,
            "seconds": sum(float(x[7]) for x in first) / n}


def _erasure_scan(cfg: Any, twin: History, target: int, control: int) -> tuple[int, int, int]:
    """Traces of ``target``'s shares under both data directories (files hit), and of
    ``control``'s (a remaining client: the scan must find those); files scanned."""
    found = {target: 0, control: 0}
    precision = 16
    for c in found:
        key = tls.identity(cfg.keys_dir, f"client-{c}").key.read_bytes()
        traces: dict[int, list[bytes]] = {0: [], 1: []}
        for r in range(1, twin.num_rounds + 1):
            if c in twin.participants(r):
                values = {"update": twin.update(r, c).numpy(), "norm": twin.norm(r, c).numpy(),
                          "delta": twin.delta(r, c).numpy()}
                for p, t in disk_traces(seeded_shares(key, f"round/{r}", values, precision)).items():
                    traces[p] += t
        for p in (0, 1):
            found[c] += len({path for path, _ in find_traces(cfg.data_dir(p), traces[p])})
    files = sum(len(files) for p in (0, 1) for _, _, files in os.walk(cfg.data_dir(p)))
    return found[target], found[control], files


def _ranges(rounds: list[int]) -> str:
    """[1, 2, 3, 5] -> "1-3, 5"."""
    out: list[str] = []
    for r in rounds:
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out) or "none"


def run_service_demo(args: argparse.Namespace) -> int:

    t_start = time.monotonic()
    aggregator = getattr(args, "aggregator", "fedavg")
    attackers = getattr(args, "attackers", 0)
    if not 0 <= attackers <= args.clients - 2:
        raise SystemExit(f"starfish demo: --attackers {attackers} is outside 0..{args.clients - 2} "
                         f"(clients 1..A of --clients {args.clients}, one honest client at least)")
    backdoor = ",".join(str(j) for j in range(attackers + 1))
    if args.timeout is None:
        args.timeout = 1800.0 if args.offline == "two-party" else 540.0
        if aggregator != "fedavg":   # one more 2PC session per round (docs/service.md)
            args.timeout *= 2
    deadline = t_start + args.timeout
    temp = args.workdir is None
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="starfish-demo-"))
    target = 0
    _say(f"[1/5] keys and config for a loopback deployment in {work}")
    cfg_path = write_scratch_deployment(work, clients=args.clients, overrides={
        "fl": {"rounds": args.rounds + args.after, "round_deadline": 120.0, "aggregator": aggregator}},
        offline=args.offline)
    cfg = load_config(cfg_path)
    procs = ProcessGroup(work / "logs")
    ok = False
    try:
        env = {k: v for k, v in os.environ.items() if k != "STARFISH_CRASH_AT"}
        if cfg.offline == "two-party":
            _say("[2/5] starting server 1 and server 0 (separate processes, TLS 1.3); two-party mode: "
                 "no dealer, the servers make all correlated randomness between themselves")
        else:
            _say("[2/5] starting the dealer, server 1 and server 0 (separate processes, TLS 1.3)")
            procs.start("dealer", ["dealer", "--config", str(cfg_path)], env)
        procs.start("server1", ["server", "--party", "1", "--config", str(cfg_path)], env)
        procs.start("server0", ["server", "--party", "0", "--config", str(cfg_path)], env)
        _wait_ready(cfg, procs, deadline)
        also = f", so do clients 1-{attackers}, who stay" if attackers else ""
        _say(f"[3/5] {args.clients} clients train {args.rounds} rounds on the digits (client {target} "
             f"has a backdoor{also}), sharing every upload between the servers; then client {target} "
             f"asks to be forgotten, the servers run Starfish in 2PC, adopt the result as "
             f"M_{args.rounds + 1}, erase client {target}, and FL goes on for {args.after} rounds")
        t_fl = time.monotonic()
        clients = procs.start("clients", [
            "clients", "--config", str(cfg_path), "--n", str(args.clients), "--backdoor", backdoor,
            "--unlearn", f"{target}@{args.rounds}", "--twin-dir", str(work / "twin"), "--summary",
            str(work / "clients.json"), "--max-seconds", str(max(30.0, deadline - time.monotonic()))], env)
        offset = 0
        shown = ClientsProgress(args.rounds, args.after, getattr(args, "quiet", False))
        shown.start()
        try:
            while clients.poll() is None:
                procs.check_alive(*_daemons(cfg))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the clients did not finish within {args.timeout:.0f}s")
                offset = _follow(work / "logs" / "clients.log", offset, shown)
                time.sleep(0.5)  # the clients' log is the progress display
            _follow(work / "logs" / "clients.log", offset, shown)
        finally:
            shown.close()
        procs.check_alive(*_daemons(cfg))
        if clients.returncode != 0:
            procs.check_alive("clients")
        t_clients = time.monotonic() - t_fl
        summary = json.loads((work / "clients.json").read_text())
        job = next(iter(summary["jobs"]))
        recs = _fetch_results(cfg, job)
        for r in recs:
            if r["state"] != "done":
                raise RuntimeError(f"job {job} ended {r['state']}: {r.get('error')}")
        same = bool(np.array_equal(recs[0]["model"], recs[1]["model"]))
        res0, res1 = recs[0]["result"], recs[1]["result"]
        _say("[4/5] plaintext baselines on the twin history (retrain, FedRecover, Starfish)")
        twin = NpzHistory(work / "twin")
        table, extra = baselines(cfg, twin, res0["rounds"], args.clients, target, recs[0]["model"],
                                  getattr(args, "quiet", False), backdoor)
        _say("[5/5] report\n")
        if aggregator == "fedavg":
            _say(f"FL: {summary['T']} rounds ({summary['T'] - 1} FL rounds and 1 unlearning round), "
                 f"{args.clients} clients, aggregator fedavg; every FL model equals plaintext FedAvg of "
                 f"the clients' updates within {summary['fedavg_max_abs_error']:.1e}")
        else:
            robust_err = robust_twin_error(cfg, twin)
            _say(f"FL: {summary['T']} rounds ({summary['T'] - 1} FL rounds and 1 unlearning round), "
                 f"{args.clients} clients, aggregator {aggregator} (computed by the servers in 2PC); "
                 f"every FL model equals {aggregator} run in the clear on the decoded uploads within "
                 f"{robust_err:.1e}")
            costs = _aggregation_costs(work / "logs")
            if costs:
                _say(f"  robust aggregation per FL round (2PC session after the range check; mean of "
                     f"{costs['rounds_aggregated']} rounds): {costs['online_bytes'] / 1e6:.2f} MB online, "
                     f"{costs['offline_bytes'] / 1e6:.2f} MB offline, {costs['online_rounds']:.0f} rounds, "
                     f"{costs['seconds']:.2f} s; clients left out by the threshold check: {costs['dropped']}")
            _say(f"  note: Stage II replays each round of this history with {aggregator} in 2PC, as the "
                 f"round was made (docs/unlearning.md, 'Robustly aggregated histories'); the plaintext "
                 f"twin and retrain below use {aggregator} too")
        _say(f"unlearning job {job}: requested by client-{target}; both servers published the "
             f"{'same' if same else 'DIFFERENT'} model; 2PC vs plaintext twin: max |diff| = "
             f"{extra['max_abs_2pc_vs_plain']:.1e}\n")
        _say(f"{'model':<32}{'TER%':>7}{'BA-ASR%':>9}{'L2 to retrain':>15}{'seconds':>9}")
        for name, ter, asr, l2, secs in table:
            s = res0["wall_seconds"] if secs is None else secs
            st = "-" if s != s else f"{s:.1f}"
            _say(f"{name:<32}{100 * ter:>7.1f}{100 * asr:>9.1f}{l2:>15.4f}{st:>9}")
        _say(f"\nselected rounds (2PC): {res0['selected_rounds']}  (plaintext: {extra['plain_selected']})")
        _say(f"threshold checks at replay steps {res0['correction_steps']}, warm-up steps "
             f"{res0['warmup_steps']}; exact updates asked per remaining client: "
             f"{sorted(set(res0['client_exact_updates'].values()))} of {summary['T']} rounds")
        _say("\ncommunication of the 2PC job (online = server<->server, both directions; offline = "
             + ("correlations made between the two servers, both directions):" if cfg.offline == "two-party"
                else "dealer<->servers):"))
        for line in _comm_table(res0["meters"], res1["meters"], cfg.offline == "two-party"):
            _say("  " + line)
        receipt = recs[0].get("receipt") or {}
        _say(f"\nadopted: M_{receipt.get('adopted_round')} is the unlearned model at both servers; "
             f"FL went on from it to M_{summary['T']}")
        _say(f"refused: client {target}'s upload after the adoption: "
             f"{summary['refused_uploads'].get(str(target), 'NOT REFUSED')}")
        _say(f"erasure receipt: clients {receipt.get('clients')} erased from rounds "
             f"{_ranges(receipt.get('rounds_erased', []))}")
        for name, conf in sorted(receipt.get("confirmations", {}).items()):
            _say(f"  {name}: {conf['share_rows']} share rows and {conf['staged_rows']} staged uploads "
                 f"deleted, {conf['blobs_removed']} blob files unlinked, catalog compacted")
        hits, control, files = _erasure_scan(cfg, twin, target, 1)
        _say(f"scan of both data directories ({files} files, every byte): client {target}'s shares "
             f"found in {hits} files (client 1's, as a control: in {control} files)")
        total = time.monotonic() - t_start
        _say(f"\nwall time: FL + unlearning (clients process) {t_clients:.0f}s, 2PC job "
             f"{res0['wall_seconds']:.0f}s, whole demo {total:.0f}s")
        ok = same and hits == 0 and control > 0 and receipt.get("clients") == [target] and \
            summary["refused_uploads"].get(str(target), "").startswith("forgotten")
        return 0 if ok else 1
    finally:
        procs.stop_all()
        if ok and temp and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            _say(f"(deployment, logs and results kept in {work})")


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    if args is None:
        parser = argparse.ArgumentParser(prog="starfish demo", description=__doc__.split("\n\n")[0])
        add_arguments(parser)
        args = parser.parse_args(argv)
    if args.runtime:
        return runtime_demo.main(args=args)
    try:
        return run_service_demo(args)
    except KeyboardInterrupt:
        print("\nstarfish demo: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError) as exc:
        print(f"starfish demo: {exc}", file=sys.stderr)
        return 1
