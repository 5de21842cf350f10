"""Stages export and classify under Snakemake (rules export_model, classify_folder).

Standalone, use the command line instead: ``fedhisto export --method past_v2 --out PKG`` and
``fedhisto classify --model PKG --images DIR --out FILE.csv``.
"""

from pathlib import Path

from fedhisto.entry import from_snakemake
from fedhisto.warm import call

if "snakemake" in globals():
    smk = globals()["snakemake"]
    cfg = from_snakemake(smk)
    if smk.rule == "export_model":
        train_dir = Path(smk.input.status[0]).parents[2]
        call("fedhisto.export.stage:run_export", smk.wildcards.method, cfg, smk.output.package,
             train_root=train_dir, predictions_root=Path(smk.input.predictions[0]).parents[2],
             descriptors_json=smk.input.descriptors, manifest_json=smk.input.identity,
             encoder_dir=smk.input.encoder[0] if smk.input.encoder else None, log_path=smk.log[0])
    else:
        c = cfg.classify
        call("fedhisto.classify.stage:run_classify", smk.input.package, smk.params.images, smk.output.predictions,
             descriptor=c.descriptor, calibrate=c.calibrate, uncertain_below=c.uncertain_below,
             contact_sheet=smk.output.sheet, threads=smk.threads, log_path=smk.log[0])
