# Stage manifest: canonical manifest, client pools and holdouts, fixed validation and test.


rule build_manifest:
    input:
        sources="results/cohort/sources.csv",
        families="results/clearance/families.csv",
        edges="results/clearance/edges.csv",
    output:
        manifest="results/manifest/manifest.csv",
        composition="results/manifest/composition.csv",
        source_composition="results/manifest/source_composition.csv",
        summary="results/manifest/manifest.json",
        metadata_edges="results/manifest/metadata_edges.csv",
    log:
        "logs/manifest/build_manifest.log",
    params:
        block=stage_block(CFG, "manifest"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    priority: CRITICAL_PATH_PRIORITY
    script:
        "../../scripts/manifest.py"
