"""Site-local preparation: write results/site/<site>/ and its upload.json (``fedhisto.federation.prepare``).

Snakemake: ``snakemake -s workflow/site/Snakefile --cores 2 --config site=C3 images=/data/site3``.
Standalone: ``fedhisto site-prepare --images DIR --site-id C3`` (the same function).
"""

from pathlib import Path

from fedhisto.entry import study_config
from fedhisto.federation.prepare import SITE_KEYS, prepare_site
from fedhisto.infra.job_logging import setup_logging

if "snakemake" in globals():
    smk = globals()["snakemake"]
    setup_logging(smk.log[0] if len(smk.log) else None)
    cfg = study_config({k: v for k, v in dict(smk.config).items() if k not in SITE_KEYS}, source="snakemake config")
    prepare_site(smk.input.images, smk.params.site, Path(smk.output.upload).parent, cfg, role=smk.params.role,
                 source_site=smk.params.source_site, layout=smk.params.layout,
                 exclude=smk.input.exclude[0] if smk.input.exclude else None, threads=smk.threads)
