"""The service's commands: server, dealer, clients, unlearn, status, init-deployment.

Why a module of its own: ``starfish/cli.py`` only wires sub-commands; these functions read
the config, set up logging and signals, and call into ``servers``/``clients``. Imports are at
the top: the command line loads torch for its lab and benchmark arguments anyway (measured:
``starfish --help`` takes 2.3 s either way), so deferring them here bought nothing.
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
from typing import Any

import numpy as np
import torch

from lab.experiment import DATASET_DEFAULTS
from clients.initial_model import architecture_of, initial_model
from clients.service_client import ServiceClient, ServiceError
from clients.simulator import FederationSpec, Simulator, build_federation, parse_unlearn, write_summary
from net import tls
from common import wire
from net.channel import ChannelError
from common.service_config import SCRATCH_CA_DIR, ConfigError, load_config, write_scratch_deployment
from servers.dealer_daemon import run_dealer
from lab.history import NpzTwinRecorder
from servers.daemon.server_daemon import ServerDaemon, install_crash_points

__all__ = ["add_commands"]


def _logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


def _on_signals(stop: Any) -> None:
    def handler(signum: int, _frame: Any) -> None:
        logging.getLogger("starfish").info("signal %d: stopping", signum)
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _config(args: argparse.Namespace):
    try:
        return load_config(args.config)
    except ConfigError as exc:
        print(f"starfish {args.command}: {exc}", file=sys.stderr)
        sys.exit(2)


# ------------------------------------------------------------------ daemons
def cmd_server(args: argparse.Namespace) -> int:
    cfg = _config(args)
    _logging(args.log_level)

    torch.set_num_threads(1)
    install_crash_points(os.environ.get("STARFISH_CRASH_AT"))
    try:
        daemon = ServerDaemon(cfg, args.party, initial_model(cfg.model))
    except tls.KeyDirError as exc:
        print(f"starfish server: {exc}", file=sys.stderr)
        return 2
    _on_signals(daemon.stop)
    daemon.serve_forever()
    return 0


def cmd_dealer(args: argparse.Namespace) -> int:
    cfg = _config(args)
    _logging(args.log_level)
    if cfg.offline == "two-party":
        print("starfish dealer: this deployment runs in two-party mode ([deployment] offline = "
              "\"two-party\"): it has no dealer, and none must run", file=sys.stderr)
        return 2

    stop = threading.Event()
    _on_signals(stop.set)
    try:
        run_dealer(cfg, stop)
    except tls.KeyDirError as exc:
        print(f"starfish dealer: {exc}", file=sys.stderr)
        return 2
    return 0


# ------------------------------------------------------------------ simulated clients
def federation_spec(cfg: Any, args: argparse.Namespace) -> Any:
    """The simulator's FederationSpec: command line, then [clients]/[model], then lab defaults."""

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
        boost=d.get("boost", 1.0), train_limit=args.train_limit)


def cmd_clients(args: argparse.Namespace) -> int:
    cfg = _config(args)
    _logging(args.log_level)

    torch.set_num_threads(1)
    try:
        spec = federation_spec(cfg, args)
    except ConfigError as exc:
        print(f"starfish clients: {exc}", file=sys.stderr)
        return 2
    fed = build_federation(spec)
    ids = list(range(args.first_id, args.first_id + args.n))
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

    ident = "admin" if getattr(args, "client", None) is None else f"client-{args.client}"
    return ServiceClient(cfg.keys_dir, ident, party, cfg.server(party).api().address,
                         max_bytes=cfg.limits.max_frame_bytes, connect_timeout=args.connect_timeout)


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
    conns = [_connection(cfg, p, args) for p in (0, 1)]
    try:
        for p, c in enumerate(conns):
            rep = c.call("unlearn", retry_seconds=args.connect_timeout, **fields)
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
    except (ServiceError, ChannelError) as exc:
        print(f"starfish unlearn: {exc}", file=sys.stderr)
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


def cmd_status(args: argparse.Namespace) -> int:
    cfg = _config(args)

    parties = [0, 1] if args.party is None else [args.party]
    out: dict[str, Any] = {}
    rc = 0
    for p in parties:
        try:
            with _connection(cfg, p, args) as c:
                st = c.call("status")
                job = None
                if args.job:
                    job = c.call("job_status", job=args.job, with_model=bool(args.save_model))
                    _save_model(job, args.save_model, p)
        except (ServiceError, ChannelError) as exc:
            out[f"server{p}"] = {"error": str(exc)}
            rc = 1
            continue
        out[f"server{p}"] = {"status": st, "job": job}
    if args.json:
        print(json.dumps(out, indent=1, default=str))
        return rc
    for name, v in out.items():
        if "error" in v:
            print(f"{name}: unreachable: {v['error']}")
            continue
        st = v["status"]
        print(f"{name}: {st['T']}/{st['rounds']} rounds committed; "
              + (f"round {st['open_round']} open, {len(st['staged'])} uploads staged"
                 if st["open_round"] else "training finished")
              + (f"; running job {st['busy_job']}" if st["busy_job"] else ""))
        for j in st["jobs"][-10:]:
            print(f"  job {j['job']}: {j['state']} {100 * j['progress']:.0f}% targets {j['targets']} "
                  f"by {j['requester']}" + (f" ({j['error']})" if j.get("error") else ""))
        for f in st.get("forgotten", []):
            print(f"  client {f['client']} forgotten by job {f['job']}"
                  + (f", re-enrolled by {f['reenrolled_by']}" if f.get("reenrolled_by") else ""))
        if v["job"]:
            _print_job(v["job"])
    return rc


def cmd_admin(args: argparse.Namespace) -> int:
    """``starfish admin cancel JOB`` / ``starfish admin reenrol CLIENT``, at both servers."""
    cfg = _config(args)
    op, fields = (("cancel_job", {"job": args.target}) if args.action == "cancel"
                  else ("reenrol", {"client": int(args.target)}))
    rc = 0
    for p in (0, 1):
        try:
            with _connection(cfg, p, args) as c:
                rep = c.call(op, **fields)
            print(f"server{p}: " + ", ".join(f"{k} {v}" for k, v in rep.items() if v != ""))
        except (ServiceError, ChannelError) as exc:
            print(f"server{p}: {exc}", file=sys.stderr)
            rc = 1
    return rc


def cmd_init_deployment(args: argparse.Namespace) -> int:

    overrides: dict[str, dict[str, Any]] = {"fl": {"rounds": args.rounds}}
    if args.deadline:
        overrides["fl"]["round_deadline"] = args.deadline
    try:
        path = write_scratch_deployment(args.dir, clients=args.clients, overrides=overrides)
    except FileExistsError as exc:
        print(f"starfish init-deployment: {exc}", file=sys.stderr)
        return 2
    print(f"wrote keys for server0, server1, dealer, admin, client-0..{args.clients - 1} and {path}")
    ca_dir = path.parent / SCRATCH_CA_DIR
    print(f"WARNING: {ca_dir} holds the CA's private key (it can mint any certificate, admin "
          f"included): move it off this machine; `starfish keys issue|revoke --ca-dir` need it, "
          f"no daemon does", file=sys.stderr)
    print("start: starfish dealer --config CFG; starfish server --party 1 --config CFG; "
          "starfish server --party 0 --config CFG; starfish clients --config CFG --n N")
    return 0


# ------------------------------------------------------------------ wiring
def add_commands(sub: Any) -> None:
    """Add the service's sub-commands to the ``starfish`` parser."""
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", required=True, help="the deployment's TOML file (docs/service.md)")
        p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (INFO)")

    s = sub.add_parser("server", help="run server 0 or 1 (client API, FL rounds, unlearning jobs)")
    s.add_argument("--party", type=int, choices=(0, 1), required=True)
    common(s)
    s.set_defaults(func=cmd_server)

    d = sub.add_parser("dealer", help="run the correlated-randomness dealer")
    common(d)
    d.set_defaults(func=cmd_dealer)

    c = sub.add_parser("clients", help="simulated FL clients: train, share, upload, answer corrections")
    common(c)
    c.add_argument("--n", type=int, default=20, help="number of clients (20)")
    c.add_argument("--first-id", type=int, default=0, help="ids first-id..first-id+n-1 (0)")
    c.add_argument("--dataset", help="digits, mnist, fmnist, cifar10 ([clients] dataset)")
    c.add_argument("--data-dir", help="directory of the dataset files (not for digits)")
    c.add_argument("--backdoor", help="comma-separated ids of backdoor clients (e.g. 0)")
    c.add_argument("--unlearn", help="clients that request their own unlearning: CLIENT@ROUND once "
                                     "ROUND FL rounds are committed, or CLIENT after training "
                                     "(e.g. 3@20,5)")
    c.add_argument("--until", choices=("training", "jobs", "never"),
                   help="exit once training is over and the requested jobs ended (training, "
                        "default; jobs is the same), or never")
    c.add_argument("--twin-dir", help="write the plaintext twin history here (a new directory)")
    c.add_argument("--summary", help="write a JSON summary here")
    c.add_argument("--seed", type=int, help="data split and batch-order seed ([clients] seed)")
    c.add_argument("--epochs", type=float, help="local epochs (lab default of the dataset)")
    c.add_argument("--lr", type=float, help="local SGD learning rate (lab default of the dataset)")
    c.add_argument("--train-limit", type=int, help="use only this many training samples")
    c.add_argument("--max-seconds", type=float, default=3600.0, help="give up after (3600)")
    c.set_defaults(func=cmd_clients)

    u = sub.add_parser("unlearn", help="request unlearning (your own data, or --admin for anyone's)")
    common(u)
    u.add_argument("--client", type=int, help="act as client-ID (its certificate) and unlearn it")
    u.add_argument("--admin", action="store_true", help="act as admin")
    u.add_argument("--targets", help="admin: comma-separated client ids")
    u.add_argument("--job", help="job id (default: random)")
    u.add_argument("--wait", type=float, default=0.0, help="wait up to this many seconds for the result")
    u.add_argument("--connect-timeout", type=float, default=10.0)
    u.set_defaults(func=cmd_unlearn)

    st = sub.add_parser("status", help="rounds, staging and jobs of both servers")
    common(st)
    st.add_argument("--party", type=int, choices=(0, 1), help="only this server")
    st.add_argument("--job", help="also show this job (with its result summary)")
    st.add_argument("--client", type=int, help="ask as client-ID instead of admin")
    st.add_argument("--save-model", help="with --job: write the unlearned model (.npy) here")
    st.add_argument("--json", action="store_true")
    st.add_argument("--connect-timeout", type=float, default=10.0)
    st.set_defaults(func=cmd_status)

    a = sub.add_parser("admin", help="operator actions at both servers: cancel a job, re-enrol a client")
    common(a)
    a.add_argument("action", choices=("cancel", "reenrol"))
    a.add_argument("target", help="cancel: the job id; reenrol: the client id")
    a.add_argument("--connect-timeout", type=float, default=10.0)
    a.set_defaults(func=cmd_admin, client=None)

    i = sub.add_parser("init-deployment", help="write keys and a config for a loopback deployment",
                       description="Writes DIR/config.toml, DIR/keys (what the daemons read: ca.pem, "
                                   "crl.pem, each identity's certificate and key) and DIR/ca-offline "
                                   "(the CA's private key: move it off the machine).")
    i.add_argument("dir", help="new directory (refuses an existing CA)")
    i.add_argument("--clients", type=int, default=20, help="client certificates and clients_expected (20)")
    i.add_argument("--rounds", type=int, default=40, help="FL rounds (40)")
    i.add_argument("--deadline", type=float, help="round deadline in seconds (60)")
    i.set_defaults(func=cmd_init_deployment)
