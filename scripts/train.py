"""Stage train: one federated run, results/train/{method}/seed{seed}/.

Standalone: ``python scripts/train.py --config config/config.yaml --method past_v2 --seed 11
--out results/train/past_v2/seed11`` (reads results/manifest and results/stain). Rerunning the
same command resumes from the last completed round.
"""

import argparse
import logging
from pathlib import Path

from fedhisto.caveats import log_caveats
from fedhisto.entry import from_snakemake, log_of, study_config_file
from fedhisto.infra.job_logging import setup_logging
from fedhisto.infra.warm_server import call

if "snakemake" in globals():
    smk = globals()["snakemake"]
    config = from_snakemake(smk)
    log_caveats(config, logging.getLogger("fedhisto.train"))  # a real cohort on the tiny encoder / short schedule
    call("fedhisto.train.stage:run_train", smk.wildcards.method, int(smk.wildcards.seed), smk.input.manifest,
         smk.input.identity, smk.input.descriptors, config, Path(smk.output.status).parent,
         encoder_dir=smk.input.encoder[0] if smk.input.encoder else None, threads=smk.threads, log_path=log_of(smk))
elif __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="config/config.yaml")
    parser.add_argument("--method", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--manifest", default="results/manifest/manifest.csv")
    parser.add_argument("--identity", default="results/manifest/manifest.json")
    parser.add_argument("--descriptors", default="results/stain/descriptors.json")
    parser.add_argument("--encoder-dir", default=None, help="pretrained encoder folder (results/pretrain/encoder)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    setup_logging()
    config = study_config_file(args.config)
    log_caveats(config, logging.getLogger("fedhisto.train"))
    from fedhisto.train.stage import run_train

    run_train(args.method, args.seed, args.manifest, args.identity, args.descriptors, config,
              args.out, encoder_dir=args.encoder_dir, threads=args.threads)
