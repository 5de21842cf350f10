"""Stage clearance: write results/clearance (edges.csv, families.csv, audit.json, report.md).

Standalone: ``python scripts/clearance.py --config config/config.yaml --sources results/cohort/sources.csv
--out results/clearance [--planted results/cohort/planted_families.csv]``.
"""

import argparse
from pathlib import Path

from fedhisto.clearance.stage import run_clearance
from fedhisto.entry import from_snakemake, study_config_file
from fedhisto.infra.job_logging import setup_logging

if "snakemake" in globals():
    smk = globals()["snakemake"]
    config = from_snakemake(smk)
    planted = smk.input.planted[0] if smk.input.planted else None
    run_clearance(smk.input.sources, config.clearance, Path(smk.output.edges).parent, threads=smk.threads,
                  planted_csv=planted, progress=False)
elif __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="config/config.yaml")
    parser.add_argument("--sources", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--planted", default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    setup_logging()
    run_clearance(args.sources, study_config_file(args.config).clearance, args.out, threads=args.threads,
                  planted_csv=args.planted)
