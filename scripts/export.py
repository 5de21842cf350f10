"""Stage export under Snakemake (rule export_model).

Standalone, use the command line instead: ``fedhisto export --method past_v2 --out PKG``.
"""

from pathlib import Path

from fedhisto.entry import from_snakemake
from fedhisto.infra.warm_server import call

if "snakemake" in globals():
    smk = globals()["snakemake"]
    cfg = from_snakemake(smk)
    train_dir = Path(smk.input.status[0]).parents[2]
    call("fedhisto.export.stage:run_export", smk.wildcards.method, cfg, smk.output.package,
         train_root=train_dir, predictions_root=Path(smk.input.predictions[0]).parents[2],
         descriptors_json=smk.input.descriptors, manifest_json=smk.input.identity, manifest_csv=smk.input.manifest,
         encoder_dir=smk.input.encoder[0] if smk.input.encoder else None, log_path=smk.log[0])
