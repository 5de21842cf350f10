# Stage predict: each validation-selected checkpoint once on global test, client holdouts and
# the external cohort.


rule predict_cohorts:
    input:
        status="results/train/{method}/seed{seed}/status.json",
        manifest="results/manifest/manifest.csv",
        identity="results/manifest/manifest.json",
        descriptors="results/stain/descriptors.json",
        encoder=encoder_input,
    output:
        test="results/predictions/{method}/seed{seed}/test.csv",
        holdout="results/predictions/{method}/seed{seed}/holdout.csv",
        external="results/predictions/{method}/seed{seed}/external.csv",
    log:
        "logs/predict/{method}/seed{seed}.log",
    params:
        block=lambda wildcards: stage_block(CFG, "predict", method=wildcards.method, seed=wildcards.seed),
    threads: 1
    resources:
        mem_mb=predict_mem_mb,
        runtime=predict_runtime,
        gpu=train_gpu,
    conda:
        ENV
    script:
        "../../scripts/predict.py"
