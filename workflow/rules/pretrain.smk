# Stage pretrain: features for the tiny encoder from a disjoint synthetic pool (only when
# model.pretrain.enabled; HIBOU-B arrives pretrained and is never retrained), or self-supervised on the
# clients' optimisation images (model.pretrain.objective: self_supervised; then it reads the manifest).


rule pretrain_encoder:
    input:
        unpack(pretrain_inputs),
    output:
        encoder=directory("results/pretrain/encoder"),
    log:
        "logs/pretrain/pretrain_encoder.log",
    params:
        block=stage_block(CFG, "pretrain"),
    threads: 1  # beside the cohort -> clearance -> manifest -> stain chain, which does not wait for it
    priority: PRETRAIN_PRIORITY  # beside clearance, once the cohort is done with both cores
    resources:
        mem_mb=3000,
        runtime=30,
        gpu=0,
    script:
        "../../scripts/pretrain.py"
