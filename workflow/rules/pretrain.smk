# Stage pretrain: features for the tiny encoder from a disjoint synthetic pool (only when
# model.pretrain.enabled; HIBOU-B arrives pretrained and is never retrained).


rule pretrain_encoder:
    output:
        encoder=directory("results/pretrain/encoder"),
    log:
        "logs/pretrain/pretrain_encoder.log",
    params:
        pretrain=CFG.model.pretrain.model_dump(mode="json"),
        encoder=CFG.model.encoder.name,
        views=CFG.views.model_dump(mode="json"),
        image_size=CFG.cohort.synthetic.image_size,
    threads: 2
    resources:
        mem_mb=3000,
        runtime=30,
        gpu=0,
    conda:
        ENV
    script:
        "../../scripts/pretrain.py"
