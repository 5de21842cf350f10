"""The patient-level (cluster) bootstrap beside the image-level one.

Patients are resampled with replacement and bring all their images; both methods see the same
resamples; the image-level figures are exactly those of a run without patients.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from fedhisto.bootstrap.stage import run_bootstrap
from fedhisto.config.study import BootstrapConfig, load_config
from fedhisto.stats.prediction_files import COLUMNS, PROB_COLUMNS
from fedhisto.stats.resampling import cluster_index, cluster_weights, paired_bootstrap, resample_weights


@pytest.mark.parametrize(
    ("keys", "expected"),
    [(["a", "a", "b"], [0, 0, 1]), (["", "", "a"], [0, 1, 2]), (["b", "", "b", "a"], [0, 1, 0, 2]),
     (["", ""], [0, 1])],
)
def test_cluster_index(keys, expected):
    assert cluster_index(keys).tolist() == expected


def test_cluster_weights_move_whole_patients():
    clusters = np.array([0, 0, 0, 1, 2, 2])
    w = cluster_weights(np.random.default_rng(0), clusters, 500)
    # every image of a patient carries its patient's multiplicity; 3 patients are drawn per replicate
    assert np.all(w[:, 0] == w[:, 1]) and np.all(w[:, 1] == w[:, 2]) and np.all(w[:, 4] == w[:, 5])
    assert np.all(w[:, [0, 3, 4]].sum(1) == 3)
    # singletons: exactly the image-level draw from the same generator state
    n = 7
    same = cluster_weights(np.random.default_rng(5), np.arange(n), 40)
    assert np.array_equal(same, resample_weights(np.random.default_rng(5), n, 40))


def clustered_case():
    """10 patients of 20 images: the method is right on every image of patients 0-5, wrong on 6-9;
    the reference is right on 2 of every 5 images. Images within a patient are not independent."""
    y = np.tile(np.arange(3), 67)[:200]
    patient = np.repeat(np.arange(10), 20)
    a = np.where(patient < 6, y, (y + 1) % 3)
    b = np.where(np.arange(200) % 5 < 2, y, (y + 1) % 3)
    return y, a, b, patient


def test_patient_intervals_are_wider_when_patients_cluster():
    y, a, b, patient = clustered_case()
    img = paired_bootstrap(y, a, b, 2000, 7)["accuracy"]
    pat = paired_bootstrap(y, a, b, 2000, 7, clusters=patient)["accuracy"]
    assert img["difference"] == pat["difference"] == pytest.approx(0.2)  # same point estimate: 0.6 - 0.4
    # SD of the mean difference: images sqrt(.48/200) ~ 0.049, patients sqrt(.24/10) ~ 0.155; ratio ~ 3.2
    assert (pat["ci_high"] - pat["ci_low"]) > 2 * (img["ci_high"] - img["ci_low"])
    assert img["ci_low"] > 0 and pat["ci_low"] < 0  # significant per image, not per patient
    # singleton clusters reproduce the image-level result exactly
    assert paired_bootstrap(y, a, b, 500, 3, clusters=np.arange(200)) == paired_bootstrap(y, a, b, 500, 3)


def write_predictions(path: Path, y: np.ndarray, pred: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS, lineterminator="\n")
        w.writeheader()
        for i, (t, p) in enumerate(zip(y, pred, strict=True)):
            probs = np.eye(3)[p] * 0.8 + 0.2 / 3
            w.writerow({"sample_id": f"s{i:04d}", "label": ["ACA", "Normal", "SCC"][t],
                        **dict(zip(PROB_COLUMNS, probs, strict=True)), "pred": ["ACA", "Normal", "SCC"][p],
                        "cohort": "external", "client": "", "differentiation": "", "magnification": "",
                        "run_status": "finalised"})


def write_manifest(path: Path, n: int, patient: np.ndarray | None) -> None:
    with path.open("w", newline="") as fh:
        cols = ["sample_id", "site", "split", *(["patient"] if patient is not None else [])]
        w = csv.DictWriter(fh, fieldnames=cols, lineterminator="\n")
        w.writeheader()
        for i in range(n):
            w.writerow({"sample_id": f"s{i:04d}", "site": "lh", "split": "external",
                        **({"patient": f"patient:{patient[i]}"} if patient is not None else {})})


@pytest.mark.parametrize("with_patients", [False, True])
def test_stage_adds_patient_level_and_keeps_image_level(tmp_path: Path, with_patients: bool):
    y, a, b, patient = clustered_case()
    write_predictions(tmp_path / "a.csv", y, a)
    write_predictions(tmp_path / "b.csv", y, b)
    write_manifest(tmp_path / "manifest.csv", len(y), patient if with_patients else None)
    cfg = load_config({}).bootstrap
    cfg = BootstrapConfig(**{**cfg.model_dump(), "resamples": 1000})
    name = next(iter(cfg.comparisons))
    doc = run_bootstrap(name, [str(tmp_path / "a.csv")], [str(tmp_path / "b.csv")], ([11], [11]), cfg,
                        tmp_path / "out.json", tmp_path / "manifest.csv")
    plain = run_bootstrap(name, [str(tmp_path / "a.csv")], [str(tmp_path / "b.csv")], ([11], [11]), cfg,
                          tmp_path / "plain.json")
    assert doc["metrics"] == plain["metrics"] and doc["interval_unit"] == "image"  # image-level unchanged
    written = json.loads((tmp_path / "out.json").read_text())
    if not with_patients:
        assert doc["patient_level"] is None and written["patient_level"] is None
        return
    level = written["patient_level"]
    assert level["n_patients"] == 10 and level["images_without_patient"] == 0
    width = {k: m["accuracy"]["ci_high"] - m["accuracy"]["ci_low"] for k, m in
             (("image", written["metrics"]), ("patient", level["metrics"]))}
    assert width["patient"] > 2.5 * width["image"]
