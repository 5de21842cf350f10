"""Stage stain: write results/stain (descriptors.json, descriptors.csv, view_pairs.png).

Standalone: ``python scripts/stain.py --config config/config.yaml --manifest results/manifest/manifest.csv
--out results/stain``.
"""

from pathlib import Path

from fedhisto.entry import from_argv, from_snakemake
from fedhisto.stain import run_stain

if "snakemake" in globals():
    smk = globals()["snakemake"]
    run_stain(smk.input.manifest, from_snakemake(smk), Path(smk.output.descriptors).parent)
elif __name__ == "__main__":
    config, args = from_argv(__doc__, manifest="results/manifest/manifest.csv", out="output folder")
    run_stain(args.manifest, config, args.out)
