# Stage pretrain: features for the tiny encoder from a disjoint synthetic pool (only when
# model.pretrain.enabled; HIBOU-B arrives pretrained and is never retrained).


rule pretrain_encoder:
    output:
        encoder=directory("results/pretrain/encoder"),
    log:
        "logs/pretrain/pretrain_encoder.log",
    params:
        block=stage_block(CFG, "pretrain"),
    threads: 2
    resources:
        mem_mb=3000,
        runtime=30,
        gpu=0,
    conda:
        ENV
    script:
        "../../scripts/pretrain.py"
