"""Stage manifest: write results/manifest (manifest.csv, composition.csv, source_composition.csv,
manifest.json).

Standalone: ``python scripts/manifest.py --config config/config.yaml --sources results/cohort/sources.csv
--families results/clearance/families.csv --edges results/clearance/edges.csv --out results/manifest``.
"""

import argparse
from pathlib import Path

from fedhisto.entry import from_snakemake, study_config_file
from fedhisto.infra.job_logging import setup_logging
from fedhisto.manifest.stage import run_manifest

if "snakemake" in globals():
    smk = globals()["snakemake"]
    config = from_snakemake(smk)
    run_manifest(smk.input.sources, smk.input.families, smk.input.edges, config, Path(smk.output.manifest).parent)
elif __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="config/config.yaml")
    for name in ("sources", "families", "edges", "out"):
        parser.add_argument(f"--{name}", required=True)
    args = parser.parse_args()
    setup_logging()
    run_manifest(args.sources, args.families, args.edges, study_config_file(args.config), args.out)
