"""The service's commands: server, dealer, clients, unlearn, status, init-deployment, admin.

Why a module of its own: ``starfish/cli.py`` only wires sub-commands; these functions read
the config, set up logging and signals, and call into ``servers``/``clients``.

Imports: only what every command needs is imported here (the standard library, numpy, the
config and the client connection). The daemons, the simulator and torch are imported inside
the command that runs them, so ``status``, ``unlearn``, ``admin`` and ``--help`` start in well
under a second (torch alone takes 2-3 s to import on this machine).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from clients.service_client import ServiceClient, ServiceError
from net import tls
from common import wire
from net.channel import ChannelError
from common.gc_pause import collector_paused
from common.offline_mode import DEFAULT_OFFLINE, OFFLINE_CHOICES
from common.service_config import SCRATCH_CA_DIR, ConfigError, load_config, write_scratch_deployment

__all__ = ["add_commands"]


class _OneLineFormatter(logging.Formatter):
    """A logged exception as one line (``message: Type: text``); its traceback only at DEBUG.

    Why: an operator reads these logs. A 38-line traceback every 31 s (the dealer down) buried
    the one line that said what failed; with ``--log-level DEBUG`` the tracebacks come back.
    """

    def __init__(self, debug: bool) -> None:
        super().__init__("%(asctime)s %(name)s %(levelname)s %(message)s")
        self.debug = debug

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info and not self.debug:
            exc = record.exc_info[1]
            record = logging.makeLogRecord(record.__dict__)
            record.msg, record.args = f"{record.getMessage()}: {type(exc).__name__}: {exc}", None
            record.exc_info, record.exc_text = None, None
        return super().format(record)


def _logging(level: str = "INFO") -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLineFormatter(debug=lvl <= logging.DEBUG))
    logging.basicConfig(level=lvl, handlers=[handler])


def _on_signals(stop: Any) -> None:
    def handler(signum: int, _frame: Any) -> None:
        logging.getLogger("starfish").info("signal %d: stopping", signum)
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _config_path(given: str) -> Path:
    """``--config``: the TOML file, or a deployment directory holding ``config.toml``."""
    p = Path(given)
    if p.is_dir():
        if (p / "config.toml").is_file():
            return p / "config.toml"
        raise ConfigError(f"--config {given} is a directory without config.toml; give the config "
                          f"file (`starfish init-deployment DIR` writes DIR/config.toml)")
    return p


def _config(args: argparse.Namespace):
    try:
        return load_config(_config_path(args.config))
    except ConfigError as exc:
        print(f"starfish {args.command}: {exc}", file=sys.stderr)
        sys.exit(2)


def _fail(command: str, what: object, rc: int = 2, exc: BaseException | None = None) -> int:
    """One line on stderr for a failure the user can act on; the traceback only at DEBUG."""
    print(f"starfish {command}: {what}", file=sys.stderr)
    exc = exc if exc is not None else what if isinstance(what, BaseException) else None
    if exc is not None:
        logging.getLogger("starfish").debug("traceback", exc_info=exc)
    return rc


# ------------------------------------------------------------------ daemons
def cmd_server(args: argparse.Namespace) -> int:
    cfg = _config(args)
    _logging(args.log_level)
    with collector_paused():
        import torch

        from clients.initial_model import initial_model, model_layout
        from net.listening import ListenError
        from servers.daemon.server_daemon import ServerDaemon, StartupError, install_crash_points

    torch.set_num_threads(1)
    install_crash_points(os.environ.get("STARFISH_CRASH_AT"))
    try:
        daemon = ServerDaemon(cfg, args.party, initial_model(cfg.model), model_layout(cfg.model))
    except (StartupError, ListenError, tls.KeyDirError, FileNotFoundError, ConfigError) as exc:
        return _fail("server", exc)
    except Exception as exc:  # noqa: BLE001 - anything else still gets one line, not a traceback
        return _fail("server", f"server{args.party} failed to start: {type(exc).__name__}: {exc} "
                               f"(--log-level DEBUG shows the traceback)", 1, exc)
    _on_signals(daemon.stop)
    daemon.serve_forever()
    return 0


def _worker_line(w: dict) -> str:
    """One line of ``starfish status`` per worker (``ServerWorkers.state``)."""
    if w.get("state") == "up":
        return (f"{w['name']}: up {w['up_s']:.0f}s, pid {w['pid']}, {w['shares']} shares "
                f"({w['bytes'] / 2**20:.1f} MiB), peak RSS {w['peak_rss_mib']:.0f} MiB"
                + (f", {w['slices']} stored slices" if "slices" in w else "")
                + (", in a session" if w.get("session") else ""))
    why = w.get("error") or w.get("last_failure")
    return f"{w['name']}: {w.get('state', 'unknown')}" + (f" ({why})" if why else "")


def cmd_dealer(args: argparse.Namespace) -> int:
    cfg = _config(args)
    _logging(args.log_level)
    if cfg.offline == "two-party":
        print("starfish dealer: this deployment runs in two-party mode ([deployment] offline = "
              "\"two-party\"): it has no dealer, and none must run", file=sys.stderr)
        return 2
    with collector_paused():
        from net.listening import ListenError
        from servers.dealer_daemon import run_dealer

    stop = threading.Event()
    _on_signals(stop.set)
    try:
        run_dealer(cfg, stop)
    except ListenError as exc:
        return _fail("dealer", f"{exc} ([dealer] port = {cfg.dealer.port} in {cfg.path}); stop the "
                               f"process that holds it (`ss -ltnp 'sport = :{cfg.dealer.port}'` names "
                               f"it) or choose another port in the config", exc=exc)
    except (tls.KeyDirError, FileNotFoundError) as exc:
        return _fail("dealer", exc)
    return 0


# ------------------------------------------------------------------ simulated clients
def federation_spec(cfg: Any, args: argparse.Namespace) -> Any:
    """The simulator's FederationSpec: command line, then [clients]/[model], then lab defaults."""
    from clients.initial_model import architecture_of
    from clients.simulator import FederationSpec
    from lab.experiment import DATASET_DEFAULTS

    dataset = args.dataset or cfg.clients.dataset
    if dataset != cfg.model.dataset:
        raise ConfigError(f"clients train on {dataset} but the servers' [model] dataset is "
                          f"{cfg.model.dataset}")
    d = DATASET_DEFAULTS[dataset]
    backdoor = tuple(int(x) for x in str(args.backdoor or "").split(",") if x.strip())
    return FederationSpec(
        dataset=dataset, data_dir=args.data_dir or cfg.clients.data_dir or None,
        n=args.n, seed=cfg.clients.seed if args.seed is None else args.seed,
        partition=cfg.clients.partition, architecture=architecture_of(cfg.model), l2=cfg.model.l2,
        epochs=args.epochs or d["epochs"], lr=args.lr or d["lr"], batch_size=d["batch_size"],
        alpha=cfg.unlearning.alpha, backdoor=backdoor, poison_fraction=d["poison_fraction"],
        boost=d.get("boost", 1.0), train_limit=args.train_limit,
        device=getattr(args, "device", None) or "cpu")


def cmd_clients(args: argparse.Namespace) -> int:
    cfg = _config(args)
    _logging(args.log_level)
    with collector_paused():
        import torch

        from clients.simulator import Simulator, build_federation, parse_unlearn, write_summary
        from lab.experiment import DATASET_DEFAULTS  # noqa: F401  (federation_spec's, under the pause)
        from lab.history import NpzTwinRecorder

    torch.set_num_threads(1)
    try:
        spec = federation_spec(cfg, args)
    except ConfigError as exc:
        print(f"starfish clients: {exc}", file=sys.stderr)
        return 2
    ids = list(range(args.first_id, args.first_id + args.n))
    try:   # before the (slow) federation: a missing certificate is one line, not a traceback later
        for i in ids:
            tls.identity(cfg.keys_dir, f"client-{i}")
    except FileNotFoundError as exc:
        return _fail("clients", f"{exc} (--n {args.n} --first-id {args.first_id} needs "
                                f"client-{ids[0]}..client-{ids[-1]})", exc=exc)
    fed = build_federation(spec)
    try:
        unlearn = parse_unlearn(args.unlearn)
        twin = NpzTwinRecorder(args.twin_dir) if args.twin_dir else None
        sim = Simulator(cfg, fed, ids, twin=twin, unlearn=unlearn, until=args.until or "training",
                        max_seconds=args.max_seconds)
    except ValueError as exc:
        print(f"starfish clients: {exc}", file=sys.stderr)
        return 2
    stop_requested = threading.Event()

    def stop() -> None:
        stop_requested.set()
        raise KeyboardInterrupt

    _on_signals(stop)
    try:
        summary = sim.run()
    except KeyboardInterrupt:
        print("starfish clients: stopped", file=sys.stderr)
        return 130
    if args.summary:
        write_summary(args.summary, summary)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("participants",)}, default=str))
    return 0


# ------------------------------------------------------------------ admin / client tools
def _connection(cfg: Any, party: int, args: argparse.Namespace):
    """A connection as admin, or as client-ID with ``--client`` (raises tls.MissingCredential)."""
    ident = "admin" if getattr(args, "client", None) is None else f"client-{args.client}"
    return ServiceClient(cfg.keys_dir, ident, party, cfg.server(party).api().address,
                         max_bytes=cfg.limits.max_frame_bytes, connect_timeout=args.connect_timeout)


def _unreachable(cfg: Any, party: int, exc: BaseException) -> str:
    """Why server ``party`` did not answer, in one line with what to do."""
    host, port = cfg.server(party).api().address
    cause = getattr(exc.__cause__, "strerror", None)    # "Connection refused", not the whole chain
    return (f"server{party} did not answer at {host}:{port} ([server{party}] api_port): "
            f"{(cause or str(exc)).lower()}; is "
            f"`starfish server --party {party} --config {cfg.path}` running?")


def _json_default(o: Any) -> Any:
    """JSON for what msgpack carries and JSON lacks: bytes (request ids, seeds) as hex."""
    if isinstance(o, (bytes, bytearray)):
        return bytes(o).hex()
    return str(o)


def cmd_unlearn(args: argparse.Namespace) -> int:
    cfg = _config(args)

    if (args.client is None) == (not args.admin):
        print("starfish unlearn: give --client ID (your own data) or --admin --targets IDS",
              file=sys.stderr)
        return 2
    fields: dict[str, Any] = {"job": args.job or f"unlearn-{secrets.token_hex(6)}"}
    if args.admin:
        if not args.targets:
            print("starfish unlearn: --admin needs --targets", file=sys.stderr)
            return 2
        fields["targets"] = sorted({int(x) for x in args.targets.split(",")})
    try:
        conns = [_connection(cfg, p, args) for p in (0, 1)]
    except FileNotFoundError as exc:
        return _fail("unlearn", exc)
    try:
        for p, c in enumerate(conns):
            try:
                rep = c.call("unlearn", retry_seconds=args.connect_timeout, **fields)
            except ServiceError as exc:
                # after the adoption the client is forgotten and a (re-sent) request is refused
                # so; the job it names is then the answer (issue 25, 8: exited 1 with "forgotten")
                if exc.code != "forgotten" or not args.job:
                    raise
                try:
                    rep = c.call("job_status", retry_seconds=args.connect_timeout, job=fields["job"])
                except ServiceError:
                    raise exc from None
            print(f"server{p}: job {rep['job']} {rep['state']}")
        if args.wait:
            deadline = time.monotonic() + args.wait
            while time.monotonic() < deadline:
                # a server restarting meanwhile is ordinary: reconnect for up to 60 s
                states = [c.call("job_status", retry_seconds=60.0, job=fields["job"]) for c in conns]
                print(f"job {fields['job']}: " + ", ".join(
                    f"server{p} {s['state']} {100 * s['progress']:.0f}%" for p, s in enumerate(states)),
                    file=sys.stderr)
                if all(s["state"] in ("done", "failed", "cancelled") for s in states):
                    _print_job(states[0])
                    return 0 if all(s["state"] == "done" for s in states) else 1
                time.sleep(2.0)  # a job takes minutes; a status line every 2 s
            print(f"starfish unlearn: job not finished after {args.wait}s", file=sys.stderr)
            return 1
    except ServiceError as exc:
        print(f"starfish unlearn: refused: {exc}", file=sys.stderr)
        return 1
    except ChannelError as exc:
        print(f"starfish unlearn: {_unreachable(cfg, p, exc)}", file=sys.stderr)
        return 1
    finally:
        for c in conns:
            c.close()
    return 0


def _print_job(rec: dict) -> None:
    print(f"job {rec['job']} ({rec['state']}, {100 * rec['progress']:.0f}%): requested by "
          f"{rec['requester']}, targets {rec['targets']}" + (f", error: {rec['error']}" if rec.get("error") else ""))
    res = rec.get("result")
    if res:
        print(f"  selected rounds: {res.get('selected_rounds')}")
        print(f"  corrections at replay steps {res.get('correction_steps')}, warm-up steps "
              f"{res.get('warmup_steps')}, wall time {res.get('wall_seconds', 0):.1f}s")
    receipt = rec.get("receipt")
    if receipt:
        print(f"  erasure receipt: model adopted as round {receipt.get('adopted_round')}; clients "
              f"{receipt.get('clients')} erased from rounds {receipt.get('rounds_erased')}")
        for name, conf in sorted(receipt.get("confirmations", {}).items()):
            print(f"    {name}: {conf.get('share_rows')} share rows, {conf.get('staged_rows')} staged "
                  f"uploads, {conf.get('blobs_removed')} blob files deleted at "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(conf.get('at', 0)))} UTC")


def _save_model(job: dict, path: str | None, party: int) -> None:
    """Write the job's result model (server 0's copy) as a .npy file."""
    model = job.pop("model", None)
    if path is None or party != 0:
        return
    if model is None:
        print(f"job {job['job']} is {job['state']}: no model yet", file=sys.stderr)
        return

    np.save(path, wire.decode_tensor(model, "model", ("<f8",), tuple(model["shape"])))
    print(f"wrote the unlearned model of job {job['job']} to {path}", file=sys.stderr)


def _query(cfg: Any, p: int, args: argparse.Namespace) -> dict[str, Any]:
    """One server's status (and job); never raises: a failure is the entry's ``error``."""
    try:
        with _connection(cfg, p, args) as c:
            st = c.call("status")
            out: dict[str, Any] = {"status": st, "job": None}
            if args.job:
                try:
                    job = c.call("job_status", job=args.job, with_model=bool(args.save_model))
                    _save_model(job, args.save_model, p)
                    out["job"] = job
                except ServiceError as exc:    # the server answered: the job is the problem
                    out["job_error"] = str(exc)
            return out
    except FileNotFoundError as exc:
        return {"error": str(exc)}
    except ServiceError as exc:
        return {"error": f"server{p} refused the status request: {exc}"}
    except (ChannelError, OSError) as exc:
        return {"error": _unreachable(cfg, p, exc)}


def cmd_status(args: argparse.Namespace) -> int:
    cfg = _config(args)

    parties = [0, 1] if args.party is None else [args.party]
    # both servers at once: with both down, status fails within one --connect-timeout
    results: dict[int, dict[str, Any]] = {}
    threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, _query(cfg, p, args)), daemon=True)
               for p in parties]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {f"server{p}": results[p] for p in parties}
    rc = 0 if all("error" not in v and "job_error" not in v for v in out.values()) else 1
    if args.json:
        print(json.dumps(out, indent=1, default=_json_default))
        return rc
    for name, v in out.items():
        if "error" in v:
            err = v["error"]
            print(f"{name}: {err[len(name) + 1:] if err.startswith(name + ' ') else err}")
            continue
        st = v["status"]
        unlearning = st["T"] - st["fl_rounds"]
        print(f"{name}: {st['fl_rounds']}/{st['rounds']} FL rounds committed"
              + (f" and {unlearning} unlearning round{'s' * (unlearning != 1)} (T = {st['T']})"
                 if unlearning else "") + "; "
              + (f"round {st['open_round']} open, {len(st['staged'])} uploads staged"
                 if st["open_round"] else "training finished")
              + (f"; running job {st['busy_job']}" if st["busy_job"] else ""))
        for what in st.get("waiting_for", []):
            print(f"  waiting for {what}")
        for cid, why in st.get("left_out", {}).items():
            print(f"  client {cid} not taken: {why}")
        for w in st.get("workers", []):
            print(f"  worker {_worker_line(w)}")
        for j in st["jobs"][-10:]:
            print(f"  job {j['job']}: {j['state']} {100 * j['progress']:.0f}% targets {j['targets']} "
                  f"by {j['requester']}" + (f" ({j['error']})" if j.get("error") else ""))
        for f in st.get("forgotten", []):
            print(f"  client {f['client']} forgotten by job {f['job']}"
                  + (f", re-enrolled by {f['reenrolled_by']}" if f.get("reenrolled_by") else ""))
        if v.get("job_error"):
            print(f"  job {args.job}: {v['job_error']}")
        if v["job"]:
            _print_job(v["job"])
    return rc


_ADMIN_OPS = {"cancel": "cancel_job", "reenrol": "reenrol", "staged": "staged", "drop-staged": "drop_staged"}


def cmd_admin(args: argparse.Namespace) -> int:
    """``starfish admin cancel JOB | reenrol CLIENT | staged | drop-staged CLIENT``, at both servers."""
    cfg = _config(args)
    op = _ADMIN_OPS[args.action]
    if (args.target is None) != (args.action == "staged"):
        print(f"starfish admin {args.action}: "
              + ("takes no target" if args.action == "staged" else
                 "needs a target: " + ("the job id" if args.action == "cancel" else "the client id")),
              file=sys.stderr)
        return 2
    fields: dict[str, Any] = {}
    if args.action == "cancel":
        fields["job"] = args.target
    elif args.target is not None:
        if not args.target.isdigit():
            print(f"starfish admin {args.action}: the client id must be a number, got {args.target!r}",
                  file=sys.stderr)
            return 2
        fields["client"] = int(args.target)
    rc = 0
    for p in (0, 1):
        try:
            with _connection(cfg, p, args) as c:
                rep = c.call(op, **fields)
        except FileNotFoundError as exc:
            return _fail("admin", exc)
        except ServiceError as exc:
            print(f"server{p}: refused: {exc}", file=sys.stderr)
            rc = 1
            continue
        except ChannelError as exc:
            print(f"server{p}: {_unreachable(cfg, p, exc)}", file=sys.stderr)
            rc = 1
            continue
        if op == "staged":
            rows = rep.get("uploads", [])
            print(f"server{p}: round {rep.get('round')}: {len(rows)} uploads staged")
            for row in rows:
                print("  " + ", ".join(f"{k} {_json_default(v) if isinstance(v, bytes) else v}"
                                       for k, v in row.items()))
        else:
            print(f"server{p}: " + ", ".join(f"{k} {v}" for k, v in rep.items()
                                             if k not in ("v", "id", "ok") and v != ""))
    return rc


def cmd_init_deployment(args: argparse.Namespace) -> int:

    overrides: dict[str, dict[str, Any]] = {"fl": {"rounds": args.rounds}}
    if args.deadline:
        overrides["fl"]["round_deadline"] = args.deadline
    try:
        path = write_scratch_deployment(args.dir, clients=args.clients, overrides=overrides,
                                        offline=args.offline)
    except (FileExistsError, ConfigError) as exc:
        return _fail("init-deployment", exc)
    print(f"wrote keys for server0, server1, dealer, admin, client-0..{args.clients - 1} and {path} "
          f"([deployment] offline = \"{args.offline}\")")
    ca_dir = path.parent / SCRATCH_CA_DIR
    print(f"WARNING: {ca_dir} holds the CA's private key (it can mint any certificate, admin "
          f"included): move it off this machine; `starfish keys issue|revoke --ca-dir` need it, "
          f"no daemon does", file=sys.stderr)
    cohort = load_config(path).fl.min_clients
    if cohort < 3:   # the file says min_clients = 1 or 2: say what that costs (issue 25, finding 5)
        print(f"WARNING: [fl] min_clients = {cohort} (every round needs all {args.clients} clients); "
              f"a round of fewer than 3 lets its step M_(i-1) - M_i show one client's update "
              f"(alone: to anyone; of 2: to the other), erased or not", file=sys.stderr)
    dealer = f"starfish dealer --config {path}; " if args.offline == "dealer" else ""
    print(f"start: {dealer}starfish server --party 1 --config {path}; starfish server --party 0 "
          f"--config {path}; starfish clients --config {path} --n {args.clients}")
    return 0


# ------------------------------------------------------------------ wiring
def add_commands(sub: Any) -> None:
    """Add the service's sub-commands to the ``starfish`` parser."""
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", required=True, metavar="CFG",
                       help="the deployment's TOML file, or the directory holding config.toml "
                            "(docs/service.md)")
        p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                       type=str.upper, help="log detail on stderr (INFO); DEBUG adds tracebacks")

    def connect_timeout(p: argparse.ArgumentParser, default: float) -> None:
        p.add_argument("--connect-timeout", type=float, default=default, metavar="S",
                       help=f"seconds to keep trying to reach each server before giving up ({default:g})")

    s = sub.add_parser("server", help="run server 0 or 1 (client API, FL rounds, unlearning jobs)")
    s.add_argument("--party", type=int, choices=(0, 1), required=True,
                   help="which server: 0 leads the FL rounds, 1 follows (start them in any order)")
    common(s)
    s.set_defaults(func=cmd_server)

    d = sub.add_parser("dealer", help="run the correlated-randomness dealer (dealer mode only)")
    common(d)
    d.set_defaults(func=cmd_dealer)

    c = sub.add_parser("clients", help="simulated FL clients: train, share, upload, answer corrections")
    common(c)
    c.add_argument("--n", type=int, default=20, help="number of clients (20); each needs its certificate")
    c.add_argument("--first-id", type=int, default=0, help="ids first-id..first-id+n-1 (0)")
    c.add_argument("--dataset", help="digits, mnist, fmnist, cifar10 ([clients] dataset)")
    c.add_argument("--data-dir", help="directory of the dataset files (not for digits)")
    c.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the clients' local training runs (auto: CUDA when torch sees a GPU, "
                        "else the CPU); shares and uploads are made on the CPU either way")
    c.add_argument("--backdoor", help="comma-separated ids of backdoor clients (e.g. 0)")
    c.add_argument("--unlearn", help="clients that request their own unlearning: CLIENT@ROUND once "
                                     "ROUND FL rounds are committed, or CLIENT after training "
                                     "(e.g. 3@20,5)")
    c.add_argument("--until", choices=("training", "jobs", "never"),
                   help="when to exit: training (default): once the FL rounds are over and every "
                        "unlearning job these clients requested (--unlearn) has ended, answering "
                        "correction tasks meanwhile; jobs: an older name of the same; never: keep "
                        "answering correction tasks (also for the operator's jobs) until stopped")
    c.add_argument("--twin-dir", help="write the plaintext twin history here (a new directory)")
    c.add_argument("--summary", help="write a JSON summary here")
    c.add_argument("--seed", type=int, help="data split and batch-order seed ([clients] seed)")
    c.add_argument("--epochs", type=float, help="local epochs per round (lab default of the dataset)")
    c.add_argument("--lr", type=float, help="local SGD learning rate (lab default of the dataset)")
    c.add_argument("--train-limit", type=int, help="use only this many training samples (all)")
    c.add_argument("--max-seconds", type=float, default=3600.0, metavar="S",
                   help="give up after this many seconds (3600)")
    c.set_defaults(func=cmd_clients)

    u = sub.add_parser("unlearn", help="request unlearning (your own data, or --admin for anyone's)")
    common(u)
    u.add_argument("--client", type=int, help="act as client-ID (its certificate) and unlearn it")
    u.add_argument("--admin", action="store_true", help="act as admin")
    u.add_argument("--targets", help="admin: comma-separated client ids")
    u.add_argument("--job", help="job id (default: random)")
    u.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="wait up to this many seconds for the result (0: return once both servers "
                        "hold the request)")
    connect_timeout(u, 4.0)
    u.set_defaults(func=cmd_unlearn)

    st = sub.add_parser("status", help="rounds, staging, jobs and what each server waits for")
    common(st)
    st.add_argument("--party", type=int, choices=(0, 1), help="ask only this server (both)")
    st.add_argument("--job", help="also show this job (with its result summary)")
    st.add_argument("--client", type=int, help="ask as client-ID instead of admin")
    st.add_argument("--save-model", metavar="M.npy", help="with --job: write the unlearned model (.npy) here")
    st.add_argument("--json", action="store_true",
                    help="print JSON instead of text ({\"server0\": {\"status\": ..., \"job\": ...} or "
                         "{\"error\": ...}, ...}; bytes as hex)")
    connect_timeout(st, 2.0)
    st.set_defaults(func=cmd_status)

    a = sub.add_parser("admin", help="operator actions at both servers: cancel a job, re-enrol a client, "
                                     "list or drop staged uploads")
    common(a)
    a.add_argument("action", choices=tuple(_ADMIN_OPS),
                   help="cancel JOB: cancel an unlearning job not yet adopted; reenrol CLIENT: let a "
                        "forgotten client take part again; staged: the uploads staged for the open "
                        "round (client, time, hash, |D_j|); drop-staged CLIENT: withdraw one client's "
                        "staged upload (it may upload again)")
    a.add_argument("target", nargs="?", help="the job id (cancel) or the client id (reenrol, drop-staged)")
    connect_timeout(a, 4.0)
    a.set_defaults(func=cmd_admin, client=None)

    i = sub.add_parser("init-deployment", help="write keys and a config for a loopback deployment",
                       description="Writes DIR/config.toml, DIR/keys (what the daemons read: ca.pem, "
                                   "crl.pem, each identity's certificate and key) and DIR/ca-offline "
                                   "(the CA's private key: move it off the machine).")
    i.add_argument("dir", help="new directory (refuses an existing CA)")
    i.add_argument("--clients", type=int, default=20, help="client certificates and clients_expected (20)")
    i.add_argument("--rounds", type=int, default=40, help="FL rounds (40)")
    i.add_argument("--deadline", type=float, metavar="S", help="round deadline in seconds (60)")
    i.add_argument("--offline", choices=OFFLINE_CHOICES, default=DEFAULT_OFFLINE.value,
                   help="[deployment] offline: two-party (default: no dealer, the servers make the "
                        "correlated randomness themselves) or dealer (faster; run `starfish dealer` too)")
    i.set_defaults(func=cmd_init_deployment)
