"""Stage accounting: write results/accounting/communication.csv (Table 8 from real tensor shapes).

Standalone: ``python scripts/accounting.py --config config/paper.yaml --out results/accounting/communication.csv``.
"""

from fedhisto.entry import from_argv, from_snakemake, log_of
from fedhisto.infra.warm_server import call

if "snakemake" in globals():
    smk = globals()["snakemake"]
    call("fedhisto.accounting.stage:run_accounting", from_snakemake(smk), smk.output.csv, log_path=log_of(smk))
elif __name__ == "__main__":
    config, args = from_argv(__doc__, out="output CSV")
    from fedhisto.accounting.stage import run_accounting

    run_accounting(config, args.out)
