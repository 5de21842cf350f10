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


# Site robustness of every run's representation (and the frozen encoder's) with croma: RI and APD across the
# internal sites of the global test images, from the predict stage's embeddings (fedhisto.metrics.robustness).
# The runs are those the tables show (reported_runs): the study's, and each comparator once asked for or trained.
rule summarize_robustness:
    input:
        embeddings=lambda wildcards: [f"results/predictions/{m}/seed{s}/embeddings.safetensors"
                                      for m, s in reported_runs()],
        tests=lambda wildcards: [f"results/predictions/{m}/seed{s}/test.csv" for m, s in reported_runs()],
        manifest="results/manifest/manifest.csv",
    output:
        robustness="results/metrics/robustness.csv",
        summary="results/metrics/robustness.json",
    log:
        "logs/metrics/summarize_robustness.log",
    params:
        runs=lambda wildcards: [[m, s, f"results/predictions/{m}/seed{s}"] for m, s in reported_runs()],
        block=stage_block(CFG, "metrics"),
        bootstrap={k: getattr(CFG.bootstrap, k) for k in ("seed", "confidence")},
    threads: 2  # the representations are measured in parallel (one probe sweep each)
    priority: AFTER_TRAINING_PRIORITY
    resources:
        mem_mb=2000,
        runtime=20,
        gpu=0,
    script:
        "../../scripts/metrics.py"
