# Stage clearance: exact, perceptual and local-feature duplicate families before partitioning.


rule audit_duplicates:
    input:
        sources="results/cohort/sources.csv",
        planted=planted_input,
    output:
        edges="results/clearance/edges.csv",
        families="results/clearance/families.csv",
        audit="results/clearance/audit.json",
        report="results/clearance/report.md",
    log:
        "logs/clearance/audit_duplicates.log",
    params:
        block=stage_block(CFG, "clearance"),
    threads: CLEARANCE_THREADS
    resources:
        mem_mb=8000,
        runtime=120,
        gpu=0,
    priority: CRITICAL_PATH_PRIORITY
    script:
        "../../scripts/clearance.py"
