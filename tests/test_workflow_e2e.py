"""Run the real Snakefile end to end in a scratch working directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import write_tiny_config

from fedhisto.realdata.sources import read_sources_csv

pytestmark = pytest.mark.e2e


def snakemake(snakemake_bin: str, repo: Path, workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([snakemake_bin, "-s", str(repo / "Snakefile"), "-d", str(workdir), *args],
                          capture_output=True, text=True, timeout=1800)


def copy_repository(repo: Path, dest: Path) -> None:
    """The repository's files (tracked, and new ones git does not ignore) into ``dest``, keeping the
    ``config/config.yaml`` already there: a fresh checkout with its own config."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=repo,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if name != "config/config.yaml" and (repo / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / name, dest / name)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, repo: Path, snakemake_bin: str) -> Path:
    wd = tmp_path_factory.mktemp("wf")
    write_tiny_config(wd, max_rounds=2)  # the real Snakefile on a tiny config
    # bytes, not text: text mode would turn the carriage returns of progress redraws into newlines
    proc = subprocess.run([snakemake_bin, "-s", str(repo / "Snakefile"), "-d", str(wd), "--cores", "2", "all"],
                          capture_output=True, timeout=1800)
    console = (proc.stdout + proc.stderr).decode(errors="replace")
    assert proc.returncode == 0, console[-8000:]
    (wd / "first_all.out").write_bytes(console.encode())
    # what `all` alone left: the study's methods, not the extra comparator local_only (tested below)
    (wd / "after_all.json").write_text(json.dumps({
        "trained": sorted(p.name for p in (wd / "results/train").iterdir()),
        "table4": (wd / "results/tables/table4_internal.md").read_text(),
        "robustness": (wd / "results/metrics/robustness.csv").read_text(),
        "robustness_table": (wd / "results/tables/robustness.md").read_text()}))
    proc = subprocess.run([snakemake_bin, "-s", str(repo / "Snakefile"), "-d", str(wd), "--cores", "2", "comparators"],
                          capture_output=True, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode(errors="replace")[-8000:]
    return wd


def test_all_leaves_the_extra_comparators_to_their_target_and_the_tables_then_show_them(workdir: Path):
    after_all = json.loads((workdir / "after_all.json").read_text())
    assert after_all["trained"] == ["fedavg_peft", "past_v2"]
    assert "past_v2" in after_all["table4"] and "local_only" not in after_all["table4"]
    assert "local_only" in (workdir / "results/tables/table4_internal.md").read_text()  # after `comparators`


def test_logs_have_one_line_per_step_and_no_progress_bar_fragments(workdir: Path):
    """Jobs run side by side with a piped stderr: no carriage-return redraws, a line per finished step."""
    console = (workdir / "first_all.out").read_bytes().decode()
    assert "\r" not in console
    cohort_log = (workdir / "logs/cohort/synthesize_cohort.log").read_text()
    assert " render: " in cohort_log and " img in " in cohort_log and "\r" not in cohort_log
    assert " fingerprint: " in (workdir / "logs/clearance/audit_duplicates.log").read_text()
    # one prediction job per method, logging each of its seeds
    assert "predict past_v2 seed 11: test " in (workdir / "logs/predict/past_v2.log").read_text()


def test_all_builds_the_cohort_with_provenance(workdir: Path):
    out = workdir / "results/cohort"
    rows = read_sources_csv(out / "sources.csv")
    assert all((workdir / r.path).is_file() for r in rows)
    for name in ("sources.csv", "contact_sheet.png", "planted_families.csv"):
        meta = json.loads((out / f"{name}.prov.json").read_text())
        assert meta["stage"] == "cohort" and meta["schema_version"] == 1 and len(meta["config_hash"]) == 64
        assert meta["git_commit"] != ""
    assert (workdir / "logs/cohort/synthesize_cohort.log").exists()


def test_second_run_does_nothing(workdir: Path, repo: Path, snakemake_bin: str):
    proc = snakemake(snakemake_bin, repo, workdir, "--cores", "2", "all")
    assert proc.returncode == 0
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_a_classify_folder_after_all_runs_only_export_and_classify(workdir: Path, repo: Path, snakemake_bin: str):
    """Listing a folder under classify: after `all` plans the export and classify jobs and nothing else (no
    training stage reads the block), and the target writes one row per image and a contact sheet."""
    import csv

    cfg = yaml.safe_load((workdir / "config/config.yaml").read_text())
    cfg["classify"] = {"folders": {"external": "results/cohort/images/external"}}
    changed = workdir / "classify.yaml"
    changed.write_text(yaml.safe_dump(cfg))
    proc = snakemake(snakemake_bin, repo, workdir, "-n", "--quiet", "rules", "all", "--configfile", str(changed))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    planned = {p[0]: int(p[1]) for p in (line.split() for line in (proc.stdout + proc.stderr).splitlines())
               if len(p) == 2 and p[1].isdigit() and p[0] not in ("total", "job")}
    assert planned == {"export_model": 1, "classify_folder": 1, "all": 1}, planned
    target = "results/classify/external/predictions.csv"
    proc = snakemake(snakemake_bin, repo, workdir, "--cores", "2", target, "--configfile", str(changed))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with (workdir / target).open() as fh:
        rows = list(csv.DictReader(fh))
    images = sorted(p.relative_to(workdir / "results/cohort/images/external").as_posix()
                    for p in (workdir / "results/cohort/images/external").rglob("*") if p.is_file())
    # every file of the folder: the 64 external images of the manifest and the planted copies clearance set aside
    assert sorted(r["image"] for r in rows) == images and len(rows) > 64
    assert list(rows[0])[:5] == ["image", "p_ACA", "p_Normal", "p_SCC", "label"]
    assert (workdir / "results/classify/external/contact_sheet.png").stat().st_size > 0
    assert "classify: wrote" in (workdir / "logs/classify/external.log").read_text()
    assert (workdir / "results/export/past_v2/SHA256SUMS").exists()
    # the external site's shifted stain and scanner: the folder is flagged, the log and the JSON say so
    domain = json.loads((workdir / "results/classify/external/predictions.json").read_text())["domain"]
    assert domain["verdict"] == "outside" and f"classify: domain: {domain['line']}" in \
        (workdir / "logs/classify/external.log").read_text()
    assert (workdir / "results/export/past_v2/model_card.md").read_text().startswith(
        "**Demonstration model, not for real tissue.**")


def test_changed_parameter_reruns_its_stage(workdir: Path, repo: Path, snakemake_bin: str):
    cfg = yaml.safe_load((workdir / "config/config.yaml").read_text())
    cfg["cohort"]["synthetic"]["seed"] = 7
    changed = workdir / "changed.yaml"
    changed.write_text(yaml.safe_dump(cfg))
    proc = snakemake(snakemake_bin, repo, workdir, "-n", "all", "--configfile", str(changed))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "synthesize_cohort" in proc.stdout + proc.stderr
    assert "params" in (proc.stdout + proc.stderr).lower()  # rerun because the parameters changed


def test_clearance_recovers_every_planted_family_and_manifest_lands_on_profile(workdir: Path):
    audit = json.loads((workdir / "results/clearance/audit.json").read_text())
    assert audit["planted"]["recall"] == 1.0
    assert audit["planted"]["pairwise"]["precision"] == 1.0
    assert audit["failures"] == [] and audit["label_conflicts"] == []
    from fedhisto.config.profiles import PROFILES

    config = yaml.safe_load((workdir / "config/config.yaml").read_text())
    profile = PROFILES[config["cohort"]["synthetic"]["profile"]]
    assert profile is PROFILES["small"]  # the default's pools and planted families, short evaluation sets
    with (workdir / "results/manifest/composition.csv").open() as fh:
        comp = {(r["partition"], r["subset"]): (int(r["ACA"]), int(r["Normal"]), int(r["SCC"]))
                for r in __import__("csv").DictReader(fh)}
    for client, pool in profile.clients.items():
        assert comp[(client, "pool")] == pool
    assert comp[("validation", "all")] == profile.validation and comp[("test", "all")] == profile.test
    assert comp[("external", "all")] == profile.external
    assert ("unused", "all") not in comp
    summary = json.loads((workdir / "results/manifest/manifest.json").read_text())
    assert summary["boundary_audit"]["cross_boundary_family_edges"] == []
    assert len(summary["dataset_identity"]) == 64


def test_training_jobs_ran_per_method_and_seed(workdir: Path):
    for method in ("fedavg_peft", "past_v2"):
        run = workdir / f"results/train/{method}/seed11"
        status = json.loads((run / "status.json").read_text())
        assert status["status"] == "finalised"
        report = json.loads((run / "report.json").read_text())
        assert report["rounds"] == 2 and 0.0 <= report["validation_macro_f1"] <= 1.0
        assert (run / "checkpoint.pt").exists() and (workdir / f"logs/train/{method}/seed11.log").exists()


def _dry_run_jobs(snakemake_bin: str, repo: Path, workdir: Path, *extra: str) -> set[str]:
    proc = snakemake(snakemake_bin, repo, workdir, "-n", "--quiet", "rules", *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    return {name for name in ("synthesize_cohort", "audit_duplicates", "build_manifest", "compute_stain_descriptors",
                              "train_federated", "predict_cohorts", "summarize_metrics", "bootstrap_comparison",
                              "account_communication") if name in text}


def test_changed_training_parameter_reruns_only_what_depends_on_it(workdir: Path, repo: Path, snakemake_bin: str):
    cfg = yaml.safe_load((workdir / "config/config.yaml").read_text())
    cfg["train"]["weight_decay"] = 0.002
    changed = workdir / "changed_train.yaml"
    changed.write_text(yaml.safe_dump(cfg))
    jobs = _dry_run_jobs(snakemake_bin, repo, workdir, "all", "--configfile", str(changed))
    assert "train_federated" in jobs and "predict_cohorts" in jobs
    assert not jobs & {"synthesize_cohort", "audit_duplicates", "build_manifest", "compute_stain_descriptors"}


def test_local_only_flows_through_prediction_metrics_bootstrap_and_tables(workdir: Path):
    """One model per client: predictions carry a model column, metrics and the bootstrap use the mean model.
    (Runs before test_metrics_and_named_bootstrap, which removes results/bootstrap.)"""
    import csv

    with (workdir / "results/predictions/local_only/seed11/external.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert sorted({r["model"] for r in rows}) == ["C1", "C2", "C3", "C4", "C5"] and len(rows) == 5 * 64
    doc = json.loads((workdir / "results/bootstrap/v2_vs_local.json").read_text())
    assert doc["ensemble"]["reference_models"] == ["C1", "C2", "C3", "C4", "C5"]
    metrics = json.loads((workdir / "results/metrics/metrics.json").read_text())
    assert metrics["ensembles"]["local_only"]["models"] == 5
    assert doc["metrics"]["macro_f1"]["reference"] == pytest.approx(metrics["ensembles"]["local_only"]["macro_f1"])
    assert "local_only" in (workdir / "results/tables/table4_internal.md").read_text()
    comm = (workdir / "results/accounting/communication.csv").read_text()
    assert any(line.startswith("local_only,") and ",0.000000," in line for line in comm.splitlines())


def test_metrics_and_named_bootstrap(workdir: Path, repo: Path, snakemake_bin: str):
    summary = (workdir / "results/metrics/summary.csv").read_text()
    assert "fedavg_peft" in summary and "past_v2" in summary
    doc = json.loads((workdir / "results/bootstrap/v2_vs_fedavg.json").read_text())
    assert doc["n_resamples"] == 2000 and doc["seed"] == 20260730 and doc["n_images"] == 64
    for key in ("macro_f1", "balanced_accuracy", "accuracy", "recall_ACA", "recall_Normal", "recall_SCC"):
        m = doc["metrics"][key]
        assert m["ci_low"] <= m["difference"] <= m["ci_high"] or m["ci_low"] == m["ci_high"]
        assert 0 <= m["p_two_sided"] <= 1
    assert "provenance" in doc
    import shutil

    shutil.rmtree(workdir / "results/bootstrap")
    # the README's named target exactly as a user types it, in a copy of the repository (the run's own tiny
    # config in place of config/config.yaml): no --cores, no -s, no -d; profiles/default gives the cores
    copy_repository(repo, workdir)
    proc = subprocess.run(["snakemake", "results/bootstrap/v2_vs_fedavg.json"], cwd=workdir, capture_output=True,
                          text=True, timeout=1800, env={**os.environ, "PATH": f"{Path(snakemake_bin).parent}:"
                                                                              f"{os.environ.get('PATH', '')}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profiles/default" in proc.stderr  # Snakemake says which profile set its defaults
    log = proc.stdout + proc.stderr
    assert "bootstrap_comparison" in log and "train_federated" not in log and "predict_cohorts" not in log
    assert json.loads((workdir / "results/bootstrap/v2_vs_fedavg.json").read_text())["metrics"] == doc["metrics"]


def test_tables_figures_and_html_report(workdir: Path, repo: Path, snakemake_bin: str):
    for name in ("table2_partitions", "table4_internal", "table5_external", "table6_bootstrap", "table7_ablation",
                 "table8_communication"):
        assert (workdir / f"results/tables/{name}.csv").exists() and (workdir / f"results/tables/{name}.md").exists()
    assert (workdir / "results/tables/table4_internal.csv.prov.json").exists()
    assert (workdir / "results/metrics/summary.csv.prov.json").exists()
    t5 = (workdir / "results/tables/table5_external.md").read_text()
    assert "past_v2" in t5 and "recall_SCC" in t5
    for fig in ("ensemble_macro_f1", "class_recall", "confusion_v2", "ablation_forest", "reliability"):
        assert (workdir / f"results/figures/{fig}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = snakemake(snakemake_bin, repo, workdir, "--report", str(workdir / "report.html"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    html = (workdir / "report.html").read_text(errors="replace")
    assert "Reliability diagram" in html and "method-level ensembles" in html
    assert "Site robustness" in html and "robustness.png" in html


def test_site_robustness_after_all_and_comparators(workdir: Path):
    """Every reported run's representation and the frozen encoder's, one row each (local_only: one per site
    model); the comparator local_only only once its runs exist (after `comparators`), as in the tables."""
    import csv

    after_all = json.loads((workdir / "after_all.json").read_text())
    methods = [r["method"] for r in csv.DictReader(after_all["robustness"].splitlines())]
    assert methods == ["frozen_encoder", "fedavg_peft", "past_v2"]
    assert "past_v2" in after_all["robustness_table"] and "local_only" not in after_all["robustness_table"]
    with (workdir / "results/metrics/robustness.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["method"], r["model"], r["encoder_state"]) for r in rows] == [
        ("frozen_encoder", "", "frozen"), ("fedavg_peft", "global", "adapted"), ("past_v2", "global", "adapted"),
        *[("local_only", f"C{k}", "adapted") for k in range(1, 6)]]
    assert all(0.0 <= float(r["ri"]) <= 1.0 and r["n_images"] == "36" for r in rows)
    assert "frozen_encoder" in (workdir / "results/tables/robustness.md").read_text()
    assert (workdir / "results/figures/robustness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _macro_f1_of(paths: list[Path], keep=lambda row: True) -> float:
    """Independent recomputation from per-image CSVs: the seeds' mean probabilities, argmax, sklearn's
    macro-F1 over the classes present in the labels."""
    import csv

    import numpy as np
    from sklearn.metrics import f1_score

    probs: dict[str, np.ndarray] = {}
    labels: dict[str, str] = {}
    for path in paths:
        with path.open() as fh:
            for r in csv.DictReader(fh):
                if keep(r):
                    p = np.array([float(r["p_ACA"]), float(r["p_Normal"]), float(r["p_SCC"])])
                    probs[r["sample_id"]] = probs.get(r["sample_id"], 0) + p / len(paths)
                    labels[r["sample_id"]] = r["label"]
    ids = sorted(probs)
    names = ["ACA", "Normal", "SCC"]
    y = [labels[i] for i in ids]
    pred = [names[int(np.argmax(probs[i]))] for i in ids]
    return float(f1_score(y, pred, labels=sorted(set(y)), average="macro", zero_division=0))


def test_experiments_run_reuse_main_runs_and_recompute_from_their_predictions(workdir: Path, repo: Path,
                                                                               snakemake_bin: str):
    proc = snakemake(snakemake_bin, repo, workdir, "--cores", "2", "experiments")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    assert "train_federated" not in log  # the stain-invariant and representatives conditions are the main runs
    assert "Nothing to be done" in (lambda p: p.stdout + p.stderr)(
        snakemake(snakemake_bin, repo, workdir, "-n", "experiments"))
    root = workdir / "results/experiments"
    for name in ("dose_response", "leakage", "leave_one_site_out", "calibration", "probe", "privacy_audit"):
        doc = json.loads((root / f"{name}/{name}.json").read_text())
        assert doc["provenance"]["stage"] == "experiments" and doc["provenance"]["inputs"]
        assert (root / f"{name}/{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (root / f"{name}/{name}.csv").stat().st_size > 0
    # headline of experiment 1: v2 minus FedAvg-PEFT at today's external shift, stain-invariant encoder
    dose = json.loads((root / "dose_response/dose_response.json").read_text())
    cell = next(d for d in dose["v2_vs_fedavg"] if d["encoder"] == "stain_invariant" and d["severity"] == 1.0)
    preds = root / "dose_response/stain_invariant/predictions"
    at_1 = lambda r: float(r["severity"]) == 1.0  # noqa: E731
    v2, fedavg = (_macro_f1_of([preds / f"{m}/seed11.csv"], at_1) for m in ("past_v2", "fedavg_peft"))
    assert cell["difference"] == pytest.approx(v2 - fedavg, abs=1e-12)
    assert cell["images"] == 3 * 5 and cell["ci_low"] <= cell["difference"] <= cell["ci_high"]
    # experiment 3: the left-out site's score is recomputed from the condition's own predictions
    loso = json.loads((root / "leave_one_site_out/leave_one_site_out.json").read_text())
    row = next(r for r in loso["per_site"] if r["method"] == "past_v2" and r["left_out"] == "C1")
    external = root / "leave_one_site_out/C1/predictions/past_v2/seed11/external.csv"
    assert row["macro_f1"] == pytest.approx(_macro_f1_of([external]), abs=1e-12)
    manifest = root / "leave_one_site_out/C1/manifest/manifest.csv"
    assert ",C1," not in manifest.read_text()  # client C1 no longer trains
    leak = json.loads((root / "leakage/leakage.json").read_text())
    assert {r["policy"] for r in leak["per_policy"]} == {"ignore_families", "representatives"}
    cal = json.loads((root / "calibration/calibration.json").read_text())
    assert all(0.05 <= r["temperature"] <= 20 for r in cal["per_run"])
    # experiment 5: each encoder's paired-stain retrieval is the mean of its per-image hits, beside its gap
    import csv

    probe = json.loads((root / "probe/probe.json").read_text())
    assert set(probe["ranking"]["probe_order"]) == {"stain_invariant", "plain"}
    for encoder in ("stain_invariant", "plain"):
        with (root / f"probe/{encoder}/per_image.csv").open() as fh:
            hits = [int(r["hit_a_to_b"]) + int(r["hit_b_to_a"]) for r in csv.DictReader(fh)
                    if r["measure"] == "paired_stain"]
        row = next(r for r in probe["rows"] if r["encoder"] == encoder and r["measure"] == "paired_stain")
        assert row["retrieval_top1"] == pytest.approx(sum(hits) / (2 * len(hits)), abs=1e-12)
        gap = next(d for d in dose["v2_vs_fedavg"] if d["encoder"] == encoder and d["severity"] == 1.0)
        assert row["gap"] == gap["difference"] and row["images"] == 3 * 5


def test_every_result_block_renders_from_the_runs_results_and_prints_their_numbers(workdir: Path, tmp_path: Path):
    """After `all` and `experiments` (the tests above), `fedhisto records` records every registered block from
    this results folder, and the dose-response block prints each cell of dose_response.csv as pandas reads it."""
    import pandas as pd

    from fedhisto.records import experiment_tables, record_blocks
    from fedhisto.registries.record_registry import RECORDS

    from_results = {name for name, e in RECORDS.items()  # the blocks a default run's results make
                    if e.record is None and not e.from_code and e.run == "default"}
    stamps = record_blocks.record(workdir / "results", run="default", root=tmp_path)
    assert set(stamps) == from_results
    assert all(s["hosts"] and s["commits"] and s["stages"] for s in stamps.values())
    for name in sorted(from_results):
        body = record_blocks.render_block(name, root=tmp_path)
        assert body.startswith("*Generated by `fedhisto records`") and "Stale" not in body, name
        # the tiny config trains no ablation: Table 7 says so instead of printing an empty table
        assert ("| " in body) != (name == "table7_ablation"), (name, body)
    text = experiment_tables.dose_response(workdir / "results")
    cells = pd.read_csv(workdir / "results/experiments/dose_response/dose_response.csv")
    for _, c in cells.iterrows():
        shown = f"{c['macro_f1']:.3f} [{c['macro_f1_ci_low']:.3f}, {c['macro_f1_ci_high']:.3f}]"
        row = next(line for line in text.split(f"Encoder `{c['encoder']}`", 1)[1].splitlines()
                   if line.startswith(f"| {c['method']} |"))
        assert shown in row, (c.to_dict(), row)
