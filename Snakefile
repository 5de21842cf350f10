# fedhisto: stain-aware parameter-efficient federated learning for lung histopathology.
# Stages are included in pipeline order; each lives in three places of one name: its rules in
# workflow/rules/<stage>.smk, its library in the package src/fedhisto/<stage>/ (entry: <stage>/stage.py)
# and its thin Snakemake adapter scripts/<stage>.py (tests/test_layout.py walks the rules and checks all
# three). A stage writes results/<stage>/, except predict (results/predictions/) and report
# (results/tables/, results/figures/). workflow/rules/common.smk holds what the stages share.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/cohort.smk"
include: "workflow/rules/clearance.smk"
include: "workflow/rules/manifest.smk"
include: "workflow/rules/stain.smk"
include: "workflow/rules/pretrain.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/predict.smk"
include: "workflow/rules/metrics.smk"
include: "workflow/rules/bootstrap.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/accounting.smk"
include: "workflow/rules/experiments.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/classify.smk"


# One warm process per local run imports torch, transformers and peft once for all jobs (fedhisto.infra.warm_server).
onstart:
    start_warm_server(workflow)


onsuccess:
    stop_warm_server()


onerror:
    stop_warm_server()


rule all:
    input:
        all_targets(),
    default_target: True


# The extra comparators (every train.methods entry beyond the study's five; docs/methods.md) and their
# comparisons with v2, after `all` or with it (`snakemake --cores 2 all comparators`); metrics, tables and
# figures then show their rows.
rule comparators:
    input:
        comparator_targets(),


# Controlled experiments after `all` (docs/experiments.md); targets only, outputs in results/experiments/.
rule experiments:
    input:
        experiment_outputs(),


# On SLURM, every job that declares a GPU goes to the GPU partition (fedhisto.infra.gpu_jobs, docs/cluster.md);
# after every rule is defined, whatever its name.
from fedhisto.infra.gpu_jobs import route_gpu_jobs

route_gpu_jobs(workflow)
