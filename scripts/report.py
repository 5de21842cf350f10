"""Stage report: results/tables (Table 2 as built, Tables 4-8, site robustness; CSV and Markdown) and results/figures.

Standalone: ``python scripts/report.py --config config/config.yaml`` after the metrics and bootstrap stages.
"""

from pathlib import Path

from fedhisto.entry import from_argv, from_snakemake, log_of
from fedhisto.infra.warm_server import call

if "snakemake" in globals():
    smk = globals()["snakemake"]
    cfg = from_snakemake(smk)
    external: dict[str, list[str]] = {}
    for (method, _seed), path in zip(smk.params.runs, smk.input.external, strict=True):
        external.setdefault(method, []).append(path)
    # the caveats are read off the config in the warm child: method_caveats builds every method (torch), which
    # cost the job process 4 s of CPU on the pipeline's last step
    call("fedhisto.report.stage:run_report_of_config", cfg, smk.input.metrics, list(smk.input.bootstrap),
         smk.input.communication, external, Path(smk.output.t4).parent, Path(smk.output.ensemble).parent,
         Path(smk.input.composition).parent, bootstrap=dict(smk.params.bootstrap),
         robustness_csv=smk.input.robustness, log_path=log_of(smk))
elif __name__ == "__main__":
    config, args = from_argv(__doc__)
    from fedhisto.caveats import method_caveats, run_caveats
    from fedhisto.report.stage import run_report

    runs = config.train_runs()
    external: dict[str, list[str]] = {}
    for m, s in runs:
        external.setdefault(m, []).append(f"results/predictions/{m}/seed{s}/external.csv")
    names = [p.stem for p in sorted(Path("results/bootstrap").glob("*.json"))]
    run_report("results/metrics/metrics.json", [f"results/bootstrap/{n}.json" for n in names],
               "results/accounting/communication.csv", external, "results/tables", "results/figures", "results/manifest",
               bootstrap=config.bootstrap.model_dump(include={"seed", "resamples", "confidence"}),
               caveats=run_caveats(config), method_caveats=method_caveats(config),
               robustness_csv="results/metrics/robustness.csv")
