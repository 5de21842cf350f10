"""``train.past.lora_aggregator``: the PAST family (FedAvg-PEFT .. v2) under another server LoRA aggregator.
The default (delta_svd) leaves every run identity as it was; an aggregator that keeps one model per site
is refused by name; v2 trains under FedEx-LoRA's fold and FFA-LoRA's frozen A; Table 8 follows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import train

from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import load_config
from fedhisto.fedmath.lora_aggregators.fold import split_folded
from fedhisto.infra.provenance import config_hash
from fedhisto.methods import build_method
from fedhisto.methods.base import GLOBAL, RoundUpdate


def with_aggregator(cfg, name: str, **train_block):
    doc = cfg.model_dump(mode="json")
    doc["train"].update(max_rounds=2, past={"lora_aggregator": name}, **train_block)
    return load_config(doc)


def test_the_default_aggregator_leaves_every_identity_as_it_was():
    default = load_config({})
    block = stage_block(default, "train", method="past_v2", seed=11)
    assert "lora_aggregator" not in block["train"]["past"]
    other = with_aggregator(default, "factor_mean")
    assert config_hash(stage_block(other, "train", method="past_v2", seed=11)) != config_hash(block)
    assert build_method("fedavg_peft", default).lora_aggregator is None  # the study's delta-SVD code path


@pytest.mark.parametrize("method", ["fedavg_peft", "past_v2"])
def test_an_aggregator_with_one_model_per_site_is_refused_by_name(method: str):
    with pytest.raises(ValueError, match=f"train.past.lora_aggregator: fedsa_lora cannot aggregate method '{method}'"):
        build_method(method, with_aggregator(load_config({}), "fedsa_lora"))


def test_v2_under_factor_mean_averages_the_factors():
    from fedhisto.model.build import build_model

    cfg = with_aggregator(load_config({"model": {"encoder": {"name": "tiny", "require_pretrained": False}}}),
                          "factor_mean")
    method = build_method("past_v2", cfg)
    model = build_model(cfg, method, 11, None)
    init = model.trainable_state()
    gen = torch.Generator().manual_seed(1)
    states = {n: {k: v + torch.randn(v.shape, generator=gen) for k, v in init.items()} for n in ("C1", "C2")}
    weights = {"C1": 0.25, "C2": 0.75}
    update = RoundUpdate(0, states, dict.fromkeys(states, init), {"C1": 1, "C2": 3}, {"C1": 1, "C2": 1}, weights,
                         None)
    got = method.aggregate_train(update, model)[0][GLOBAL]
    for k in init:
        assert torch.allclose(got[k], 0.25 * states["C1"][k] + 0.75 * states["C2"][k], atol=1e-6), k


def test_v2_trains_under_fedex_loras_fold_and_ffa_loras_frozen_a(prepared: dict, tmp_path: Path):
    from fedhisto.model.build import build_model

    fedex = with_aggregator(prepared["cfg"], "fedex_lora", engine="sequential")
    train(prepared, "past_v2", tmp_path / "fedex", cfg=fedex)
    state = torch.load(tmp_path / "fedex/checkpoint.pt", weights_only=False)["members"][GLOBAL]
    _, folded = split_folded(state)
    assert folded and all(t.abs().max() > 0 for t in folded.values())

    ffa = with_aggregator(prepared["cfg"], "ffa_lora", engine="batched")
    train(prepared, "past_v2", tmp_path / "ffa", cfg=ffa)
    got = torch.load(tmp_path / "ffa/checkpoint.pt", weights_only=False)["members"][GLOBAL]
    init = build_model(ffa, build_method("past_v2", ffa), 11, None).trainable_state()
    a_keys = [k for k in got if ".lora_A." in k]
    assert a_keys and all(torch.equal(got[k], init[k]) for k in a_keys)
    assert all(got[k].abs().max() > 0 for k in got if ".lora_B." in k)


def test_table_8_follows_the_aggregator():
    from fedhisto.accounting.stage import communication_table

    methods = {"train": {"methods": ["fedavg_peft", "ffa_lora", "fedex_lora"]}}
    base = {r["method"]: r for r in communication_table(load_config(methods), encoder="hibou-b")}
    for name in ("ffa_lora", "fedex_lora"):
        doc = {"train": {**methods["train"], "past": {"lora_aggregator": name}}}
        rows = {r["method"]: r for r in communication_table(load_config(doc), encoder="hibou-b")}
        assert rows["fedavg_peft"]["model_per_round_mib"] == base[name]["model_per_round_mib"], name
