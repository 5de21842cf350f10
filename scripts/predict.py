"""Stage predict: results/predictions/{method}/seed{seed}/{test,holdout,external}.csv.

Standalone: ``python scripts/predict.py --config config/config.yaml --method past_v2 --seed 11``.
"""

import argparse
from pathlib import Path

from fedhisto.config import load_config_file
from fedhisto.entry import from_snakemake, setup_logging
from fedhisto.predict import run_predict

if "snakemake" in globals():
    smk = globals()["snakemake"]
    run_predict(smk.wildcards.method, int(smk.wildcards.seed), Path(smk.input.status).parent, smk.input.manifest,
                smk.input.identity, smk.input.descriptors, from_snakemake(smk), Path(smk.output.test).parent,
                encoder_dir=smk.input.encoder[0] if smk.input.encoder else None, threads=smk.threads)
elif __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="config/config.yaml")
    parser.add_argument("--method", required=True)
    parser.add_argument("--seed", type=int, required=True)
    args = parser.parse_args()
    setup_logging()
    cfg = load_config_file(args.config)
    run = f"{args.method}/seed{args.seed}"
    run_predict(args.method, args.seed, f"results/train/{run}", "results/manifest/manifest.csv",
                "results/manifest/manifest.json", "results/stain/descriptors.json", cfg, f"results/predictions/{run}",
                encoder_dir="results/pretrain/encoder" if cfg.model.pretrain.enabled else None)
