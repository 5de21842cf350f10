# Stage report: Table 2 as built beside the study's, tables mirroring the study's Tables 4-8 and figures; `snakemake --report
# report.html` bundles them, with the captions in workflow/report/.


rule make_report:
    input:
        metrics="results/metrics/metrics.json",
        bootstrap=lambda wildcards: [f"results/bootstrap/{n}.json" for n in reported_comparisons()],
        communication="results/accounting/communication.csv",
        external=lambda wildcards: [f"results/predictions/{m}/seed{s}/external.csv" for m, s in reported_runs()],
        composition="results/manifest/composition.csv",
        source_composition="results/manifest/source_composition.csv",
        manifest_summary="results/manifest/manifest.json",
        robustness="results/metrics/robustness.csv",
    output:
        t2=report("results/tables/table2_partitions.csv", caption="../report/table2.rst", category="Tables"),
        t2_sources="results/tables/table2_sources.csv",
        t4=report("results/tables/table4_internal.csv", caption="../report/table4.rst", category="Tables"),
        t5=report("results/tables/table5_external.csv", caption="../report/table5.rst", category="Tables"),
        t6=report("results/tables/table6_bootstrap.csv", caption="../report/table6.rst", category="Tables"),
        t7=report("results/tables/table7_ablation.csv", caption="../report/table7.rst", category="Tables"),
        t8=report("results/tables/table8_communication.csv", caption="../report/table8.rst", category="Tables"),
        ensemble=report("results/figures/ensemble_macro_f1.png", caption="../report/ensemble.rst", category="Figures"),
        recall=report("results/figures/class_recall.png", caption="../report/class_recall.rst", category="Figures"),
        confusion=report("results/figures/confusion_v2.png", caption="../report/confusion.rst", category="Figures"),
        forest=report("results/figures/ablation_forest.png", caption="../report/ablation.rst", category="Figures"),
        reliability=report("results/figures/reliability.png", caption="../report/reliability.rst", category="Figures"),
        robustness_table=report("results/tables/robustness.csv", caption="../report/robustness_table.rst",
                                category="Tables"),
        robustness_figure=report("results/figures/robustness.png", caption="../report/robustness.rst",
                                 category="Figures"),
    log:
        "logs/report/make_report.log",
    params:
        runs=lambda wildcards: [[m, s] for m, s in reported_runs()],
        # the figures' 95 % bootstrap CIs: a changed seed or resample count redraws them
        bootstrap={k: getattr(CFG.bootstrap, k) for k in ("seed", "resamples", "confidence")},
    threads: 1
    priority: AFTER_TRAINING_PRIORITY
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    script:
        "../../scripts/report.py"
