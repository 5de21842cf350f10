"""Stage experiments: results/experiments/<name>/ (designs in docs/experiments.md).

One entry script for every experiment's rules (generated from the experiment registry); the step is
looked up by the rule's name (``fedhisto.experiments.stage``). Standalone:
``snakemake results/experiments/<name>/<name>.json`` (the experiments need the main pipeline's artifacts).
"""

from fedhisto.experiments.stage import run

if "snakemake" in globals():
    run(globals()["snakemake"])
