# Stage experiments: controlled experiments the study could not run (designs: docs/experiments.md).
# `snakemake --cores 2 experiments` after `all` reuses the main runs wherever a condition is the main
# pipeline; one experiment alone: `snakemake results/experiments/<name>/<name>.json`. Retrained
# conditions live in results/experiments/<experiment>/<condition>/ and run the main stages' scripts.
from fedhisto.experiments import layout as X
from fedhisto.experiments import sensitivity_layout as SX


wildcard_constraints:
    condition=X.condition_pattern(),
    encoder=X.encoder_pattern(CFG),
    label=X.entry_pattern(CFG),
    reading=SX.reading_pattern(CFG),
    audit=X.privacy_audit_pattern(CFG),


rule render_shifted_cohort:
    output:
        cohort=f"{X.ROOT}/dose_response/cohort/cohort.csv",
        sheet=f"{X.ROOT}/dose_response/cohort/contact_sheet.png",
    log:
        "logs/experiments/render_shifted_cohort.log",
    params:
        block=stage_block(CFG, "shift_cohort"),
    threads: 2
    resources:
        mem_mb=2000,
        runtime=20,
        gpu=0,
    conda:
        ENV
    script:
        "../../scripts/experiments.py"


rule pretrain_plain_encoder:
    input:
        unpack(pretrain_inputs),
    output:
        encoder=directory(X.PLAIN_ENCODER),
    log:
        "logs/experiments/pretrain_plain_encoder.log",
    params:
        block=stage_block(X.plain_encoder_config(CFG), "pretrain"),
    threads: 2
    resources:
        mem_mb=3000,
        runtime=30,
        gpu=0,
    conda:
        ENV
    script:
        "../../scripts/experiments.py"


rule build_condition_manifest:
    input:
        unpack(lambda wildcards: X.condition_manifest_inputs(wildcards.condition)),
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
    conda:
        ENV
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
    conda:
        ENV
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
    conda:
        ENV
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
    conda:
        ENV
    script:
        "../../scripts/predict.py"


rule train_encoder_condition:
    # a dose-response encoder entry ({label, name, local_dir}): the main manifest, retrained on that encoder
    input:
        unpack(lambda wildcards: X.condition_inputs(CFG, f"dose_response/{wildcards.label}")),
    output:
        status=f"{X.ROOT}/dose_response/{{label}}/train/{{method}}/seed{{seed}}/status.json",
        history=f"{X.ROOT}/dose_response/{{label}}/train/{{method}}/seed{{seed}}/history.csv",
    log:
        "logs/experiments/dose_response/{label}/train/{method}/seed{seed}.log",
    params:
        block=lambda wildcards: stage_block(X.condition_config(CFG, f"dose_response/{wildcards.label}"), "train",
                                            method=wildcards.method, seed=wildcards.seed),
    threads: 1
    resources:
        mem_mb=lambda wildcards: X.entry_resources(CFG, wildcards.label)["mem_mb"],
        runtime=lambda wildcards: X.entry_resources(CFG, wildcards.label)["runtime"],
        gpu=lambda wildcards: X.entry_resources(CFG, wildcards.label)["gpu"],
    conda:
        ENV
    script:
        "../../scripts/experiments.py"


rule predict_shifted_cohort:
    input:
        unpack(lambda wildcards: X.shifted_inputs(CFG, wildcards.encoder, wildcards.method, wildcards.seed)),
    output:
        predictions=f"{X.ROOT}/dose_response/{{encoder}}/predictions/{{method}}/seed{{seed}}.csv",
    log:
        "logs/experiments/dose_response/{encoder}/predict/{method}/seed{seed}.log",
    params:
        block=lambda wildcards: X.shifted_block(CFG, wildcards.method, wildcards.seed, wildcards.encoder),
    threads: 1
    resources:
        mem_mb=predict_mem_mb,
        runtime=predict_runtime,
        gpu=lambda wildcards: encoder_gpu(wildcards.encoder, wildcards),
    conda:
        ENV
    script:
        "../../scripts/experiments.py"


rule summarize_dose_response:
    input:
        cohort=f"{X.ROOT}/dose_response/cohort/cohort.csv",
        predictions=[r[3] for r in X.shifted_predictions(CFG)],
    output:
        **X.summary_files("dose_response"),
    log:
        "logs/experiments/summarize_dose_response.log",
    params:
        runs=[list(r) for r in X.shifted_predictions(CFG)],
        block=X.experiment_block(CFG, "dose_response"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        ENV
    script:
        "../../scripts/experiments.py"


rule summarize_leakage:
    input:
        manifests=[X.leakage_manifest(CFG, p) for p in CFG.experiments.leakage.policies],
        predictions=[r[3] for r in X.leakage_predictions(CFG)],
    output:
        **X.summary_files("leakage"),
    log:
        "logs/experiments/summarize_leakage.log",
    params:
        runs=[list(r) for r in X.leakage_predictions(CFG)],
        manifests={p: X.leakage_manifest(CFG, p) for p in CFG.experiments.leakage.policies},
        block=X.experiment_block(CFG, "leakage"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        ENV
    script:
        "../../scripts/experiments.py"


rule summarize_leave_one_site_out:
    input:
        predictions=[r[3] for r in X.leave_one_site_out_predictions(CFG)],
    output:
        **X.summary_files("leave_one_site_out"),
    log:
        "logs/experiments/summarize_leave_one_site_out.log",
    params:
        runs=[list(r) for r in X.leave_one_site_out_predictions(CFG)],
        block=X.experiment_block(CFG, "leave_one_site_out"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        ENV
    script:
        "../../scripts/experiments.py"


rule calibrate_checkpoints:
    input:
        runs=X.calibration_files(CFG),
    output:
        **X.summary_files("calibration"),
    log:
        "logs/experiments/calibrate_checkpoints.log",
    params:
        runs=[list(r) for r in X.calibration_inputs(CFG)],
        block=X.experiment_block(CFG, "calibration"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        ENV
    script:
        "../../scripts/experiments.py"



rule probe_encoder:
    input:
        unpack(lambda wildcards: X.probe_encoder_inputs(CFG, wildcards.encoder)),
    output:
        json=f"{X.ROOT}/probe/{{encoder}}/probe.json",
        per_image=f"{X.ROOT}/probe/{{encoder}}/per_image.csv",
    log:
        "logs/experiments/probe/{encoder}.log",
    params:
        block=lambda wildcards: X.probe_block(CFG, wildcards.encoder),
    threads: 1
    resources:
        mem_mb=predict_mem_mb,
        runtime=predict_runtime,
        gpu=lambda wildcards: encoder_gpu(wildcards.encoder, wildcards),
    conda:
        ENV
    script:
        "../../scripts/experiments.py"


rule summarize_probe:
    input:
        probes=list(X.probe_files(CFG).values()),
        dose_response=f"{X.ROOT}/dose_response/dose_response.json",
    output:
        **X.summary_files("probe"),
    log:
        "logs/experiments/summarize_probe.log",
    params:
        probes=X.probe_files(CFG),
        block=X.experiment_block(CFG, "probe"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        ENV
    script:
        "../../scripts/experiments.py"


rule audit_privacy_condition:
    # one condition of the membership audit: the audited federations with canaries, their attack scores
    input:
        unpack(lambda wildcards: X.privacy_audit_inputs(CFG)),
    output:
        json=f"{X.ROOT}/privacy_audit/{{audit}}/audit.json",
    log:
        "logs/experiments/privacy_audit/{audit}.log",
    params:
        block=lambda wildcards: X.privacy_audit_block(CFG, wildcards.audit),
    threads: 1
    resources:
        mem_mb=train_mem_mb,
        runtime=train_runtime,
        gpu=train_gpu,
    conda:
        ENV
    script:
        "../../scripts/experiments.py"


rule summarize_privacy_audit:
    input:
        audits=X.privacy_audit_files(CFG),
    output:
        **X.summary_files("privacy_audit"),
    log:
        "logs/experiments/summarize_privacy_audit.log",
    params:
        block=lambda wildcards: X.privacy_audit_block(CFG),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        ENV
    script:
        "../../scripts/experiments.py"


# Sensitivity ("multiverse"): each reading of an unstated choice retrained one at a time against the
# shared baseline (main / dose-response plain runs), for the two tiny encoder conditions.
rule train_sensitivity:
    input:
        unpack(lambda wildcards: SX.train_inputs(CFG, wildcards.sencoder)),
    output:
        status=f"{SX.HERE}/{{sencoder}}/{{reading}}/train/{{method}}/seed{{seed}}/status.json",
        history=f"{SX.HERE}/{{sencoder}}/{{reading}}/train/{{method}}/seed{{seed}}/history.csv",
    wildcard_constraints:
        sencoder="stain_invariant|plain",
    log:
        "logs/experiments/sensitivity/{sencoder}/{reading}/train/{method}/seed{seed}.log",
    params:
        block=lambda wildcards: stage_block(SX.reading_config(CFG, wildcards.reading), "train",
                                            method=wildcards.method, seed=wildcards.seed),
    threads: 1
    resources:
        mem_mb=train_mem_mb,
        runtime=train_runtime,
        gpu=train_gpu,
    conda:
        ENV
    script:
        "../../scripts/experiments.py"


rule predict_sensitivity:
    input:
        unpack(lambda wildcards: SX.train_inputs(CFG, "stain_invariant")),
        status=f"{SX.HERE}/stain_invariant/{{reading}}/train/{{method}}/seed{{seed}}/status.json",
    output:
        test=f"{SX.HERE}/stain_invariant/{{reading}}/predictions/{{method}}/seed{{seed}}/test.csv",
        holdout=f"{SX.HERE}/stain_invariant/{{reading}}/predictions/{{method}}/seed{{seed}}/holdout.csv",
        external=f"{SX.HERE}/stain_invariant/{{reading}}/predictions/{{method}}/seed{{seed}}/external.csv",
    log:
        "logs/experiments/sensitivity/stain_invariant/{reading}/predict/{method}/seed{seed}.log",
    params:
        block=lambda wildcards: stage_block(SX.reading_config(CFG, wildcards.reading), "predict",
                                            method=wildcards.method, seed=wildcards.seed),
    threads: 1
    resources:
        mem_mb=predict_mem_mb,
        runtime=predict_runtime,
        gpu=train_gpu,
    conda:
        ENV
    script:
        "../../scripts/experiments.py"


rule predict_sensitivity_shifted:
    input:
        unpack(lambda wildcards: SX.train_inputs(CFG, "plain")),
        status=f"{SX.HERE}/plain/{{reading}}/train/{{method}}/seed{{seed}}/status.json",
        cohort=SX.SHIFTED_COHORT,
    output:
        predictions=f"{SX.HERE}/plain/{{reading}}/predictions/{{method}}/seed{{seed}}/shifted.csv",
    log:
        "logs/experiments/sensitivity/plain/{reading}/predict/{method}/seed{seed}.log",
    params:
        block=lambda wildcards: SX.shifted_block(CFG, wildcards.reading, wildcards.method, wildcards.seed),
    threads: 1
    resources:
        mem_mb=predict_mem_mb,
        runtime=predict_runtime,
        gpu=train_gpu,
    conda:
        ENV
    script:
        "../../scripts/experiments.py"


rule summarize_sensitivity:
    input:
        **SX.summary_inputs(CFG),
    output:
        **X.summary_files("sensitivity"),
    log:
        "logs/experiments/summarize_sensitivity.log",
    params:
        runs=[list(r) for r in SX.sensitivity_runs(CFG)],
        block=X.experiment_block(CFG, "sensitivity"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        ENV
    script:
        "../../scripts/experiments.py"
