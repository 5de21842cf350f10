"""FedEx-LoRA as a trained method (``fedex_lora``): the fold W0' = W0 + R is exact in float64 through the
method's own aggregate and the model's load, the run trains in both engines with the dense offsets in its
member state, Table 8 counts them from the real tensors, and the checkpoint goes through predict, export
and classify with the offsets (a safetensors file beside the adapters)."""

from __future__ import annotations

import copy
import csv
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import TINY, train

from fedhisto.config.study import load_config
from fedhisto.fedmath.lora_aggregators.fold import FOLDED, base_weight, folded_key, split_folded
from fedhisto.methods import build_method
from fedhisto.methods.base import GLOBAL, RoundUpdate


def tiny(prepared, **train_block):
    return prepared["cfg"].model_copy(update={"train": prepared["cfg"].train.model_copy(update={"max_rounds": 2,
                                                                                                **train_block})})


def checkpoint(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)


def effective_weights(model, state: dict) -> dict[str, torch.Tensor]:
    """Per LoRA pair: what the loaded model's module computes, W_base + s B A (float64)."""
    model.load_trainable_state(state)
    params = dict(model.named_parameters())
    return {a: params[base_weight(a)].double() + model.lora_scaling * params[a.replace("lora_A", "lora_B")].double()
            @ params[a].double() for a in params if ".lora_A." in a}


@pytest.mark.parametrize("method_name, past", [("fedex_lora", False), ("fedavg_peft", True)])
def test_the_fold_is_exact_in_float64_through_the_methods_aggregate_and_the_models_load(prepared: dict,
                                                                                       method_name: str, past: bool):
    """W0' + s B' A' equals sum_k a_k (W0 + s B_k A_k) to 1e-12, where W0 already carries an earlier fold;
    the other tensors are the weighted mean; a state without offsets is the pristine encoder again. The
    same for FedAvg-PEFT under ``train.past.lora_aggregator: fedex_lora``."""
    from fedhisto.model.build import build_model

    doc = prepared["cfg"].model_dump(mode="json")
    if past:
        doc["train"]["past"] = {"lora_aggregator": "fedex_lora"}
    cfg = load_config(doc)
    method = build_method(method_name, cfg)
    model = build_model(cfg, method, 11, None).double()
    pristine = {k: v.clone() for k, v in model.named_parameters() if k.endswith(".base_layer.weight")}
    gen = torch.Generator().manual_seed(0)
    init = model.trainable_state()
    a_keys = [k for k in init if ".lora_A." in k]
    assert a_keys
    start = {**init, **{folded_key(a): 0.01 * torch.randn(pristine[base_weight(a)].shape, generator=gen,
                                                           dtype=torch.float64) for a in a_keys}}
    names = ["C1", "C2", "C3"]
    states = {n: {k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in init.items()}
              for n in names}
    weights = dict(zip(names, [0.5, 0.3, 0.2], strict=True))
    update = RoundUpdate(0, states, dict.fromkeys(names, start), dict.fromkeys(names, 10), dict.fromkeys(names, 1),
                         weights, None)
    new = method.aggregate_train(update, model)[0][GLOBAL]

    before = {n: effective_weights(model, {**start, **states[n]}) for n in names}
    after = effective_weights(model, new)
    for a in a_keys:
        want = sum(weights[n] * before[n][a] for n in names)
        assert (after[a] - want).abs().max() < 1e-12, a
        assert new[folded_key(a)].dtype == torch.float64
    trainable, folded = split_folded(new)
    assert set(folded) == {base_weight(a) for a in a_keys}
    for k in trainable:
        if ".lora_" not in k:
            assert torch.allclose(trainable[k], sum(weights[n] * states[n][k] for n in names), atol=1e-15, rtol=0)
    # and the factors are the factor mean (FedEx-LoRA sends the mean factors, the residual goes into W0)
    a0 = a_keys[0]
    assert torch.allclose(new[a0], sum(weights[n] * states[n][a0] for n in names), atol=1e-15, rtol=0)
    model.load_trainable_state(init)  # no offsets: the pristine frozen weights, bitwise
    params = dict(model.named_parameters())
    assert all(torch.equal(params[k], v) for k, v in pristine.items())


def test_a_folded_offset_that_fits_no_frozen_weight_is_refused_by_name(prepared: dict):
    from fedhisto.model.build import build_model

    model = build_model(prepared["cfg"], build_method("fedex_lora", prepared["cfg"]), 11, None)
    state = {**model.trainable_state(), FOLDED + "encoder.nowhere.base_layer.weight": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match=r"folded base delta 'encoder\.nowhere\.base_layer\.weight' .* fits no frozen"):
        model.load_trainable_state(state)


@pytest.mark.parametrize("engine", ["batched", "sequential"])
def test_fedex_lora_trains_with_its_offsets_in_the_member_state(prepared: dict, tmp_path: Path, engine: str):
    out = tmp_path / engine
    summary = train(prepared, "fedex_lora", out, cfg=tiny(prepared, engine=engine))
    assert summary["rounds"] == 2 and 0 <= summary["validation_macro_f1"] <= 1
    ckpt = checkpoint(out)
    state = ckpt["members"][GLOBAL]
    trainable, folded = split_folded(state)
    a_keys = [k for k in trainable if ".lora_A." in k]
    assert a_keys and set(folded) == {base_weight(a) for a in a_keys}
    assert all(torch.isfinite(t).all() and t.abs().max() > 0 for t in folded.values())
    assert set(split_folded(ckpt["best"]["members"][GLOBAL])[1]) == set(folded)


def test_table_8_counts_the_dense_offsets_from_the_real_tensors(prepared: dict, tmp_path: Path):
    """Down: the start state with its offsets; up: the trainable state only. From the run's real tensors,
    and in the accounting table (HIBOU-B: 48 modules of 768 x 768 floats to each of five sites)."""
    from fedhisto.accounting.stage import communication_table

    out = tmp_path / "fedex"
    train(prepared, "fedex_lora", out, cfg=tiny(prepared, engine="sequential"))
    state = checkpoint(out)["members"][GLOBAL]
    trainable, folded = split_folded(state)
    nbytes = {k: sum(t.numel() * t.element_size() for t in part.values())
              for k, part in (("trainable", trainable), ("folded", folded))}
    m = build_method("fedex_lora", prepared["cfg"])
    assert m.model_bytes(state, ["C1", "C2"]) == 2 * (2 * nbytes["trainable"] + nbytes["folded"])
    cfg = load_config({"train": {"methods": ["fedavg_peft", "fedex_lora"]}})
    rows = {r["method"]: r for r in communication_table(cfg, encoder="hibou-b")}
    dense = 5 * 48 * 768 * 768 * 4 / 2**20
    assert float(rows["fedex_lora"]["model_per_round_mib"]) == pytest.approx(
        float(rows["fedavg_peft"]["model_per_round_mib"]) + dense, abs=1e-6)


def test_a_rank_per_site_is_refused_by_fedex_lora_by_name():
    cfg = load_config({"train": {"lora_aggregation": {"site_ranks": [["C1", 4]]}}})
    with pytest.raises(ValueError, match="method 'fedex_lora' \\(fedex_lora\\) cannot aggregate a LoRA rank per site"):
        build_method("fedex_lora", cfg)


def test_the_checkpoint_goes_through_predict_export_and_classify_with_its_offsets(prepared, tmp_path):
    """predict scores the run's model with its folded offsets (not the pristine encoder); the package
    stores them as folded_base.safetensors beside the adapters (no pickle) and classify reproduces predict."""
    from fedhisto.cli import main
    from fedhisto.data.splits import load_partitions
    from fedhisto.export.package import load_package
    from fedhisto.export.stage import run_export
    from fedhisto.model.build import build_model
    from fedhisto.predict.stage import run_predict_seeds
    from fedhisto.train.inference import predict

    doc = copy.deepcopy(TINY)
    doc["train"].update(seeds=[11], ablation_seeds=[11], comparator_seeds=[11], max_rounds=2, engine="sequential")
    cfg = load_config(doc)
    work = tmp_path / "work"
    (work / "config").mkdir(parents=True)
    (work / "config/config.yaml").write_text(yaml.safe_dump(doc))
    results = work / "results"
    runs, preds = results / "train/fedex_lora", results / "predictions/fedex_lora"
    train(prepared, "fedex_lora", runs / "seed11", cfg=cfg)
    run_predict_seeds("fedex_lora", [(11, runs / "seed11", preds / "seed11")], prepared["manifest"],
                      prepared["identity"], prepared["descriptors"], cfg)
    best = checkpoint(runs / "seed11")["best"]["members"][GLOBAL]
    method = build_method("fedex_lora", cfg)
    model = build_model(cfg, method, 11, None)
    external = load_partitions(prepared["manifest"], cfg.views.crop_size, splits=("external",))["external"]
    cpu = torch.device("cpu")
    model.load_trainable_state(best)
    folded_probs = predict(model, external, None, cfg, cpu)
    model.load_trainable_state(split_folded(best)[0])
    pristine_probs = predict(model, external, None, cfg, cpu)
    assert (folded_probs - pristine_probs).abs().max() > 1e-4  # the offsets change the model
    with (preds / "seed11/external.csv").open() as fh:
        rows = {r["sample_id"]: r for r in csv.DictReader(fh)}
    got = np.array([[float(rows[i][c]) for c in ("p_ACA", "p_Normal", "p_SCC")] for i in external.ids])
    assert np.abs(got - folded_probs.numpy()).max() < 1e-6

    pkg = tmp_path / "pkg"
    run_export("fedex_lora", cfg, pkg, results / "train", results / "predictions", prepared["descriptors"],
               prepared["identity"])
    assert (pkg / "members/seed11/folded_base.safetensors").exists()
    loaded = load_package(pkg).members["seed11"]
    assert loaded.keys() == best.keys() and all(torch.equal(loaded[k], best[k]) for k in best)
    out = tmp_path / "classified.csv"
    assert main(["classify", "--model", str(pkg), "--images", str(prepared["images"] / "images/external"),
                 "--out", str(out), "--no-calibration", "--descriptor", "centroid"]) == 0
    with out.open() as fh:
        classified = list(csv.DictReader(fh))
    assert len(classified) == len(external.ids)
    with Path(prepared["manifest"]).open() as fh:
        by_path = {Path(r["path"]).name: r["sample_id"] for r in csv.DictReader(fh) if r["split"] == "external"}
    for r in classified:
        want = rows[by_path[Path(r["image"]).name]]
        assert max(abs(float(r[c]) - float(want[c])) for c in ("p_ACA", "p_Normal", "p_SCC")) < 1e-6, r["image"]


@pytest.mark.flower
def test_on_the_flower_message_path_the_offsets_travel_down_and_never_up(tmp_path: Path):
    """What the messages weigh: in round 2 each site's train message carries the start state with its
    dense offsets, its reply the trainable state only; the difference is the offsets' bytes per site, and
    the whole exchange is ``model_bytes`` of the real member state (Table 8's count)."""
    pytest.importorskip("flwr")
    import json

    from flower_support import SITES, LocalGrid, prepare

    from fedhisto.config.study import load_config_file
    from fedhisto.federation.server import FederatedRun
    from fedhisto.federation.server_app import GridExchange

    p = prepare(tmp_path / "cohort")
    identity = json.loads(Path(p["identity"]).read_text())["dataset_identity"]
    fed = FederatedRun(load_config_file(p["config"]), "fedex_lora", 11, SITES, tmp_path / "run", identity,
                       str(p["descriptors"]))
    nodes = {100 + k: {"site-id": s, "manifest": str(p["manifest"]), "descriptors": str(p["descriptors"])}
             for k, s in enumerate(SITES)}
    ex = GridExchange(LocalGrid(nodes, {}), SITES, 60, 5, {"method": "fedex_lora", "seed": 11, "config": fed.cfg_json})
    ckpt = fed.run(ex)
    first, second = (h["phases"]["train"] for h in ckpt["history"][:2])
    state = checkpoint(tmp_path / "run")["members"][GLOBAL]  # offsets of every module, as in round 2's start
    _, folded = split_folded(state)
    dense = sum(t.numel() * t.element_size() for t in folded.values())
    assert first["down_bytes"] == first["up_bytes"]  # round 1 starts from the pristine encoder
    assert second["down_bytes"] - second["up_bytes"] == len(SITES) * dense
    m = build_method("fedex_lora", load_config_file(p["config"]))
    assert second["down_bytes"] + second["up_bytes"] == m.model_bytes(state, SITES)
