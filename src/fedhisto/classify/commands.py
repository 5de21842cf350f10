"""``fedhisto export`` and ``fedhisto classify``: the command-line side of using a trained model."""

from __future__ import annotations

import argparse
import json

from fedhisto.config.study import ConfigError
from fedhisto.entry import study_config_file

DEFAULT_CONFIG = "config/config.yaml"  # the Snakefile's configfile: what a run without --configfile used


def _cmd_export(args: argparse.Namespace) -> int:
    from fedhisto.export.stage import run_export
    from fedhisto.infra.job_logging import setup_logging

    setup_logging(args.log)
    cfg = study_config_file(*export_config_files(args))
    encoder_dir = args.encoder_dir or ("results/pretrain/encoder" if cfg.model.pretrain.enabled else None)
    summary = run_export(args.method, cfg, args.out, train_root=args.train, predictions_root=args.predictions,
                         descriptors_json=args.descriptors, manifest_json=args.manifest_json,
                         encoder_dir=encoder_dir, overwrite=args.overwrite)
    print(json.dumps(summary, indent=2))
    return 0


def export_config_files(args: argparse.Namespace) -> list[str]:
    """The config files of the run being exported: ``--configfile`` as the run gave them to Snakemake (several,
    laid in order, later wins, over nothing else), else ``--config FILE``, else the Snakefile's own default."""
    if args.configfile and args.config:
        raise ConfigError("give the run's config as --configfile FILE... (as Snakemake took it) or --config FILE, "
                         "not both")
    return list(args.configfile or [args.config or DEFAULT_CONFIG])


def _cmd_classify(args: argparse.Namespace) -> int:
    from fedhisto.infra.job_logging import setup_logging

    setup_logging(args.log)
    from fedhisto.classify.stage import run_classify

    summary = run_classify(args.model, args.images, args.out, descriptor=args.descriptor,
                           calibrate=args.calibration, labels=args.labels, encoder_dir=args.encoder_dir,
                           uncertain_below=args.uncertain_below, max_megapixels=args.max_megapixels,
                           contact_sheet=args.contact_sheet, threads=args.threads, device=args.device,
                           false_flag_rate=args.false_flag_rate)
    print(json.dumps({**{k: summary[k] for k in ("classified", "excluded", "converted", "label_counts")},
                      "domain": summary["domain"]["line"]}, indent=2))
    return 0


def use_parsers(sub) -> None:
    p = sub.add_parser("export", help="one method's finalised seeds (its ensemble) as a self-contained model "
                                      "package: safetensors, peft adapters, model card, checksums")
    p.add_argument("--method", default="past_v2")
    p.add_argument("--out", required=True, help="the package folder (must not exist or be empty)")
    p.add_argument("--configfile", nargs="+", metavar="FILE",
                   help="the run's config files as given to snakemake --configfile (laid in order, later wins)")
    p.add_argument("--config", metavar="FILE", help=f"one config file (default {DEFAULT_CONFIG})")
    p.add_argument("--train", default="results/train", help="the pipeline's training folders")
    p.add_argument("--predictions", default="results/predictions", help="for the model card's metrics")
    p.add_argument("--descriptors", default="results/stain/descriptors.json")
    p.add_argument("--manifest-json", default="results/manifest/manifest.json", help="read for its dataset identity")
    p.add_argument("--encoder-dir", help="the encoder folder the runs used (default: results/pretrain/encoder "
                                         "when the config pretrains the tiny encoder)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing package folder")
    p.add_argument("--log", help="also write the log here")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("classify", help="classify a folder of images with an exported package (no labels needed)")
    p.add_argument("--model", required=True, help="a package folder made by `fedhisto export`")
    p.add_argument("--images", required=True, help="image folder (searched recursively)")
    p.add_argument("--out", required=True, help="CSV, one row per image; beside it .json, .exclusions.csv and "
                                                ".contact_sheet.png")
    p.add_argument("--descriptor", choices=("centroid", "site"), default=None,
                   help="FiLM's stain descriptor: the training centroid (default, the study's choice for unseen "
                        "data) or this folder's own (falls back to the centroid on too little tissue)")
    p.add_argument("--no-calibration", dest="calibration", action="store_false",
                   help="raw ensemble probabilities (no temperature scaling)")
    p.add_argument("--labels", help="CSV with columns image,label: adds metrics with bootstrap intervals")
    p.add_argument("--encoder-dir", help="a local snapshot of the package's encoder (packages of hub encoders)")
    p.add_argument("--uncertain-below", type=float, default=0.6,
                   help="flag an image uncertain when its top probability is below this (or members disagree)")
    p.add_argument("--false-flag-rate", type=float, default=0.05,
                   help="domain check: the share of in-domain images allowed to be flagged out of domain (the "
                        "threshold is calibrated on the training sites' holdout images)")
    p.add_argument("--max-megapixels", type=float, default=100.0,
                   help="refuse (list as excluded) images larger than this; tile them first")
    p.add_argument("--contact-sheet", help="PNG path (default: beside --out)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="where to compute (as train.device): auto = the GPU if usable, else the CPU")
    p.add_argument("--log", help="also write the log here")
    p.set_defaults(func=_cmd_classify)
