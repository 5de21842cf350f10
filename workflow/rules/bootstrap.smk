# Stage bootstrap: paired image-level (and, where patients are known, patient-level) bootstrap of one named comparison on the external cohort.
# Only the two methods' runs are needed: `snakemake results/bootstrap/v2_vs_fedavg.json` builds
# exactly those. Both ensembles use the same seeds: an ablation comparison train.ablation_seeds (Table 7),
# any other the seeds both methods train on.


rule bootstrap_comparison:
    input:
        method=lambda wildcards: comparison_inputs(wildcards.comparison, "method"),
        reference=lambda wildcards: comparison_inputs(wildcards.comparison, "reference"),
        # patients of the compared images, for the patient-level (cluster) bootstrap beside the image-level one
        manifest="results/manifest/manifest.csv",
    output:
        json="results/bootstrap/{comparison}.json",
    log:
        "logs/bootstrap/{comparison}.log",
    params:
        block=lambda wildcards: stage_block(CFG, "bootstrap", comparison=wildcards.comparison),
        # method's and reference's ensemble seeds: one matched list for both
        seeds=lambda wildcards: CFG.comparison_seeds(wildcards.comparison),
    threads: 1
    priority: AFTER_TRAINING_PRIORITY
    resources:
        mem_mb=4000,
        runtime=20,
        gpu=0,
    script:
        "../../scripts/bootstrap.py"
