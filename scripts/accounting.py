"""Stage accounting: write results/accounting/communication.csv (Table 8 from real tensor shapes).

Standalone: ``python scripts/accounting.py --config config/paper.yaml --out results/accounting/communication.csv``.
"""

from fedhisto.accounting import run_accounting
from fedhisto.entry import from_argv, from_snakemake

if "snakemake" in globals():
    smk = globals()["snakemake"]
    run_accounting(from_snakemake(smk), smk.output.csv)
elif __name__ == "__main__":
    config, args = from_argv(__doc__, out="output CSV")
    run_accounting(config, args.out)
