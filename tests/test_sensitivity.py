"""Issue 23 item 3: the sensitivity ("multiverse") experiment's layout, reuse rule and verdicts."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY, train

from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import ConfigError, load_config
from fedhisto.experiments import sensitivity_layout as SX
from fedhisto.experiments.sensitivity import summarise_sensitivity
from fedhisto.stats.prediction_files import PROB_COLUMNS, write_predictions

CLASSES = ["ACA", "Normal", "SCC"]


def test_readings_apply_their_values_and_bad_keys_are_named():
    cfg = load_config({})
    assert SX.reading_config(cfg, "baseline") is cfg
    assert SX.reading_config(cfg, "ce_views_sum").train.readings.ce_views == "sum"
    assert SX.reading_config(cfg, "film_tanh").model.film_bound == "tanh"
    assert SX.reading_config(cfg, "adamw_kept").train.readings.optimizer_state == "kept"
    hibou = SX.reading_config(cfg, "hibou_statistics").views
    assert hibou.mean == pytest.approx((0.7068, 0.5755, 0.722)) and hibou.std[0] == pytest.approx(0.195)
    assert SX.reading_config(cfg, "ce_views_sum").train.methods == cfg.train.methods  # nothing else moves
    with pytest.raises(ConfigError, match=r"train\.lr"):
        load_config({"experiments": {"sensitivity": {"readings": {"faster": {"train.lr": 0.1}}}}})
    typo = load_config({"experiments": {"sensitivity": {"readings": {"typo": {"train.readings.ce_view": "sum"}}}}})
    with pytest.raises(ValueError, match="ce_view"):
        SX.reading_config(typo, "typo")
    wrong = load_config({"experiments": {"sensitivity": {"readings": {"bad": {"model.film_bound": "sigmoid"}}}}})
    with pytest.raises(ValueError, match="film_bound"):
        SX.reading_config(wrong, "bad")
    with pytest.raises(ConfigError, match="baseline"):
        load_config({"experiments": {"sensitivity": {"readings": {"baseline": {"model.film_bound": "tanh"}}}}})


def test_each_reading_is_its_own_run_identity_and_the_baseline_is_the_main_run():
    cfg = load_config({})
    main = stage_block(cfg, "train", method="past_v2", seed=11)
    assert stage_block(SX.reading_config(cfg, "baseline"), "train", method="past_v2", seed=11) == main
    blocks = [stage_block(SX.reading_config(cfg, r), "train", method="past_v2", seed=11)
              for r in cfg.experiments.sensitivity.readings if r != "mixstyle_last_block"]
    assert all(b != main for b in blocks) and len({json.dumps(b, sort_keys=True) for b in blocks}) == len(blocks)
    # a method family's own block enters that family's identity only (training_settings)
    moved = SX.reading_config(cfg, "mixstyle_last_block")
    assert stage_block(moved, "train", method="past_v2", seed=11) == main
    assert stage_block(moved, "train", method="fedstain", seed=11) != stage_block(cfg, "train", method="fedstain",
                                                                                  seed=11)


def test_which_methods_a_reading_retrains_and_what_stands_for_the_rest():
    cfg = load_config({"train": {"methods": ["fedavg_peft", "past_v2", "fedstain"], "ablations": ["v2_no_js"]}})
    affected = {r: {m for m in ("past_v2", "fedavg_peft", "v2_no_js", "fedstain") if SX.affects(cfg, r, m)}
                for r in cfg.experiments.sensitivity.readings}
    assert affected["ce_views_sum"] == affected["adaptive_delta_w"] == affected["film_tanh"] == {"past_v2", "v2_no_js"}
    assert affected["mixstyle_last_block"] == {"fedstain"}
    assert affected["ce_class_mean"] == affected["ce_weighted_mean"] == affected["hibou_statistics"] == {
        "past_v2", "fedavg_peft", "v2_no_js", "fedstain"}
    # every method's local training runs AdamW, so keeping its state retrains every method
    assert affected["adamw_kept"] == {"past_v2", "fedavg_peft", "v2_no_js", "fedstain"}
    f = SX.prediction_file
    assert f(cfg, "stain_invariant", "baseline", "past_v2", 11) == "results/predictions/past_v2/seed11/external.csv"
    assert f(cfg, "stain_invariant", "ce_views_sum", "fedavg_peft", 11) == f(cfg, "stain_invariant", "baseline",
                                                                            "fedavg_peft", 11)
    assert f(cfg, "stain_invariant", "ce_views_sum", "past_v2", 11) == \
        "results/experiments/sensitivity/stain_invariant/ce_views_sum/predictions/past_v2/seed11/external.csv"
    assert f(cfg, "plain", "baseline", "past_v2", 11) == "results/experiments/dose_response/plain/predictions/past_v2/seed11.csv"
    # v2_no_js is no dose-response method: the plain condition trains its own baseline
    assert f(cfg, "plain", "baseline", "v2_no_js", 11) == \
        "results/experiments/sensitivity/plain/baseline/predictions/v2_no_js/seed11/shifted.csv"
    runs = SX.sensitivity_runs(cfg)
    assert len(runs) == 2 * 9 * 4  # encoders x (baseline + 8 readings) x methods
    own = {r[4] for r in runs if r[4].startswith(SX.HERE)}
    assert len(own) == 47  # the design's count (docs/experiments.md)


def test_an_unaffected_method_trains_bitwise_as_its_baseline(prepared, tmp_path):
    """The reuse rule's premise: ce_views (a paired-view reading) leaves a single-view method unchanged."""
    one = {**TINY, "train": {**TINY["train"], "max_rounds": 1, "local_epochs": 1}}
    base = load_config(one)
    summed = load_config({**one, "train": {**one["train"], "readings": {"ce_views": "sum"}}})
    states = {}
    for name, cfg in (("base", base), ("summed", summed)):
        for method in ("fedavg_peft", "past_v2"):
            train(prepared, method, tmp_path / name / method, cfg=cfg)
            ckpt = torch.load(tmp_path / name / method / "checkpoint.pt", map_location="cpu", weights_only=False)
            states[(name, method)] = ckpt["members"]["global"]
    same = states[("base", "fedavg_peft")], states[("summed", "fedavg_peft")]
    assert all(torch.equal(same[0][k], same[1][k]) for k in same[0])
    moved = states[("base", "past_v2")], states[("summed", "past_v2")]
    assert not all(torch.equal(moved[0][k], moved[1][k]) for k in moved[0])


def _write(path: Path, y: np.ndarray, pred: np.ndarray, ids: list[str]) -> str:
    probs = np.full((len(y), 3), 0.1)
    probs[np.arange(len(y)), pred] = 0.8
    write_predictions(path, [{"sample_id": i, "label": CLASSES[t], **dict(zip(PROB_COLUMNS, p, strict=True)),
                              "pred": CLASSES[int(p.argmax())], "cohort": "external", "client": "",
                              "differentiation": "", "magnification": "", "run_status": "ok", "model": "global"}
                             for i, t, p in zip(ids, y, probs, strict=True)])
    return str(path)


def test_verdicts_flag_a_reading_that_flips_or_blurs_a_conclusion(tmp_path):
    readings = {"keeps": {"train.readings.ce_views": "sum"}, "flips": {"train.readings.ce_reduction": "weighted_mean"}}
    cfg = load_config({"experiments": {"resamples": 300, "sensitivity": {
        "encoders": ["stain_invariant"], "readings": readings, "conclusions": [["past_v2", "fedavg_peft"]]}}})
    n = 90
    ids = [f"{k:016x}" for k in range(n)]
    y = np.tile(np.arange(3), n // 3)
    rng = np.random.default_rng(0)

    def acc(a):
        return np.where(rng.random(n) < a, y, (y + 1) % 3)
    quality = {("baseline", "past_v2"): 0.95, ("baseline", "fedavg_peft"): 0.6,
               ("keeps", "past_v2"): 0.93, ("keeps", "fedavg_peft"): 0.6,
               ("flips", "past_v2"): 0.55, ("flips", "fedavg_peft"): 0.9}
    runs = [("stain_invariant", r, m, 11, _write(tmp_path / f"{r}_{m}.csv", y, acc(a), ids))
            for (r, m), a in quality.items()]
    out = summarise_sensitivity(runs, None, cfg, tmp_path / "out")
    by = {r["reading"]: r for r in out["cells"]}
    assert by["baseline"]["survives"] and by["baseline"]["excludes_zero"] and by["baseline"]["difference"] > 0
    assert by["keeps"]["survives"]
    assert by["baseline"]["method_macro_f1"] - by["baseline"]["reference_macro_f1"] == pytest.approx(
        by["baseline"]["difference"])
    assert not by["flips"]["survives"] and not by["flips"]["keeps_sign"]
    (verdict,) = out["verdicts"]
    assert verdict["survives_every_reading"] is False and verdict["broken_by"] == "flips"
    rows = list(csv.DictReader((tmp_path / "out" / "verdicts.csv").open()))
    assert rows[0]["broken_by"] == "flips"
    assert (tmp_path / "out" / "sensitivity.png").stat().st_size > 0


def test_a_sensitivity_severity_outside_the_dose_response_is_refused_at_load():
    from fedhisto.config.study import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"experiments.sensitivity.severity 1.5 is not one of "
                                          r"experiments.dose_response.severities \[0.0, 1.0\]"):
        load_config({"experiments": {"dose_response": {"severities": [0.0, 1.0]}, "sensitivity": {"severity": 1.5}}})
    # unset, it is the largest dose-response severity, resolved at load (never a default the cohort lacks)
    assert load_config({"experiments": {"dose_response": {"severities": [0.0, 1.0]}}}).experiments.sensitivity.severity == 1.0
    assert load_config({}).experiments.sensitivity.severity == 2.0
    assert load_config({"experiments": {"dose_response": {"severities": [0.0, 1.0]},
                                        "sensitivity": {"severity": 1.0}}}).experiments.sensitivity.severity == 1.0
