"""Stage metrics: results/metrics (summary.csv, per_run.csv, client_level.csv, ensembles.csv, subgroups.csv;
rule summarize_robustness: robustness.csv and robustness.json).

Standalone: ``python scripts/metrics.py --config config/config.yaml [--robustness]`` (all configured runs).
"""

import argparse
from pathlib import Path

from fedhisto.entry import from_snakemake, log_of, study_config_file
from fedhisto.infra.job_logging import setup_logging
from fedhisto.infra.warm_server import call

if "snakemake" in globals():
    smk = globals()["snakemake"]
    if hasattr(smk.output, "robustness"):  # rule summarize_robustness
        runs = [(m, int(s), f) for m, s, f in smk.params.runs]
        call("fedhisto.metrics.stage:run_robustness", runs, smk.input.manifest, from_snakemake(smk),
             Path(smk.output.robustness).parent, threads=smk.threads, log_path=log_of(smk))
    else:
        runs = [(m, int(s), f, t) for m, s, f, t in smk.params.runs]
        call("fedhisto.metrics.stage:run_metrics", runs, from_snakemake(smk), Path(smk.output.summary).parent,
             log_path=log_of(smk))
elif __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="config/config.yaml")
    parser.add_argument("--robustness", action="store_true", help="robustness.csv/json instead of the metric tables")
    args = parser.parse_args()
    setup_logging()
    cfg = study_config_file(args.config)
    from fedhisto.metrics.stage import run_metrics, run_robustness

    runs = [(m, s, f"results/predictions/{m}/seed{s}", f"results/train/{m}/seed{s}") for m, s in cfg.train_runs()]
    if args.robustness:
        run_robustness(runs, "results/manifest/manifest.csv", cfg, "results/metrics")
    else:
        run_metrics(runs, cfg, "results/metrics")
