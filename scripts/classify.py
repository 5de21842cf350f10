"""Stage classify under Snakemake (rule classify_folder).

Standalone, use the command line instead: ``fedhisto classify --model PKG --images DIR --out FILE.csv``.
"""

from fedhisto.entry import from_snakemake
from fedhisto.infra.warm_server import call
from fedhisto.registries.encoder_registry import encoder_entry

if "snakemake" in globals():
    smk = globals()["snakemake"]
    config = from_snakemake(smk)
    c = config.classify
    # a hub encoder the runs read from a local snapshot (model.encoder.local_dir): the package records its digest
    # and classify reads the same folder (jobs never download); an encoder the package carries is its own
    enc = config.model.encoder
    encoder_dir = enc.local_dir if encoder_entry(enc.name).hub_id else None
    call("fedhisto.classify.stage:run_classify", smk.input.package, smk.params.images, smk.output.predictions,
         descriptor=c.descriptor, calibrate=c.calibrate, uncertain_below=c.uncertain_below,
         false_flag_rate=c.false_flag_rate, contact_sheet=smk.output.sheet, threads=smk.threads,
         device=config.train.device, encoder_dir=encoder_dir, log_path=smk.log[0])
