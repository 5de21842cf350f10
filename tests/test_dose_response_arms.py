"""The dose-response summary with the stain-augmented FedAvg arm (issue 23 item 1): v2 - FedAvg-PEFT
as before, plus v2 - arm and arm - FedAvg-PEFT, per encoder and severity, with paired CIs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
from sklearn.metrics import f1_score

from fedhisto.config.study import load_config
from fedhisto.experiments import dose_response as X
from fedhisto.experiments.dose_response import difference_pairs, summarise_dose_response
from fedhisto.stats.prediction_files import PROB_COLUMNS, write_predictions

SEVERITIES = [0.0, 1.0]
N = 30  # images per severity


def _cohort(path: Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    ids = [f"{k:016x}" for k in range(2 * N)]
    sev = np.repeat(SEVERITIES, N)
    y = np.tile(np.arange(3), 2 * N // 3)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, ["sample_id", "severity"])
        w.writeheader()
        w.writerows({"sample_id": i, "severity": s} for i, s in zip(ids, sev, strict=True))
    return ids, sev, y


def _predictions(path: Path, ids, y, accuracy: float, seed: int) -> np.ndarray:
    """Probabilities whose argmax is right for a share ``accuracy`` of the images."""
    rng = np.random.default_rng(seed)
    pred = np.where(rng.random(len(y)) < accuracy, y, (y + 1) % 3)
    probs = np.full((len(y), 3), 0.1)
    probs[np.arange(len(y)), pred] = 0.8
    rows = [{"sample_id": i, "label": ["ACA", "Normal", "SCC"][t], **dict(zip(PROB_COLUMNS, p, strict=True)),
             "pred": ["ACA", "Normal", "SCC"][int(p.argmax())], "cohort": "external", "client": "",
             "differentiation": "", "magnification": "", "run_status": "ok", "model": "global"}
            for i, t, p in zip(ids, y, probs, strict=True)]
    write_predictions(path, rows)
    return pred


def test_arm_enters_the_default_dose_response_runs_and_pairs():
    cfg = load_config({})
    assert cfg.experiments.dose_response.extra_methods == ["fedavg_peft_stain"]
    assert ("dose_response/plain", "fedavg_peft_stain", 11) in X.dose_runs(cfg)
    assert difference_pairs(["fedavg_peft", "fedavg_peft_stain", "past_v2"], ["fedavg_peft_stain"]) == [
        ("past_v2", "fedavg_peft"), ("past_v2", "fedavg_peft_stain"), ("fedavg_peft_stain", "fedavg_peft")]
    # without the arm's runs only the principal pair is left
    assert difference_pairs(["fedavg_peft", "past_v2"], ["fedavg_peft_stain"]) == [("past_v2", "fedavg_peft")]
    # the arm does not change the shifted cohort's images
    from fedhisto.config.stage_blocks import stage_block

    none = load_config({"experiments": {"dose_response": {"extra_methods": []}}})
    assert stage_block(cfg, "shift_cohort") == stage_block(none, "shift_cohort")


def test_summary_reports_every_pair_with_the_bootstrap_difference(tmp_path: Path):
    cfg = load_config({"experiments": {"resamples": 200, "seeds": [11],
                                       "dose_response": {"severities": SEVERITIES, "encoders": ["plain"]}}})
    ids, sev, y = _cohort(tmp_path / "cohort.csv")
    accuracy = {"past_v2": 0.95, "fedavg_peft": 0.6, "fedavg_peft_stain": 0.85,
                "fedprox_peft": 0.6, "past_v1": 0.9, "fedstain": 0.9}
    runs, preds = [], {}
    for k, (method, acc) in enumerate(accuracy.items()):
        path = tmp_path / f"{method}.csv"
        preds[method] = _predictions(path, ids, y, acc, seed=k)
        runs.append(("dose_response/plain", method, 11, str(path)))
    out = summarise_dose_response(runs, tmp_path / "cohort.csv", cfg, tmp_path / "out")
    pairs = {(d["method"], d["reference"]) for d in out["paired_differences"]}
    assert pairs == {("past_v2", "fedavg_peft"), ("past_v2", "fedavg_peft_stain"), ("fedavg_peft_stain", "fedavg_peft")}
    assert len(out["paired_differences"]) == 3 * len(SEVERITIES)
    assert {(d["method"], d["reference"]) for d in out["v2_vs_fedavg"]} == {("past_v2", "fedavg_peft")}
    for d in out["paired_differences"]:
        sel = sev == d["severity"]

        def f1(m, sel=sel):
            return f1_score(y[sel], preds[m][sel], average="macro")
        assert abs(d["difference"] - (f1(d["method"]) - f1(d["reference"]))) < 1e-9
        assert d["ci_low"] <= d["difference"] <= d["ci_high"]
    on_disk = list(csv.DictReader((tmp_path / "out" / "paired_differences.csv").open()))
    assert len(on_disk) == len(out["paired_differences"])
    principal = list(csv.DictReader((tmp_path / "out" / "v2_vs_fedavg_by_severity.csv").open()))
    assert {(r["method"], r["reference"]) for r in principal} == {("past_v2", "fedavg_peft")}
    assert json.loads((tmp_path / "out" / "dose_response.json").read_text())["design"]["extra_methods"] == [
        "fedavg_peft_stain"]
    assert (tmp_path / "out" / "dose_response.png").stat().st_size > 0
