"""The LoRA-aggregation experiment's arms and summary on the tests' tiny cohort: each arm records the
aggregate's spectrum and the round's traffic from the real tensors, and the summary pairs every
aggregator with delta-SVD on the same images."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from fedhisto.experiments.lora_aggregation import (
    LoraAggregationSettings,
    arm_dir,
    arms,
    summarise_lora_aggregation,
)
from fedhisto.experiments.lora_aggregation_runs import arm_config, train_arm, update_spectrum


def test_a_method_outside_the_past_family_is_refused_by_name():
    with pytest.raises(ValueError, match="'fedstain' is not a PAST-family method"):
        LoraAggregationSettings(methods=["fedavg_peft", "fedstain"])
    assert len(arms(LoraAggregationSettings())) == 2 * 5 * 2 * 3


def test_the_spectrum_of_a_rank_r_update_holds_all_its_energy_in_r_directions():
    import torch

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 6, generator=gen), torch.randn(5, 2, generator=gen)
    one = update_spectrum({"m.lora_A.default.weight": a, "m.lora_B.default.weight": b}, 2.0, 4)
    assert one["modules"] == 1 and len(one["energy_share"]) == 4
    assert one["energy_share"][1] == pytest.approx(1.0) and one["energy_share"][0] < 1.0
    assert 1.0 < one["effective_rank"] <= 2.0 + 1e-9
    folded = update_spectrum({"m.lora_A.default.weight": a, "m.lora_B.default.weight": b,
                              "folded_base.m.base_layer.weight": torch.randn(5, 6, generator=gen)}, 2.0, 4)
    assert folded["energy_share"][1] < 1.0 and folded["effective_rank"] > 2.0  # the offset is full rank


def test_arms_record_spectrum_and_traffic_and_the_summary_pairs_them_with_delta_svd(prepared: dict, tmp_path: Path):
    cfg = prepared["cfg"].model_copy(update={"train": prepared["cfg"].train.model_copy(update={"max_rounds": 2})})
    assert arm_config(cfg, "delta_svd", "fedavg_peft", 11).train.past.lora_aggregator == "delta_svd"
    runs = []
    for aggregator in ("delta_svd", "fedex_lora"):
        out = arm_dir(tmp_path, "main", aggregator, "fedavg_peft", 11)
        got = train_arm(cfg, aggregator, "fedavg_peft", 11, prepared["manifest"], prepared["identity"],
                        prepared["descriptors"], out)
        rows = json.loads(Path(got["rounds_json"]).read_text())["rounds"]
        assert [r["round"] for r in rows] == [1, 2]
        assert all(len(r["energy_share"]) == cfg.model.lora_r and 0 < r["energy_share"][0] <= 1 for r in rows)
        if aggregator == "delta_svd":  # rank-r aggregate: all energy within r directions; constant traffic
            assert all(r["energy_share"][-1] == pytest.approx(1.0) for r in rows)
            assert rows[0]["traffic_bytes"] == rows[1]["traffic_bytes"]
        else:  # the dense offsets travel from round 2 on
            assert rows[1]["traffic_bytes"] > rows[0]["traffic_bytes"]
        runs.append(("main", aggregator, "fedavg_peft", 11, got["external"], got["rounds_json"]))
    summary = summarise_lora_aggregation(runs, 200, 7, tmp_path / "summary")
    assert [d["aggregator"] for d in summary["paired_vs_delta_svd"]] == ["fedex_lora"]
    with (tmp_path / "summary/lora_aggregation.csv").open() as fh:
        cells = list(csv.DictReader(fh))
    assert {c["aggregator"] for c in cells} == {"delta_svd", "fedex_lora"}
    fedex = next(c for c in cells if c["aggregator"] == "fedex_lora")
    delta = next(c for c in cells if c["aggregator"] == "delta_svd")
    assert float(fedex["traffic_mib_per_round"]) > float(delta["traffic_mib_per_round"])
    assert (tmp_path / "summary/lora_aggregation.png").stat().st_size > 0


def test_the_experiment_is_one_registration_with_its_arms_and_summary():
    from fedhisto.config.study import load_config
    from fedhisto.registries.experiment_registry import experiment

    cfg = load_config({})
    steps = experiment("lora_aggregation").steps(cfg)
    assert [s.rule for s in steps] == ["train_lora_aggregation_arm", "summarize_lora_aggregation"]
    assert steps[-1].output["json"] == "results/experiments/lora_aggregation/lora_aggregation.json"
    assert len(steps[-1].inputs["arms"]) == 2 * 60  # rounds.json and external.csv of each of the 60 arms
    small = load_config({"experiments": {"lora_aggregation": {"encoders": ["main"], "aggregators": ["delta_svd",
                                                                                                  "ffa_lora"],
                                                              "seeds": [11]}}})
    assert len(experiment("lora_aggregation").steps(small)[-1].inputs["arms"]) == 2 * 4
