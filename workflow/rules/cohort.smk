# Stage cohort: the image inventory every later stage reads (results/cohort/sources.csv).
# Embedded default: a synthetic H&E cohort rendered from a seed. Real data: dataset adapters.

if CFG.cohort.mode == "synthetic":

    rule synthesize_cohort:
        output:
            sources="results/cohort/sources.csv",
            sheet="results/cohort/contact_sheet.png",
            summary="results/cohort/summary.json",
            planted="results/cohort/planted_families.csv",
            images=directory("results/cohort/images"),
        log:
            "logs/cohort/synthesize_cohort.log",
        params:
            block=stage_block(CFG, "cohort"),
        threads: 2  # alone, then clearance beside pretraining (workflow/rules/common.smk, CRITICAL_PATH_PRIORITY)
        resources:
            mem_mb=4000,
            runtime=60,
            gpu=0,
        priority: CRITICAL_PATH_PRIORITY
        script:
            "../../scripts/cohort.py"

else:

    rule collect_sources:
        output:
            sources="results/cohort/sources.csv",
            sheet="results/cohort/contact_sheet.png",
            summary="results/cohort/summary.json",
            excluded="results/cohort/excluded.csv",
        log:
            "logs/cohort/collect_sources.log",
        params:
            block=stage_block(CFG, "cohort"),
            # path, size and mtime of every file below the sources: adding, removing or editing an image
            # reruns this stage and, through its outputs, everything after it; nothing else reruns
            inventory=sources_inventory(CFG.cohort.real.sources),
        threads: 1
        resources:
            mem_mb=2000,
            runtime=60,
            gpu=0,
        priority: CRITICAL_PATH_PRIORITY
        script:
            "../../scripts/cohort.py"
