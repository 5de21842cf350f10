"""Stage stain: write results/stain (descriptors.json, descriptors.csv, view_pairs.png).

Standalone: ``python scripts/stain.py --config config/config.yaml --manifest results/manifest/manifest.csv
--out results/stain``.
"""

from pathlib import Path

from fedhisto.entry import from_argv, from_snakemake, log_of
from fedhisto.infra.warm_server import call

if "snakemake" in globals():
    smk = globals()["snakemake"]
    call("fedhisto.stain.stage:run_stain", smk.input.manifest, from_snakemake(smk), Path(smk.output.descriptors).parent,
         log_path=log_of(smk))
elif __name__ == "__main__":
    config, args = from_argv(__doc__, manifest="results/manifest/manifest.csv", out="output folder")
    from fedhisto.stain.stage import run_stain

    run_stain(args.manifest, config, args.out)
