"""``fedhisto``: the human-facing command line (stages also run through Snakemake)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fedhisto import __version__
from fedhisto.config import ConfigError, json_schema_text, load_config_file
from fedhisto.sources import SourceError

SCHEMA_PATH = Path("workflow/schemas/config.schema.json")


def _cmd_schema(args: argparse.Namespace) -> int:
    text = json_schema_text()
    if args.write:
        from fedhisto.atomic import write_text

        write_text(args.write, text)
    else:
        sys.stdout.write(text)
    return 0


def _cmd_check_config(args: argparse.Namespace) -> int:
    cfg = load_config_file(args.config)
    print(f"{args.config}: valid (cohort mode {cfg.cohort.mode})")
    return 0


def _cmd_cohort(args: argparse.Namespace) -> int:
    from fedhisto.cohort import run_cohort
    from fedhisto.entry import setup_logging

    setup_logging()
    summary = run_cohort(load_config_file(args.config).cohort, args.out, threads=args.threads)
    print(json.dumps({"images": summary["images"], "listed": summary["listed"]}, indent=2))
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from fedhisto.clearance import run_audit_folder
    from fedhisto.config import ClearanceConfig
    from fedhisto.entry import setup_logging

    setup_logging()
    cfg = load_config_file(args.config).clearance if args.config else ClearanceConfig()
    audit = run_audit_folder(args.folder, args.out, cfg, threads=args.threads)
    print(json.dumps(audit["stats"], indent=2))
    return 0


def _cmd_model_card(args: argparse.Namespace) -> int:
    from fedhisto.model.card import model_card

    print(json.dumps(model_card(args.encoder, args.method), indent=2))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from fedhisto.bench import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedhisto", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fedhisto {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("schema", help="print (or --write) the config JSON schema generated from the typed config")
    p.add_argument("--write", metavar="PATH", help=f"write it here (the workflow reads {SCHEMA_PATH})")
    p.set_defaults(func=_cmd_schema)

    p = sub.add_parser("check-config", help="validate a config file and explain every problem")
    p.add_argument("config")
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
    from fedhisto.model.encoder import ENCODER_SHAPES

    p = sub.add_parser("model-card", help="parameter counts of a method's model as JSON (no weights downloaded)")
    p.add_argument("--encoder", choices=sorted(ENCODER_SHAPES), default="hibou-b")
    p.add_argument("--method", choices=method_names(), default="past_v2")
    p.set_defaults(func=_cmd_model_card)

    p = sub.add_parser("bench", help="pairs/s (sequential vs batched engine), inference images/s, peak memory, "
                                     "ratio to a matmul peak measured in the same run")
    p.add_argument("--encoder", choices=sorted(ENCODER_SHAPES), default="tiny")
    p.add_argument("--members", type=int, default=5, help="members trained together (clients x seeds)")
    p.add_argument("--micro-batch", type=int, default=4, help="paired images per member and micro-batch")
    p.add_argument("--accumulation-steps", type=int, default=2, help="micro-batches per optimiser step")
    p.add_argument("--iters", type=int, default=None, help="timed micro-batch steps (default: two optimiser steps)")
    p.add_argument("--warmup", type=int, default=None, help="untimed micro-batch steps (default: one optimiser step)")
    p.add_argument("--inference-batch", type=int, default=None, help="default 256 on a GPU, 32 on a CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the encoder of the batched step")
    p.add_argument("--json", metavar="PATH", help="also write the figures here as JSON")
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, SourceError, OSError, RuntimeError) as exc:
        print(f"fedhisto: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
