"""Stage classify under Snakemake (rule classify_folder).

Standalone, use the command line instead: ``fedhisto classify --model PKG --images DIR --out FILE.csv``.
"""

from fedhisto.entry import from_snakemake
from fedhisto.infra.warm_server import call

if "snakemake" in globals():
    smk = globals()["snakemake"]
    config = from_snakemake(smk)
    c = config.classify
    call("fedhisto.classify.stage:run_classify", smk.input.package, smk.params.images, smk.output.predictions,
         descriptor=c.descriptor, calibrate=c.calibrate, uncertain_below=c.uncertain_below,
         contact_sheet=smk.output.sheet, threads=smk.threads, device=config.train.device, log_path=smk.log[0])
