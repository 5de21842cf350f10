# Stage stain: 14-d client stain descriptors for FiLM, and a grid of paired views to inspect.


rule compute_stain_descriptors:
    input:
        manifest="results/manifest/manifest.csv",
    output:
        descriptors="results/stain/descriptors.json",
        table="results/stain/descriptors.csv",
        grid="results/stain/view_pairs.png",
    log:
        "logs/stain/compute_stain_descriptors.log",
    params:
        block=stage_block(CFG, "stain"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=20,
        gpu=0,
    priority: CRITICAL_PATH_PRIORITY
    script:
        "../../scripts/stain.py"
