# Stage predict: each validation-selected checkpoint once on global test, client holdouts and
# the external cohort, and the global test images' embeddings (adapted and frozen encoder) for the
# metrics stage's site-robustness measures. One job per method predicts all of its seeds (the files are those of one
# job per seed, byte for byte): the encoder, the model and the evaluation images are loaded once
# instead of once per seed. Methods that train on other seeds than train.seeds (ablations,
# comparators under train.comparator_seeds) get a rule of their own, named by those seeds.
import re

COHORTS = ("test", "holdout", "external")


for group_seeds, group_methods in seed_groups():

    rule:
        name:
            predict_rule_name(group_seeds)
        input:
            status=lambda wildcards: [f"results/train/{wildcards.method}/seed{s}/status.json"
                                      for s in method_seeds(wildcards.method)],
            manifest="results/manifest/manifest.csv",
            identity="results/manifest/manifest.json",
            descriptors="results/stain/descriptors.json",
            encoder=encoder_input,
        output:
            expand("results/predictions/{{method}}/seed{seed}/{cohort}.csv", seed=group_seeds, cohort=COHORTS),
            expand("results/predictions/{{method}}/seed{seed}/embeddings.safetensors", seed=group_seeds),
        wildcard_constraints:
            method="|".join(re.escape(m) for m in group_methods),
        log:
            "logs/predict/{method}.log",
        params:
            seeds=lambda wildcards: method_seeds(wildcards.method),
            block=lambda wildcards: [stage_block(CFG, "predict", method=wildcards.method, seed=s)
                                     for s in method_seeds(wildcards.method)],
        threads: 1
        priority: AFTER_TRAINING_PRIORITY
        resources:
            mem_mb=predict_mem_mb,
            runtime=predict_method_runtime,
            gpu=train_gpu,
        script:
            "../../scripts/predict.py"

    # a grouped rule wins wherever it can make the file (the same as `ruleorder: <that rule> > predict_cohorts_one_seed`)
    workflow.ruleorder(predict_rule_name(group_seeds), "predict_cohorts_one_seed")


# A run outside the configured ones (method, seed), e.g. a main-pipeline run that an experiment reuses
# on experiments.seeds while train.comparator_seeds gives that method other seeds: one job per seed.
rule predict_cohorts_one_seed:
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
        embeddings="results/predictions/{method}/seed{seed}/embeddings.safetensors",
    log:
        "logs/predict/{method}/seed{seed}.log",
    params:
        block=lambda wildcards: stage_block(CFG, "predict", method=wildcards.method, seed=wildcards.seed),
    threads: 1
    resources:
        mem_mb=predict_mem_mb,
        runtime=predict_runtime,
        gpu=train_gpu,
    script:
        "../../scripts/predict.py"
