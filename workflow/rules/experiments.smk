# Stage experiments: controlled experiments the study could not run (designs: docs/experiments.md).
# `snakemake --cores 2 experiments` after `all` reuses the main runs wherever a condition is the main
# pipeline; one experiment alone: `snakemake results/experiments/<name>/<name>.json`. Each experiment is
# one module under src/fedhisto/experiments/ registered in fedhisto/registries/experiment_registry.py; its rules are
# generated below from its steps. Retrained conditions live in results/experiments/<experiment>/<condition>/
# and run the main stages' scripts through the shared condition rules.
from fedhisto.experiments import layout as X


wildcard_constraints:
    condition=X.condition_pattern(CFG),


rule build_condition_manifest:
    input:
        unpack(lambda wildcards: X.condition_manifest_inputs(CFG, wildcards.condition)),
    output:
        manifest=f"{X.ROOT}/{{condition}}/manifest/manifest.csv",
        identity=f"{X.ROOT}/{{condition}}/manifest/manifest.json",
    log:
        f"logs/experiments/{{condition}}/build_condition_manifest.log",
    params:
        block=lambda wildcards: {"condition": wildcards.condition, "manifest": stage_block(CFG, "manifest")},
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    script:
        "../../scripts/experiments.py"


rule compute_condition_descriptors:
    input:
        manifest=f"{X.ROOT}/{{condition}}/manifest/manifest.csv",
    output:
        descriptors=f"{X.ROOT}/{{condition}}/stain/descriptors.json",
        table=f"{X.ROOT}/{{condition}}/stain/descriptors.csv",
        grid=f"{X.ROOT}/{{condition}}/stain/view_pairs.png",
    log:
        f"logs/experiments/{{condition}}/compute_condition_descriptors.log",
    params:
        block=stage_block(CFG, "stain"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=20,
        gpu=0,
    script:
        "../../scripts/stain.py"


rule train_condition:
    input:
        unpack(lambda wildcards: X.condition_inputs(CFG, wildcards.condition)),
    output:
        status=f"{X.ROOT}/{{condition}}/train/{{method}}/seed{{seed}}/status.json",
        history=f"{X.ROOT}/{{condition}}/train/{{method}}/seed{{seed}}/history.csv",
    log:
        f"logs/experiments/{{condition}}/train/{{method}}/seed{{seed}}.log",
    params:
        block=lambda wildcards: stage_block(CFG, "train", method=wildcards.method, seed=wildcards.seed),
    threads: 1
    resources:
        mem_mb=train_mem_mb,
        runtime=train_runtime,
        gpu=train_gpu,
    script:
        "../../scripts/train.py"


rule predict_condition:
    input:
        unpack(lambda wildcards: X.condition_inputs(CFG, wildcards.condition)),
        status=f"{X.ROOT}/{{condition}}/train/{{method}}/seed{{seed}}/status.json",
    output:
        test=f"{X.ROOT}/{{condition}}/predictions/{{method}}/seed{{seed}}/test.csv",
        holdout=f"{X.ROOT}/{{condition}}/predictions/{{method}}/seed{{seed}}/holdout.csv",
        external=f"{X.ROOT}/{{condition}}/predictions/{{method}}/seed{{seed}}/external.csv",
    log:
        f"logs/experiments/{{condition}}/predict/{{method}}/seed{{seed}}.log",
    params:
        block=lambda wildcards: stage_block(CFG, "predict", method=wildcards.method, seed=wildcards.seed),
    threads: 1
    resources:
        mem_mb=predict_mem_mb,
        runtime=predict_runtime,
        gpu=train_gpu,
    script:
        "../../scripts/predict.py"


# An experiment's steps (fedhisto.experiments.framework.Step), one rule each; scripts/experiments.py runs the
# step its rule names.
for experiment_step in X.steps(CFG):

    rule:
        name:
            experiment_step.rule
        input:
            unpack(step_inputs(experiment_step)),
        output:
            **step_outputs(experiment_step),
        log:
            experiment_step.log_path(),
        params:
            **experiment_step.params,
        threads: experiment_step.threads
        resources:
            mem_mb=step_resource(experiment_step, "mem_mb"),
            runtime=step_resource(experiment_step, "runtime"),
            gpu=step_resource(experiment_step, "gpu"),
        wildcard_constraints:
            **experiment_step.wildcard_constraints,
        script:
            "../../scripts/experiments.py"
