"""Stage bootstrap: results/bootstrap/{comparison}.json.

Standalone: ``python scripts/bootstrap.py --config config/config.yaml --comparison v2_vs_fedavg``.
"""

import argparse

from fedhisto.bootstrap import run_bootstrap
from fedhisto.config import load_config_file
from fedhisto.entry import from_snakemake, setup_logging

if "snakemake" in globals():
    smk = globals()["snakemake"]
    run_bootstrap(smk.wildcards.comparison, list(smk.input.method), list(smk.input.reference),
                  from_snakemake(smk).bootstrap, smk.output.json)
elif __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="config/config.yaml")
    parser.add_argument("--comparison", required=True)
    args = parser.parse_args()
    setup_logging()
    cfg = load_config_file(args.config)
    comp = cfg.bootstrap.comparisons[args.comparison]

    def files(method: str) -> list[str]:
        seeds = cfg.train.seeds if method in cfg.train.methods else cfg.train.ablation_seeds
        return [f"results/predictions/{method}/seed{s}/external.csv" for s in seeds]

    run_bootstrap(args.comparison, files(comp.method), files(comp.reference), cfg.bootstrap,
                  f"results/bootstrap/{args.comparison}.json")
