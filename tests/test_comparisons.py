"""Named comparisons: ablations on matched seeds (study Table 7), the seeds and the ablation flag
in every bootstrap JSON, and Tables 6 / 7 split by that flag with bounded p printed as the study does."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import f1_score

from fedhisto.bootstrap.stage import comparison_files, run_bootstrap
from fedhisto.config.study import ConfigError, load_config, load_config_file
from fedhisto.stats.scores import classification_metrics

NAMES = ("ACA", "Normal", "SCC")
Y = np.array([0, 1, 2] * 20)                                   # 60 external images


def _write(method: str, seed: int, probs: np.ndarray) -> None:
    path = f"results/predictions/{method}/seed{seed}/external.csv"
    lines = ["sample_id,label,p_ACA,p_Normal,p_SCC"]
    lines += [f"img{i:03d},{NAMES[y]}," + ",".join(f"{v:.6f}" for v in p) for i, (y, p) in enumerate(zip(Y, probs, strict=True))]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")


def _probs(pred: np.ndarray, top: float) -> np.ndarray:
    return np.eye(3)[pred] * (top - (1 - top) / 2) + (1 - top) / 2


# v2 seeds 11/33/55 are right on every image; seeds 22 and 44 call everything ACA, confidently
# enough that the five-seed ensemble calls everything ACA too. The matched three-seed ensemble
# scores macro-F1 1; the five-seed one would score 1/6 (ACA F1 1/2, the others 0).
GOOD, ALL_ACA = _probs(Y, 0.6), _probs(np.zeros_like(Y), 0.98)
NO_JS = np.where(np.arange(60) < 30, np.where(Y == 2, 1, Y), Y)  # SCC called Normal in the first half
FEDAVG = np.where(Y == 2, 0, Y)                                  # never SCC


@pytest.fixture
def predictions(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for seed in (11, 22, 33, 44, 55):
        _write("past_v2", seed, GOOD if seed in (11, 33, 55) else ALL_ACA)
        _write("fedavg_peft", seed, _probs(FEDAVG, 0.7))
    for seed in (11, 33, 55):
        _write("v2_no_js", seed, _probs(NO_JS, 0.7))
    return tmp_path


def _run(cfg, name: str) -> dict:
    files = comparison_files(cfg, name)
    return run_bootstrap(name, files["method"][1], files["reference"][1], (files["method"][0], files["reference"][0]),
                         cfg.bootstrap, f"results/bootstrap/{name}.json")


CFG = {"train": {"methods": ["fedavg_peft", "past_v2"], "ablations": ["v2_no_js"]},
       "bootstrap": {"resamples": 10_000, "ablation_resamples": 200,
                     "comparisons": {"v2_vs_fedavg": {"method": "past_v2", "reference": "fedavg_peft"},
                                     "v2_vs_no_js": {"method": "past_v2", "reference": "v2_no_js", "ablation": True},
                                     # an ablation whose name and reference say nothing: the flag decides
                                     "matched_fedavg": {"method": "past_v2", "reference": "fedavg_peft",
                                                        "ablation": True}}}}


def test_default_ablations_use_the_matched_seeds_for_both_ensembles():
    cfg = load_config({})
    files = comparison_files(cfg, "v2_vs_no_js")
    assert files["method"] == ([11, 33, 55], [f"results/predictions/past_v2/seed{s}/external.csv" for s in (11, 33, 55)])
    assert files["reference"][0] == [11, 33, 55]
    assert comparison_files(cfg, "v2_vs_fedavg")["method"][0] == [11, 22, 33, 44, 55]


def test_ablation_seeds_outside_the_method_seeds_are_a_config_error():
    with pytest.raises(ConfigError, match=r"v2_vs_no_js.*train\.ablation_seeds \[11, 33, 55\].*'past_v2'.*"
                                          r"train\.seeds \[11, 22\], which lacks \[33, 55\]"):
        load_config({"train": {"seeds": [11, 22]}})
    # no ablation method trains, so no ablation comparison runs: nothing to match
    assert load_config({"train": {"seeds": [11], "ablations": []}}).trained_comparisons() == [
        "v2_vs_fedavg", "v2_vs_fedprox", "v2_vs_filmzero", "v2_vs_v1"]


def test_ablation_bootstrap_compares_matched_ensembles_and_records_seeds(predictions):
    cfg = load_config(CFG)
    doc = _run(cfg, "v2_vs_no_js")
    assert doc["ablation"] is True and doc["n_resamples"] == 200
    assert doc["ensemble"] == {"seeds": [11, 33, 55], "method_seeds": [11, 33, 55], "reference_seeds": [11, 33, 55],
                               "method_models": ["global"], "reference_models": ["global"],
                               "method_checkpoints": 3, "reference_checkpoints": 3}
    m = doc["metrics"]["macro_f1"]
    no_js = f1_score(Y, NO_JS, average="macro")               # every class present: the plain definition
    assert m["method"] == 1.0                                  # the five-seed ensemble would give 1/6
    assert m["reference"] == pytest.approx(no_js, abs=1e-12) and m["difference"] == pytest.approx(1 - no_js, abs=1e-12)
    assert json.loads((predictions / "results/bootstrap/v2_vs_no_js.json").read_text())["ensemble"] == doc["ensemble"]

    principal = _run(cfg, "v2_vs_fedavg")
    assert principal["ablation"] is False and principal["n_resamples"] == 10_000
    assert principal["ensemble"]["method_seeds"] == principal["ensemble"]["reference_seeds"] == [11, 22, 33, 44, 55]
    assert principal["metrics"]["macro_f1"]["method"] == pytest.approx(1 / 6, abs=1e-12)


def test_run_bootstrap_refuses_files_and_seeds_that_disagree(predictions):
    cfg = load_config(CFG)
    files = comparison_files(cfg, "v2_vs_no_js")
    with pytest.raises(ValueError, match=r"2 method prediction files for 3 seeds"):
        run_bootstrap("v2_vs_no_js", files["method"][1][:2], files["reference"][1], ([11, 33, 55], [11, 33, 55]),
                      cfg.bootstrap, "out.json")
    five = comparison_files(cfg, "v2_vs_fedavg")["method"]
    with pytest.raises(ValueError, match=r"v2_vs_no_js: the method's ensemble seeds \[11, 22, 33, 44, 55\] and the "
                                         r"reference's \[11, 33, 55\] differ"):
        run_bootstrap("v2_vs_no_js", five[1], files["reference"][1], (five[0], [11, 33, 55]), cfg.bootstrap, "out.json")


def test_v2_enters_a_comparison_with_a_fewer_seed_comparator_on_those_seeds_only(predictions):
    """fedavg_peft as an extra comparator on train.comparator_seeds 11/33/55 (here under another name):
    v2 enters with 11/33/55, the macro-F1 1 of its matched ensemble, not the 1/6 of its five seeds."""
    from fedhisto.methods import register, unregister

    register("fedavg_extra", "fedhisto.methods.past:PastFamily", config_key="past",
             settings="fedhisto.methods.past:PastConfig")
    try:
        for seed in (11, 33, 55):
            _write("fedavg_extra", seed, _probs(FEDAVG, 0.7))
        cfg = load_config({"train": {"methods": ["past_v2", "fedavg_extra"], "ablations": [],
                                     "comparator_seeds": [11, 33, 55]},
                           "bootstrap": {"comparisons": {"v2_vs_extra": {"method": "past_v2",
                                                                         "reference": "fedavg_extra"}}}})
        assert cfg.trained_seeds("past_v2") == [11, 22, 33, 44, 55]
        assert cfg.comparison_seeds("v2_vs_extra") == ([11, 33, 55], [11, 33, 55])
        doc = _run(cfg, "v2_vs_extra")
        assert doc["ensemble"]["seeds"] == doc["ensemble"]["method_seeds"] == doc["ensemble"]["reference_seeds"]
        assert doc["ensemble"]["method_checkpoints"] == doc["ensemble"]["reference_checkpoints"] == 3
        assert doc["metrics"]["macro_f1"]["method"] == 1.0
    finally:
        unregister("fedavg_extra")


def test_a_comparison_whose_methods_share_no_seed_is_a_config_error():
    with pytest.raises(ConfigError, match=r"bootstrap.comparisons.v2_vs_alone ensembles both methods on the seeds they "
                                          r"share; its method 'past_v2' trains on train.seeds \[11\] and its reference "
                                          r"'v2_no_js' on train.ablation_seeds \[99\]: no seed in common"):
        load_config({"train": {"seeds": [11], "ablation_seeds": [99], "methods": ["past_v2"], "ablations": ["v2_no_js"]},
                     "bootstrap": {"comparisons": {"v2_vs_alone": {"method": "past_v2", "reference": "v2_no_js"}}}})


def test_every_comparison_the_pipeline_plans_ensembles_matched_seeds(repo: Path, snakemake_bin: str, tmp_path: Path):
    """Through the real workflow: the embedded default's dry run, every bootstrap job's input files. Each
    job's two ensembles cover the same seeds, the ones Config.comparison_seeds hands the script."""
    import re
    import shutil
    import subprocess

    shutil.copytree(repo / "config", tmp_path / "config")
    proc = subprocess.run([snakemake_bin, "-s", str(repo / "Snakefile"), "-d", str(tmp_path), "-n", "all",
                           "comparators"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = re.findall(r"rule bootstrap_comparison:\n    input: (.*)\n    output: results/bootstrap/(\w+)\.json",
                      proc.stdout + proc.stderr)
    cfg = load_config_file(repo / "config/config.yaml")
    assert sorted(name for _, name in jobs) == sorted(cfg.trained_comparisons()) and len(jobs) >= 15
    unmatched_before = 0
    for inputs, name in jobs:
        comp = cfg.bootstrap.comparisons[name]
        seeds: dict[str, list[int]] = {comp.method: [], comp.reference: []}
        for method, seed in re.findall(r"results/predictions/(\w+)/seed(\d+)/external\.csv", inputs):
            seeds[method].append(int(seed))
        assert seeds[comp.method] == seeds[comp.reference] == cfg.comparison_seeds(name)[0], name
        unmatched_before += cfg.trained_seeds(comp.method) != cfg.trained_seeds(comp.reference) and not comp.ablation
    # the comparisons whose methods train on different seeds, matched here: the eight extra comparators' and
    # the five LoRA aggregators' (factor_mean, flexlora, fedex_lora, ffa_lora, fedsa_lora on train.comparator_seeds)
    assert unmatched_before == 13


def test_tables_6_and_7_split_by_the_flag_and_print_bounded_p(predictions):
    from fedhisto.report.stage import run_report

    cfg = load_config(CFG)
    paths = []
    for name in ("v2_vs_fedavg", "v2_vs_no_js", "matched_fedavg"):
        _run(cfg, name)
        paths.append(f"results/bootstrap/{name}.json")
    ens = classification_metrics(GOOD, Y)
    summary = {"method": "past_v2", "finalised_seeds": "11", "failed_seeds": "", **{
        f"test_{k}_mean": 1.0 for k in ("macro_f1", "balanced_accuracy", "accuracy", "macro_auroc", "ece")},
        "test_macro_f1_sd": "", "worst_client_macro_f1_mean": 1.0, "worst_client_macro_f1_sd": ""}
    (predictions / "metrics.json").write_text(json.dumps({"ensembles": {"past_v2": ens}, "summary": [summary]}))
    (predictions / "communication.csv").write_text("method,mib_per_round\npast_v2,41.6\n")
    v2_files = comparison_files(cfg, "v2_vs_no_js")["method"][1]
    run_report("metrics.json", paths, "communication.csv", {"past_v2": v2_files}, "tables", "figures")

    t6 = (predictions / "tables/table6_bootstrap.csv").read_text()
    t7 = (predictions / "tables/table7_ablation.csv").read_text()
    assert "v2_vs_fedavg" in t6 and "v2_vs_no_js" not in t6 and "matched_fedavg" not in t6
    assert "v2_vs_no_js" in t7 and "matched_fedavg" in t7 and "v2_vs_fedavg," not in t7
    # v2 is right on every image and FedAvg never calls SCC: no replicate crosses 0 (B = 10,000)
    row = next(r for r in t6.splitlines() if r.startswith("v2_vs_fedavg,") and ",macro_f1," in r)
    assert ",< 0.0002," in row and ",11 22 33 44 55,11 22 33 44 55," in row
    assert "< 0.0002" in (predictions / "tables/table6_bootstrap.md").read_text()
    assert ",11 33 55,11 33 55," in next(r for r in t7.splitlines() if r.startswith("matched_fedavg,"))
    # a real cohort on the tiny encoder: its caveats under Tables 4 and 5; none by default
    assert "CAVEAT" not in (predictions / "tables/table4_internal.md").read_text()
    run_report("metrics.json", paths, "communication.csv", {"past_v2": v2_files}, "tables2", "figures2",
               caveats=["tiny encoder on real images"])
    for name in ("table4_internal", "table5_external"):
        assert "Note: CAVEAT: tiny encoder on real images" in (predictions / f"tables2/{name}.md").read_text()
    assert (predictions / "tables2/table4_internal.csv").read_text() == \
        (predictions / "tables/table4_internal.csv").read_text()  # the numbers are untouched


def test_a_comparator_that_departs_from_its_paper_is_marked_in_every_row_and_under_every_table(predictions):
    """``method_caveats`` (``fedhisto.caveats.method_caveats``): the marked method's rows and every
    comparison with it carry the line in a ``caveat`` column, and a note under each table says it is no
    finding; unmarked rows keep an empty cell and the numbers are untouched."""
    from fedhisto.report.stage import run_report

    cfg = load_config(CFG)
    _run(cfg, "v2_vs_fedavg")
    paths = ["results/bootstrap/v2_vs_fedavg.json"]
    ens = classification_metrics(GOOD, Y)
    summaries = [{"method": m, "finalised_seeds": "11", "failed_seeds": "", **{
        f"test_{k}_mean": 1.0 for k in ("macro_f1", "balanced_accuracy", "accuracy", "macro_auroc", "ece")},
        "test_macro_f1_sd": "", "worst_client_macro_f1_mean": 1.0, "worst_client_macro_f1_sd": ""}
        for m in ("past_v2", "fedavg_peft")]
    (predictions / "metrics.json").write_text(json.dumps({"ensembles": {"past_v2": ens, "fedavg_peft": ens},
                                                          "summary": summaries}))
    (predictions / "communication.csv").write_text("method,mib_per_round\npast_v2,41.6\nfedavg_peft,37.7\n")
    files = comparison_files(cfg, "v2_vs_fedavg")
    line = "fedavg_peft: local steps are adamw (lr 0.0001); Some et al. (Algorithm 1) assumes sgd"
    run_report("metrics.json", paths, "communication.csv",
               {"past_v2": files["method"][1], "fedavg_peft": files["reference"][1]}, "marked", "figures3",
               method_caveats={"fedavg_peft": [line]})
    note = f"Note: CAVEAT: {line} (not a finding about the method as its paper runs it)"
    for name in ("table4_internal", "table5_external", "table6_bootstrap", "table8_communication"):
        with (predictions / f"marked/{name}.csv").open() as fh:
            rows = list(csv.DictReader(fh))
        marked = [r for r in rows if "fedavg_peft" in (r.get("method"), r.get("reference"), r.get("comparison"))
                  or r.get("comparison") == "v2_vs_fedavg"]
        assert marked and all(r["caveat"] == line for r in marked), name
        assert all(r["caveat"] == "" for r in rows if r not in marked), name
        assert note in (predictions / f"marked/{name}.md").read_text(), name
