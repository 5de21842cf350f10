"""Stage pretrain: results/pretrain/encoder (save_pretrained folder + pretrain_report.json).

Standalone: ``python scripts/pretrain.py --config config/config.yaml --out results/pretrain/encoder``
(``objective: self_supervised`` reads results/manifest/manifest.csv).
"""

from fedhisto.entry import from_argv, from_snakemake, log_of
from fedhisto.infra.warm_server import call

if "snakemake" in globals():
    smk = globals()["snakemake"]
    call("fedhisto.pretrain.stage:run_pretrain", from_snakemake(smk), smk.output.encoder, threads=smk.threads,
         manifest_csv=smk.input.get("manifest"), log_path=log_of(smk))
elif __name__ == "__main__":
    config, args = from_argv(__doc__, out="output folder")
    from fedhisto.pretrain.stage import run_pretrain

    ssl = config.model.pretrain.objective == "self_supervised"  # its images: the manifest's optimisation split
    run_pretrain(config, args.out, threads=args.threads, manifest_csv="results/manifest/manifest.csv" if ssl else None)
