"""Stage bootstrap: results/bootstrap/{comparison}.json.

Standalone: ``python scripts/bootstrap.py --config config/config.yaml --comparison v2_vs_fedavg``.
"""

import argparse

from fedhisto.entry import from_snakemake, log_of, study_config_file
from fedhisto.infra.job_logging import setup_logging
from fedhisto.infra.warm_server import call

if "snakemake" in globals():
    smk = globals()["snakemake"]
    method_seeds, reference_seeds = smk.params.seeds
    call("fedhisto.bootstrap.stage:run_bootstrap", smk.wildcards.comparison, list(smk.input.method),
         list(smk.input.reference), (list(method_seeds), list(reference_seeds)), from_snakemake(smk).bootstrap,
         smk.output.json, smk.input.manifest, log_path=log_of(smk))
elif __name__ == "__main__":
    from fedhisto.bootstrap.stage import comparison_files, run_bootstrap

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="config/config.yaml")
    parser.add_argument("--comparison", required=True)
    args = parser.parse_args()
    setup_logging()
    cfg = study_config_file(args.config)
    files = comparison_files(cfg, args.comparison)
    run_bootstrap(args.comparison, files["method"][1], files["reference"][1],
                  (files["method"][0], files["reference"][0]), cfg.bootstrap,
                  f"results/bootstrap/{args.comparison}.json", "results/manifest/manifest.csv")
