"""Stage predict: results/predictions/{method}/seed{seed}/{test,holdout,external}.csv.

Under Snakemake one job predicts every seed of a method (rule predict_cohorts); the experiments'
rule predict_condition predicts one seed.
Standalone: ``python scripts/predict.py --config config/config.yaml --method past_v2 [--seed 11]``
(without --seed: every seed the method trains on).
"""

import argparse
from pathlib import Path

from fedhisto.entry import from_snakemake, log_of, study_config_file
from fedhisto.infra.job_logging import setup_logging
from fedhisto.infra.warm_server import call

if "snakemake" in globals():
    smk = globals()["snakemake"]
    cfg = from_snakemake(smk)
    encoder = smk.input.encoder[0] if smk.input.encoder else None
    if hasattr(smk.wildcards, "seed"):  # one run (experiments' predict_condition)
        call("fedhisto.predict.stage:run_predict", smk.wildcards.method, int(smk.wildcards.seed),
             Path(smk.input.status).parent, smk.input.manifest, smk.input.identity, smk.input.descriptors, cfg,
             Path(smk.output.test).parent, encoder_dir=encoder, threads=smk.threads, log_path=log_of(smk))
    else:  # every seed of one method: output folders are results/predictions/{method}/seed{seed}
        out_dirs = {int(Path(p).parent.name.removeprefix("seed")): Path(p).parent for p in smk.output}
        train_dirs = {int(Path(p).parent.name.removeprefix("seed")): Path(p).parent for p in smk.input.status}
        seeds = [int(s) for s in smk.params.seeds]
        if sorted(out_dirs) != sorted(seeds) or sorted(train_dirs) != sorted(seeds):
            raise ValueError(f"predict {smk.wildcards.method}: seeds {seeds} vs outputs {sorted(out_dirs)} "
                             f"and inputs {sorted(train_dirs)}")
        call("fedhisto.predict.stage:run_predict_seeds", smk.wildcards.method, [(s, train_dirs[s], out_dirs[s]) for s in seeds],
             smk.input.manifest, smk.input.identity, smk.input.descriptors, cfg, encoder_dir=encoder,
             threads=smk.threads, log_path=log_of(smk))
elif __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="config/config.yaml")
    parser.add_argument("--method", required=True)
    parser.add_argument("--seed", type=int, default=None, help="one seed (default: every seed the method trains on)")
    args = parser.parse_args()
    setup_logging()
    cfg = study_config_file(args.config)
    from fedhisto.predict.stage import run_predict_seeds

    seeds = [args.seed] if args.seed is not None else cfg.trained_seeds(args.method)
    runs = [(s, f"results/train/{args.method}/seed{s}", f"results/predictions/{args.method}/seed{s}") for s in seeds]
    run_predict_seeds(args.method, runs, "results/manifest/manifest.csv", "results/manifest/manifest.json",
                      "results/stain/descriptors.json", cfg,
                      encoder_dir="results/pretrain/encoder" if cfg.model.pretrain.enabled else None)
