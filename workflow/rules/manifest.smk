# Stage manifest: canonical manifest, client pools and holdouts, fixed validation and test.


rule build_manifest:
    input:
        sources="results/cohort/sources.csv",
        families="results/clearance/families.csv",
        edges="results/clearance/edges.csv",
    output:
        manifest="results/manifest/manifest.csv",
        composition="results/manifest/composition.csv",
        summary="results/manifest/manifest.json",
    log:
        "logs/manifest/build_manifest.log",
    params:
        manifest=CFG.manifest.model_dump(mode="json"),
        targets=CFG.partition_targets().model_dump(mode="json"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        ENV
    script:
        "../../scripts/manifest.py"
