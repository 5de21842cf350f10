# Stage metrics: per-run, client-level, cross-seed, ensemble and subgroup tables.


rule summarize_metrics:
    input:
        predictions=lambda wildcards: [f"results/predictions/{m}/seed{s}/{c}.csv"
                                       for m, s in reported_runs() for c in ("test", "holdout", "external")],
        status=lambda wildcards: [f"results/train/{m}/seed{s}/status.json" for m, s in reported_runs()],
    output:
        summary="results/metrics/summary.csv",
        per_run="results/metrics/per_run.csv",
        ensembles="results/metrics/ensembles.csv",
        metrics="results/metrics/metrics.json",
    log:
        "logs/metrics/summarize_metrics.log",
    params:
        runs=lambda wildcards: [[m, s, f"results/predictions/{m}/seed{s}", f"results/train/{m}/seed{s}"]
                                for m, s in reported_runs()],
        block=stage_block(CFG, "metrics"),
    threads: 1
    priority: AFTER_TRAINING_PRIORITY
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    script:
        "../../scripts/metrics.py"
