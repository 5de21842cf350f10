"""The probe experiment: each dose-response encoder's stain sensitivity beside its v2-vs-FedAvg-PEFT gap."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from fedhisto.config.study import load_config
from fedhisto.experiments import probe as X
from fedhisto.experiments.probe import probe_condition, summarise_probe
from fedhisto.experiments.severity_render import run_render_shift
from fedhisto.model.encoder import random_encoder
from fedhisto.model.stain_probe import ProbeError

SMALL = {"cohort": {"synthetic": {"external_image_size": 64}}, "views": {"crop_size": 32},
         "model": {"encoder": {"name": "tiny"}},
         "experiments": {"resamples": 100, "dose_response": {"images_per_class": 5, "severities": [0.0, 1.0, 2.0]}}}


def test_probe_condition_measures_paired_stain_and_every_shift_on_the_same_tissues(tmp_path: Path):
    cfg = load_config(SMALL)
    run_render_shift(cfg, tmp_path / "cohort")
    torch.manual_seed(1)
    random_encoder("tiny").save(tmp_path / "enc")
    got = probe_condition(cfg, "stain_invariant", tmp_path / "cohort/cohort.csv", tmp_path / "probe",
                          encoder_dir=str(tmp_path / "enc"))
    assert got["tissues"] == 15
    assert [(m["measure"], m["severity"]) for m in got["measures"]] == [("paired_stain", 0.0), ("shift", 1.0),
                                                                         ("shift", 2.0)]
    for m in got["measures"]:
        assert m["images"] == 15 and m["resamples"] == 100
        assert m["ratio"]["ci_low"] <= m["ratio"]["estimate"] <= m["ratio"]["ci_high"]
    with (tmp_path / "probe/per_image.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 45
    shift2 = [r for r in rows if r["measure"] == "shift" and float(r["severity"]) == 2.0]
    hits = sum(int(r["hit_a_to_b"]) + int(r["hit_b_to_a"]) for r in shift2) / 30
    assert hits == pytest.approx(got["measures"][2]["retrieval_top1"]["estimate"])
    assert json.loads((tmp_path / "probe/probe.json").read_text())["provenance"]["inputs"].keys() == \
        {"cohort", "encoder"}
    # a cohort missing a tissue at one severity is refused, naming the file
    lines = (tmp_path / "cohort/cohort.csv").read_text().splitlines()
    (tmp_path / "short.csv").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(ProbeError, match=r"short\.csv: tissue .* has no image at severity"):
        probe_condition(cfg, "plain", tmp_path / "short.csv", tmp_path / "p2", encoder_dir=str(tmp_path / "enc"))


def _probe_json(path: Path, ratios: dict[float, float]) -> str:
    iv = lambda v: {"estimate": v, "ci_low": v - 0.01, "ci_high": v + 0.01}  # noqa: E731
    measures = [{"measure": "paired_stain" if s == 0 else "shift", "severity": s, "images": 15, "ratio": iv(r),
                 "retrieval_top1": iv(1 - r)} for s, r in ratios.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"measures": measures}))
    return str(path)


def _dose_json(path: Path, gaps: dict[tuple[str, float], float]) -> Path:
    path.write_text(json.dumps({"v2_vs_fedavg": [{"encoder": e, "severity": s, "difference": g, "ci_low": g - 0.02,
                                                  "ci_high": g + 0.02} for (e, s), g in gaps.items()]}))
    return path


@pytest.mark.parametrize("plain_gap, agree", [(0.057, True), (-0.01, False)])
def test_summary_puts_each_probe_beside_the_gap_and_says_whether_they_rank_alike(tmp_path: Path, plain_gap, agree):
    cfg = load_config(SMALL)
    probes = {"stain_invariant": _probe_json(tmp_path / "si.json", {0.0: 0.02, 1.0: 0.05, 2.0: 0.08}),
              "plain": _probe_json(tmp_path / "pl.json", {0.0: 0.30, 1.0: 0.40, 2.0: 0.50})}
    gaps = {("stain_invariant", 0.0): 0.0, ("stain_invariant", 1.0): 0.0, ("stain_invariant", 2.0): 0.006,
            ("plain", 0.0): 0.0, ("plain", 1.0): 0.017, ("plain", 2.0): plain_gap}
    got = summarise_probe(probes, _dose_json(tmp_path / "dose.json", gaps), cfg, tmp_path / "out")
    assert got["ranking"]["probe_order"] == ["plain", "stain_invariant"]
    assert got["ranking"]["agree"] is agree
    paired = {r["encoder"]: r for r in got["rows"] if r["measure"] == "paired_stain"}
    assert paired["plain"]["gap_severity"] == 2.0 and paired["plain"]["gap"] == plain_gap  # the largest severity
    shift1 = next(r for r in got["rows"] if r["encoder"] == "plain" and r["severity"] == 1.0)
    assert (shift1["ratio"], shift1["gap"]) == (0.40, 0.017)  # same severity
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"probe.csv", "probe.json", "probe.png"}
    del gaps[("plain", 1.0)]
    with pytest.raises(ProbeError, match=r"no v2-vs-FedAvg-PEFT difference for encoder 'plain' at severity 1\.0"):
        summarise_probe(probes, _dose_json(tmp_path / "dose2.json", gaps), cfg, tmp_path / "out2")


def test_probe_is_one_registered_experiment_with_a_probe_per_dose_response_encoder():
    from fedhisto.registries.experiment_registry import experiment, experiment_names

    cfg = load_config({})
    assert "probe" in experiment_names() and cfg.experiments.probe.seed == 5151
    assert set(X.probe_files(cfg)) == {"stain_invariant", "plain"}
    steps = {s.rule: s for s in experiment("probe").steps(cfg)}
    assert list(steps) == ["probe_encoder", "summarize_probe"]
    assert steps["probe_encoder"].wildcard_constraints == {"encoder": "stain_invariant|plain"}
    assert steps["summarize_probe"].inputs["probes"] == ["results/experiments/probe/stain_invariant/probe.json",
                                                         "results/experiments/probe/plain/probe.json"]
    with pytest.raises(Exception, match="seed"):
        load_config({"experiments": {"probe": {"seed": "x"}}})
