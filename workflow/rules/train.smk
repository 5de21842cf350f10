# Stage train: one federated run per method and seed, resumable from its per-round checkpoint.
# The checkpoint is deliberately not a declared output, so a killed job keeps it and the next
# invocation resumes it; status.json is written last.


rule train_federated:
    input:
        manifest="results/manifest/manifest.csv",
        identity="results/manifest/manifest.json",
        descriptors="results/stain/descriptors.json",
        encoder=encoder_input,
    output:
        status="results/train/{method}/seed{seed}/status.json",
        history="results/train/{method}/seed{seed}/history.csv",
    log:
        "logs/train/{method}/seed{seed}.log",
    params:
        block=lambda wildcards: stage_block(CFG, "train", method=wildcards.method, seed=wildcards.seed),
    threads: 1
    priority: TRAIN_PRIORITY
    resources:
        mem_mb=train_mem_mb,
        runtime=train_runtime,
        gpu=train_gpu,
    script:
        "../../scripts/train.py"
