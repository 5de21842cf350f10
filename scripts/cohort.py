"""Stage cohort: write results/cohort (sources.csv, contact sheet, planted families or exclusions).

Under Snakemake this reads ``snakemake.config`` / ``snakemake.output``; standalone:
``python scripts/cohort.py --config config/config.yaml --out results/cohort``.
"""

from pathlib import Path

from fedhisto.cohort.stage import run_cohort
from fedhisto.entry import from_argv, from_snakemake

if "snakemake" in globals():
    smk = globals()["snakemake"]
    config = from_snakemake(smk)
    run_cohort(config.cohort, Path(smk.output.sources).parent, threads=smk.threads)
elif __name__ == "__main__":
    config, args = from_argv(__doc__, out="output folder, e.g. results/cohort")
    run_cohort(config.cohort, args.out, threads=args.threads)
