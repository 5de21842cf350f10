"""``fedhisto``: the human-facing command line (stages also run through Snakemake)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fedhisto import __version__
from fedhisto.config.study import ConfigError, json_schema_text
from fedhisto.entry import study_config_file
from fedhisto.realdata.sources import SourceError

SCHEMA_PATH = Path("workflow/schemas/config.schema.json")


def _cmd_schema(args: argparse.Namespace) -> int:
    """The config's JSON schema; with --write also the package's method settings schema
    (``method_settings.schema.json``), the config's own source for method blocks, first."""
    if args.write:
        from fedhisto.config.study import settings_schema_text
        from fedhisto.infra.atomic import write_text
        from fedhisto.registries.method_registry import SCHEMA_FILE

        write_text(SCHEMA_FILE, settings_schema_text())
        # the config models read the settings schema when fedhisto.config.study is imported: regenerate in a fresh process
        import subprocess

        text = subprocess.run([sys.executable, "-c", "from fedhisto.config.study import json_schema_text as t; "
                               "import sys; sys.stdout.write(t())"], check=True, capture_output=True, text=True).stdout
        write_text(args.write, text)
    else:
        sys.stdout.write(json_schema_text())
    return 0


def _cmd_check_config(args: argparse.Namespace) -> int:
    """The config a run given ``--configfile FILE... [--config K=V...]`` sees, built and validated as the
    workflow builds it (:func:`fedhisto.config.study.command_line_config`)."""
    from snakemake.cli import parse_config  # Snakemake's own reading of --config (nested values stay strings)

    from fedhisto.config.study import command_line_config

    try:
        overrides = parse_config(args.overrides or [])
    except ValueError as exc:
        raise ConfigError(f"--config {' '.join(args.overrides)}: {exc}") from None
    source = " + ".join(args.config) + (" + --config " + " ".join(args.overrides) if args.overrides else "")
    raw = command_line_config(args.config, overrides)
    import jsonschema  # the workflow's first check: the JSON schema (the same one, a test keeps them equal)

    from fedhisto.config.study import json_schema

    try:
        jsonschema.validate(raw, json_schema())
    except jsonschema.ValidationError as exc:
        where = ".".join(map(str, exc.absolute_path)) or "<root>"
        raise ConfigError(f"invalid configuration ({source}): key '{where}': {exc.message}") from None
    from fedhisto.entry import study_config

    cfg = study_config(raw, source=source)
    print(f"{source}: valid (cohort mode {cfg.cohort.mode}, encoder {cfg.model.encoder.name}; as "
          f"`snakemake --configfile {' '.join(args.config)}` sees it)")
    return 0


def _cmd_cohort(args: argparse.Namespace) -> int:
    from fedhisto.cohort.stage import run_cohort
    from fedhisto.infra.job_logging import setup_logging

    setup_logging()
    summary = run_cohort(study_config_file(args.config).cohort, args.out, threads=args.threads)
    print(json.dumps({"images": summary["images"], "listed": summary["listed"]}, indent=2))
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from fedhisto.clearance.stage import run_audit_folder
    from fedhisto.config.study import ClearanceConfig
    from fedhisto.infra.job_logging import setup_logging

    setup_logging()
    cfg = study_config_file(args.config).clearance if args.config else ClearanceConfig()
    audit = run_audit_folder(args.folder, args.out, cfg, threads=args.threads)
    print(json.dumps(audit["stats"], indent=2))
    return 0


def _cmd_model_card(args: argparse.Namespace) -> int:
    from fedhisto.model.parameter_card import model_card

    print(json.dumps(model_card(args.encoder, args.method), indent=2))
    return 0


def _cmd_probe_encoder(args: argparse.Namespace) -> int:
    from fedhisto.infra.job_logging import setup_logging
    from fedhisto.model.stain_probe import run_probe

    setup_logging()
    cfg = study_config_file(args.config)
    x = cfg.experiments
    summary = run_probe(cfg, args.images, args.out, encoder_dir=args.encoder_dir, split=args.split, limit=args.limit,
                        seed=args.seed, resamples=args.resamples or x.resamples, bootstrap_seed=x.bootstrap_seed,
                        threads=args.threads)
    keys = ("encoder", "images", "chance_retrieval", "within", "between", "ratio", "ratio_same_class", "retrieval_top1")
    print(json.dumps({k: summary[k] for k in keys if k in summary}, indent=2))
    return 0


# ------------------------------------------------------------------ federation (Flower; fedhisto[federation])
def _flower():
    try:
        from fedhisto.federation import deploy
    except ImportError as exc:  # pragma: no cover - only without the extra
        raise RuntimeError(f"{exc}: install the federation extra: pip install -e \".[federation]\"") from None
    return deploy


def _exec(cmd: list[str], env: dict | None = None) -> int:
    import os
    import subprocess

    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.call(cmd, env=env or dict(os.environ))


def _cmd_federation_keys(args: argparse.Namespace) -> int:
    deploy = _flower()
    out = Path(args.out)
    paths = deploy.make_tls(out / "certs", tuple(args.host)) if args.tls else {}
    keys = {s: [str(p) for p in deploy.make_site_key(out / "keys", s)] for s in args.sites}
    print(json.dumps({"tls": {k: str(v) for k, v in paths.items()}, "site_keys": keys}, indent=2))
    return 0


def _cmd_superlink(args: argparse.Namespace) -> int:
    deploy = _flower()
    tls = None if args.insecure else {"ca": args.ca, "cert": args.cert, "key": args.key}
    if tls and not all(tls.values()):
        raise RuntimeError("TLS is on by default: give --ca, --cert and --key (or run with --insecure)")
    return _exec(deploy.superlink_cmd(args.port, args.host, tls, args.database, args.insecure))


def _cmd_register_site(args: argparse.Namespace) -> int:
    deploy = _flower()
    env = _connection_env(deploy, args)
    print(deploy.flwr_cli(["supernode", "register", args.public_key, "fedhisto", "--name", args.site], env))
    return 0


def _connection_env(deploy, args) -> dict:
    home = Path(args.flwr_home).resolve()
    deploy.write_connection(home, "fedhisto", args.superlink, root_certificates=args.ca, insecure=args.insecure)
    if not args.insecure and not args.ca:
        raise RuntimeError("TLS is on by default: give --ca (the CA that signed the SuperLink), or --insecure")
    return deploy.flower_env(home)


def _cmd_site(args: argparse.Namespace) -> int:
    """The site's SuperNode, Flower's own; with ``--fastpath`` through ``supernode_poll`` and with the
    site's long-lived worker, which ends with this process."""
    import os
    import subprocess

    deploy = _flower()
    run_dir = Path(args.run_dir or f".fedhisto-site/{args.site}").resolve()
    cache = Path(args.cache_dir).resolve() if args.cache_dir else run_dir / "cache"
    env = deploy.flower_env(Path(args.flwr_home).resolve())
    common = (args.superlink, args.site, args.manifest, args.descriptors or "", args.ca, args.auth_key,
              args.runtime_port, args.insecure, args.encoder_dir or "", args.threads)
    if not args.fastpath:
        if args.warm_config or args.warm_run:
            raise ValueError("--warm-config/--warm-run warm up the site worker, which runs with --fastpath only")
        return _exec(deploy.supernode_cmd(*common, cache_dir=cache, report=args.report), env)
    from fedhisto.federation.fastpath import launch_commands as commands

    worker = run_dir / "worker.sock"
    cmd = commands.worker_cmd(worker, args.site, args.manifest, args.descriptors or "", args.encoder_dir or "",
                              cache, args.threads, parent_pid=os.getpid(), report=args.report,
                              warm_config=args.warm_config or "", warm_splits=tuple(args.warm_splits.split(",")),
                              warm_runs=tuple(args.warm_run))
    supernode = commands.supernode_cmd(*common, worker=worker, cache_dir=cache, report=args.report)
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=env)
    try:
        return _exec(supernode, env)
    finally:
        proc.terminate()
        proc.wait(10)


def _cmd_federate(args: argparse.Namespace) -> int:
    deploy = _flower()
    from fedhisto.federation import APP_DIR

    app_dir = APP_DIR
    if args.fastpath:
        if args.simulation:
            raise ValueError("--fastpath is a deployment's process model; the Simulation Engine has its own")
        if args.secure_aggregation:  # its site worker has no Flower Context to keep a site's terms in
            raise ValueError("--secure-aggregation runs Flower's SecAgg+ on stock Flower processes; the fast path's "
                             "site worker does not run Flower's client mods or keep a run's context: drop --fastpath")
        from fedhisto.federation.fastpath import APP_DIR as app_dir
        from fedhisto.federation.fastpath import require

        require()
    out = Path(args.out or f"results/train/{args.method}/seed{args.seed}").resolve()
    identity = args.dataset_identity or json.loads(Path(args.manifest_json).read_text())["dataset_identity"]
    rc = {"method": args.method, "seed": args.seed, "config": str(Path(args.config).resolve()),
          "descriptors": str(Path(args.descriptors).resolve()), "out-dir": str(out), "dataset-identity": identity,
          "sites": ",".join(args.sites), "eval-site": args.eval_site or "", "log-dir": str(out / "federation"),
          "round-timeout": float(args.round_timeout), "encoder-dir": args.encoder_dir or "",
          "evaluate": ",".join(args.evaluate or []), "secure-aggregation": bool(args.secure_aggregation),
          "secure-timeout": float(args.secure_timeout),
          "predictions-dir": str(Path(args.predictions_dir or f"results/predictions/{args.method}/seed{args.seed}")
                                 .resolve())}
    home = Path(args.flwr_home).resolve()
    if args.simulation:
        deploy.write_connection(home, "fedhisto", ":local-in-memory:",
                                simulation={"num_supernodes": len(args.sites), "num_cpus": args.threads})
        rc.update({"sim-manifest": str(Path(args.manifest).resolve()),
                   "sim-descriptors": str(Path(args.descriptors).resolve())})
        env = deploy.flower_env(home)
    else:
        env = _connection_env(deploy, args)
    cmd = [deploy.flower_bin("flwr"), "run", str(app_dir), "fedhisto", "--run-config", deploy.run_config_arg(rc),
           "--stream"]
    rc_ = _exec(cmd, env)
    status = out / "status.json"
    if status.exists():
        print(status.read_text())
    return rc_


def _cmd_site_prepare(args: argparse.Namespace) -> int:
    from fedhisto.federation.prepare import prepare_site
    from fedhisto.infra.job_logging import setup_logging

    setup_logging()
    out = args.out or f"results/site/{args.site_id}"
    upload = prepare_site(args.images, args.site_id, out, study_config_file(args.config), role=args.role,
                          source_site=args.source_site, layout=args.layout, exclude=args.exclude,
                          threads=args.threads, progress=True)
    print(json.dumps({"site": upload.site, "role": upload.role, "class_counts": upload.class_counts,
                      "upload": str(Path(out) / "upload.json")}, indent=2))
    return 0


def _cmd_check_uploads(args: argparse.Namespace) -> int:
    from fedhisto.federation.coordinator import check_uploads
    from fedhisto.infra.job_logging import setup_logging

    setup_logging()
    summary = check_uploads(args.uploads, study_config_file(args.config), args.out)
    print(json.dumps({"sites": sorted(summary["sites"]), "duplicates": summary["duplicates"],
                      "out": args.out}, indent=2))
    return 0


def _site_local_parsers(sub) -> None:
    p = sub.add_parser("site-prepare", help="site IT: clearance, holdout split, stain descriptor and manifest on "
                                            "this site's own images; writes upload.json (also: fedhisto site prepare)")
    p.add_argument("--images", required=True, help="this site's image folder (nothing else is read)")
    p.add_argument("--site-id", required=True, help="site id as the coordinator knows it (C1..C5, or e.g. EXT)")
    p.add_argument("--out", help="default results/site/<site-id>; upload.json is the file to send")
    p.add_argument("--config", default="config/config.yaml", help="the coordinator's config (same settings everywhere)")
    p.add_argument("--role", default="client", choices=["client", "validation", "test", "external"],
                   help="client: trains (optimisation + holdout); otherwise the evaluation set this site holds")
    p.add_argument("--layout", default="folders", choices=["folders", "lc25000", "wsss4luad", "lunghist700"],
                   help="folders: one class folder (ACA/Normal/SCC or an alias) per class")
    p.add_argument("--source-site", help="site tag in the portable relpaths (default: the folder's name)")
    p.add_argument("--exclude", help="the coordinator's drop list for this site (drops/<site-id>.csv)")
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(func=_cmd_site_prepare)

    p = sub.add_parser("check-uploads", help="coordinator: validate the sites' upload.json files, standardise the "
                                             "stain descriptors, audit cross-site duplicates, write drop lists")
    p.add_argument("uploads", nargs="+", help="every site's upload.json")
    p.add_argument("--config", default="config/config.yaml")
    p.add_argument("--out", default="results/coordinator")
    p.set_defaults(func=_cmd_check_uploads)


#: Two-word spellings of the site-local commands (``fedhisto site prepare`` = ``fedhisto site-prepare``).
ALIASES = {("site", "prepare"): "site-prepare", ("federation", "check-uploads"): "check-uploads"}


def _federation_parsers(sub) -> None:
    def connection(p, *, superlink: bool = True) -> None:
        if superlink:
            p.add_argument("--superlink", default="127.0.0.1:9093", help="host:port of the SuperLink")
        p.add_argument("--ca", help="CA certificate that signed the SuperLink's (TLS is on by default)")
        p.add_argument("--insecure", action="store_true", help="no TLS, no SuperNode authentication (testing only)")
        p.add_argument("--flwr-home", default=".flwr", help="Flower's client state folder (FLWR_HOME)")

    p = sub.add_parser("federation-keys", help="make a test CA + SuperLink certificate and each site's auth key pair")
    p.add_argument("--out", required=True)
    p.add_argument("--sites", nargs="+", default=["C1", "C2", "C3", "C4", "C5"])
    p.add_argument("--host", nargs="+", default=["127.0.0.1", "localhost"], help="SuperLink names in its certificate")
    p.add_argument("--no-tls", dest="tls", action="store_false", help="site keys only")
    p.set_defaults(func=_cmd_federation_keys)

    p = sub.add_parser("superlink", help="coordinator: start Flower's SuperLink (TLS + SuperNode authentication)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=9093, help="one HTTPS port for sites, CLI and ServerApp")
    p.add_argument("--ca")
    p.add_argument("--cert")
    p.add_argument("--key")
    p.add_argument("--database", default="superlink.db", help="keeps registrations/node ids across restarts")
    p.add_argument("--insecure", action="store_true")
    p.set_defaults(func=_cmd_superlink)

    p = sub.add_parser("register-site", help="coordinator: register a site's public key under its site id")
    p.add_argument("site")
    p.add_argument("public_key")
    connection(p)
    p.set_defaults(func=_cmd_register_site)

    p = sub.add_parser("site", help="site IT: start this site's SuperNode (runs the ClientApp on local data)")
    p.add_argument("--site", required=True, help="site id, as registered (C1..C5)")
    p.add_argument("--manifest", required=True, help="manifest CSV (or this site's slice of it)")
    p.add_argument("--descriptors", help="stain-stage descriptors JSON (FiLM methods)")
    p.add_argument("--auth-key", help="this site's private key (its .pub is registered by the coordinator)")
    p.add_argument("--runtime-port", type=int, default=9094, help="local port of the SuperNode (not exposed)")
    p.add_argument("--encoder-dir")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fastpath", action="store_true",
                   help="modify Flower's process model (tested on flwr 1.42.x only): a long-lived site worker "
                        "answers every message and the SuperNode polls every 0.2 s instead of 3 s "
                        "(fedhisto.federation.fastpath)")
    p.add_argument("--run-dir", help="the decoded-image cache and, with --fastpath, the worker's socket "
                                     "(default .fedhisto-site/SITE)")
    p.add_argument("--cache-dir", help="node-local cache of decoded images (default RUN_DIR/cache)")
    p.add_argument("--warm-config", help="--fastpath: the federation's config file: the worker loads the frozen encoder and "
                                          "decodes this site's images before the first message (once per start)")
    p.add_argument("--warm-splits", default="optimisation",
                   help="comma list of splits the worker decodes at start (an evaluation site: "
                        "optimisation,validation)")
    p.add_argument("--warm-run", action="append", default=[], metavar="METHOD:SEED",
                   help="with --warm-config: also build this run's model at start (repeatable)")
    p.add_argument("--report", choices=("rows", "counts"), default="rows",
                   help="federated evaluation: per-image prediction rows (default) or, this site's opt-out, "
                        "confusion counts and calibration bins only")
    connection(p)
    p.set_defaults(func=_cmd_site)

    p = sub.add_parser("federate", help="coordinator: run a method on the SuperLink (or --simulation) into "
                                        "results/train/{method}/seed{seed}")
    p.add_argument("--method", default="past_v2")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--config", default="config/config.yaml")
    p.add_argument("--descriptors", default="results/stain/descriptors.json")
    p.add_argument("--manifest-json", default="results/manifest/manifest.json", help="read for its dataset identity")
    p.add_argument("--dataset-identity")
    p.add_argument("--sites", nargs="+", default=["C1", "C2", "C3", "C4", "C5"])
    p.add_argument("--eval-site", help="the site(s) holding the validation split, comma-separated (default: the "
                                       "first site)")
    p.add_argument("--evaluate", nargs="+", metavar="SITE:SPLIT",
                   help="after training, score the best state at the sites holding these splits (test, holdout, "
                        "external), e.g. C1:holdout ... TEST:test EXT:external")
    p.add_argument("--predictions-dir", help="where --evaluate writes (default results/predictions/METHOD/seedSEED)")
    p.add_argument("--encoder-dir")
    p.add_argument("--round-timeout", type=float, default=900.0)
    p.add_argument("--out")
    p.add_argument("--simulation", action="store_true", help="Flower's Simulation Engine on this machine (Ray)")
    p.add_argument("--fastpath", action="store_true",
                   help="the fast path's Flower app (its ServerApp retries object pulls sooner); for sites "
                        "started with fedhisto site --fastpath (tested on flwr 1.42.x only)")
    p.add_argument("--secure-aggregation", action="store_true",
                   help="the server step receives only sums masked by Flower's SecAgg+ (methods that cannot are "
                        "refused by name; precision and threshold: the config's secure_aggregation block)")
    p.add_argument("--secure-timeout", type=float, default=120.0, help="seconds each SecAgg+ stage waits for the sites")
    p.add_argument("--manifest", default="results/manifest/manifest.csv", help="--simulation: the sites' data")
    p.add_argument("--threads", type=int, default=2)
    connection(p)
    p.set_defaults(func=_cmd_federate)


def _cmd_bench(args: argparse.Namespace) -> int:
    from fedhisto.bench.throughput import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedhisto", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fedhisto {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("schema", help="print (or --write) the config JSON schema generated from the typed config")
    p.add_argument("--write", metavar="PATH", help=f"write it here (the workflow reads {SCHEMA_PATH})")
    p.set_defaults(func=_cmd_schema)

    p = sub.add_parser("check-config", help="validate a config file (or several, laid in order as --configfile lays "
                       "them) and explain every problem")
    p.add_argument("config", nargs="+")
    p.add_argument("--config", dest="overrides", nargs="+", metavar="KEY=VALUE",
                   help="top-level overrides, read as Snakemake's --config reads them")
    p.set_defaults(func=_cmd_check_config)

    p = sub.add_parser("cohort", help="build results/cohort (synthetic or real sources) without Snakemake")
    p.add_argument("--config", default="config/config.yaml")
    p.add_argument("--out", default="results/cohort")
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=_cmd_cohort)

    p = sub.add_parser("audit", help="exact, perceptual and local-feature duplicate families of any image folder")
    p.add_argument("folder")
    p.add_argument("--out", required=True, help="writes families.csv, edges.csv, audit.json, report.md here")
    p.add_argument("--config", default=None, help="take the clearance settings from this config file")
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(func=_cmd_audit)

    from fedhisto.methods import method_names
    from fedhisto.registries.encoder_registry import ENCODER_NAMES

    p = sub.add_parser("model-card", help="parameter counts of a method's model as JSON (no weights downloaded)")
    p.add_argument("--encoder", choices=ENCODER_NAMES, default="hibou-b")
    p.add_argument("--method", choices=method_names(), default="past_v2")
    p.set_defaults(func=_cmd_model_card)
    p = sub.add_parser("probe-encoder", help="stain sensitivity of the frozen encoder: how far paired stain draws move "
                                             "an embedding vs the distance between tissues, and same-tissue retrieval")
    p.add_argument("--images", required=True, help="an image folder (recursive) or a CSV with sample_id and path "
                                                   "columns (a manifest, the dose-response cohort)")
    p.add_argument("--out", required=True, help="writes probe.json and per_image.csv here")
    p.add_argument("--config", default="config/config.yaml", help="model.encoder, views and evaluate.eval_batch")
    p.add_argument("--encoder-dir", default=None, help="the tiny encoder's folder (results/pretrain/encoder); "
                                                       "other encoders: model.encoder.local_dir or the hub")
    p.add_argument("--split", default=None, help="only this split of a manifest CSV (e.g. optimisation)")
    p.add_argument("--limit", type=int, default=None, help="the first N images by sample id")
    p.add_argument("--seed", type=int, default=0, help="seed of the stain draws")
    p.add_argument("--resamples", type=int, default=None, help="bootstrap resamples (default experiments.resamples)")
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=_cmd_probe_encoder)
    from fedhisto.classify.commands import use_parsers
    from fedhisto.model.snapshot import fetch_parsers

    use_parsers(sub)
    fetch_parsers(sub)
    _federation_parsers(sub)
    _site_local_parsers(sub)
    from fedhisto.records.record_blocks import add_parser as records_parser

    records_parser(sub)

    p = sub.add_parser("bench", help="pairs/s (sequential vs batched engine), inference images/s, peak memory, "
                                     "ratio to a matmul peak measured in the same run")
    p.add_argument("--config", default=None, help="the pipeline's config whose training the bench measures (encoder, "
                                                  "heads, crop, batches, members, engine, views, precision; default: "
                                                  "the study's settings)")
    p.add_argument("--encoder", choices=ENCODER_NAMES, default=None, help="another encoder than the config's")
    p.add_argument("--members", type=int, nargs="+", default=[None],
                   help="members trained together (default: one job's participants, as the pipeline runs; more: "
                        "clients x seeds); several values: one run each, in one process")
    p.add_argument("--micro-batch", type=int, default=None, help="paired images per member and micro-batch (default: "
                                                                 "the config's)")
    p.add_argument("--accumulation-steps", type=int, default=None, help="micro-batches per optimiser step (default: "
                                                                        "the config's)")
    p.add_argument("--iters", type=int, default=None, help="timed micro-batch steps (default: two optimiser steps)")
    p.add_argument("--warmup", type=int, default=None, help="untimed micro-batch steps (default: one optimiser step)")
    p.add_argument("--inference-batch", type=int, default=None, help="default 256 on a GPU, 32 on a CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the batched step's encoder pass (train.compile)")
    p.add_argument("--depth", type=int, default=None, help="build only this many encoder blocks (CPU dry runs)")
    p.add_argument("--view-samples", type=int, default=16, help="images the host view rate is timed on")
    p.add_argument("--json", metavar="PATH", help="also write the figures here as JSON")
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if tuple(argv[:2]) in ALIASES:
        argv = [ALIASES[tuple(argv[:2])], *argv[2:]]
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, SourceError, OSError, RuntimeError) as exc:
        print(f"fedhisto: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
