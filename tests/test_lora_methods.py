"""The federated-LoRA aggregator methods (methods.lora_aggregation) train on the tests' tiny cohort:
FFA-LoRA never moves A (in both engines), FedSA-LoRA keeps one model per site that shares all but B
and is scored on its own holdout, FlexLoRA trains a rank-1 site exactly at rank 1, aggregators that
cannot take a rank per site refuse it by name, and Table 8 counts each one's messages."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from conftest import train

from fedhisto.accounting.stage import communication_table
from fedhisto.config.study import load_config
from fedhisto.methods import build_method
from fedhisto.methods.base import GLOBAL


def checkpoint(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)


def tiny(prepared, **train_block):
    return prepared["cfg"].model_copy(update={"train": prepared["cfg"].train.model_copy(update={"max_rounds": 2,
                                                                                                **train_block})})


def initial_state(cfg, method: str) -> dict:
    """The trainable state a run starts from (the model as the stage builds it for seed 11)."""
    from fedhisto.model.build import build_model

    return build_model(cfg, build_method(method, cfg), 11, None).trainable_state()


@pytest.mark.parametrize("engine", ["batched", "sequential"])
def test_ffa_lora_keeps_a_bitwise_at_its_initialisation_and_trains_b(prepared: dict, tmp_path: Path, engine: str):
    cfg = tiny(prepared, engine=engine)
    train(prepared, "ffa_lora", tmp_path / "ffa", cfg=cfg)
    train(prepared, "fedavg_peft", tmp_path / "fedavg", cfg=cfg)
    got, base = checkpoint(tmp_path / "ffa")["members"][GLOBAL], checkpoint(tmp_path / "fedavg")["members"][GLOBAL]
    init = initial_state(cfg, "ffa_lora")
    a_keys, b_keys = [k for k in got if ".lora_A." in k], [k for k in got if ".lora_B." in k]
    assert a_keys and b_keys
    assert all(torch.equal(got[k], init[k]) for k in a_keys)      # A never moved, bitwise
    assert all(not torch.equal(base[k], init[k]) for k in a_keys)  # where fedavg_peft moves it
    assert all(got[k].abs().max() > 0 and init[k].abs().max() == 0 for k in b_keys)  # B trained from zero


def test_fedsa_lora_keeps_one_model_per_site_sharing_all_but_b_and_scores_its_own_holdout(prepared: dict,
                                                                                         tmp_path: Path):
    from fedhisto.predict.stage import run_predict

    out = tmp_path / "fedsa"
    train(prepared, "fedsa_lora", out, cfg=tiny(prepared))
    members = checkpoint(out)["members"]
    assert sorted(members) == ["C1", "C2", "C3", "C4", "C5"]
    c1, c2 = members["C1"], members["C2"]
    for k in c1:
        if ".lora_B." in k:
            assert not torch.equal(c1[k], c2[k]), f"{k}: B is each site's own"
        else:
            assert torch.equal(c1[k], c2[k]), f"{k}: everything but B is shared"
    pred = tmp_path / "pred"
    run_predict("fedsa_lora", 11, out, prepared["manifest"], prepared["identity"], prepared["descriptors"],
                prepared["cfg"], pred)
    with (pred / "holdout.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert rows and all(r["model"] == r["client"] for r in rows)  # each site's model on its own holdout only
    with (pred / "test.csv").open() as fh:
        assert {r["model"] for r in csv.DictReader(fh)} == set(members)  # every site's model on the global test


def test_flexlora_trains_a_rank_one_site_at_rank_one(prepared: dict, tmp_path: Path):
    """C1 at rank 1 in a rank-8 model: it starts from the aggregate's leading direction and its local
    training keeps every other direction exactly zero (zero factors get zero gradients)."""
    from fedhisto.data.splits import load_partitions
    from fedhisto.train.local import local_train

    doc = prepared["cfg"].model_dump(mode="json")
    doc["train"].update(max_rounds=2, lora_aggregation={"site_ranks": [["C1", 1]]})
    cfg = load_config(doc)
    method = build_method("flexlora", cfg)
    assert method.site_ranks == {"C1": 1}
    out = tmp_path / "flex"
    train(prepared, "flexlora", out, cfg=cfg)
    glob = checkpoint(out)["members"][GLOBAL]
    start = method.start_state({GLOBAL: glob}, "C1")
    assert method.start_state({GLOBAL: glob}, "C2") is glob  # a site at the model's rank gets the aggregate
    from fedhisto.model.build import build_model

    model = build_model(cfg, method, 11, None)
    data = load_partitions(prepared["manifest"], cfg.views.crop_size, splits=("optimisation",))["C1"]
    result = local_train(method.objective, model, start, data, None, {}, cfg, 11, 2, 0, torch.device("cpu"))
    for k, v in result.state.items():
        if ".lora_A." in k:
            assert v[1:].abs().max() == 0 and not torch.equal(v[:1], start[k][:1]), k
        if ".lora_B." in k:
            assert v[:, 1:].abs().max() == 0 and v[:, :1].abs().max() > 0, k


@pytest.mark.parametrize("name", ["factor_mean", "ffa_lora", "fedsa_lora"])
def test_a_rank_per_site_is_refused_by_name_where_the_aggregator_cannot_take_it(name: str):
    cfg = load_config({"train": {"lora_aggregation": {"site_ranks": [["C1", 4]]}}})
    with pytest.raises(ValueError, match=f"method '{name}' \\({name}\\) cannot aggregate a LoRA rank per site"):
        build_method(name, cfg)


def test_site_ranks_name_a_bad_client_or_rank():
    with pytest.raises(ValueError, match="unknown client 'C9'"):
        build_method("flexlora", load_config({"train": {"lora_aggregation": {"site_ranks": [["C9", 4]]}}}))
    with pytest.raises(ValueError, match=r"C1 rank 9 is outside 1\.\.model\.lora_r=8"):
        build_method("flexlora", load_config({"train": {"lora_aggregation": {"site_ranks": [["C1", 9]]}}}))


def test_table_8_counts_each_aggregators_messages_from_the_real_tensors():
    cfg = load_config({"train": {"methods": ["fedavg_peft", "factor_mean", "flexlora", "ffa_lora", "fedsa_lora"]}})
    rows = {r["method"]: r for r in communication_table(cfg, encoder="hibou-b")}
    mib = 2**20
    lora_a = lora_b = 48 * 8 * 768 * 4  # the study's 48 modules, r 8, 768 wide: A and B the same size
    full = float(rows["fedavg_peft"]["model_per_round_mib"])
    assert float(rows["factor_mean"]["model_per_round_mib"]) == full
    assert float(rows["flexlora"]["model_per_round_mib"]) == full  # equal ranks: delta-SVD's traffic
    assert float(rows["ffa_lora"]["model_per_round_mib"]) == pytest.approx(full - 2 * 5 * lora_a / mib, abs=1e-6)
    assert float(rows["fedsa_lora"]["model_per_round_mib"]) == pytest.approx(full - 2 * 5 * lora_b / mib, abs=1e-6)
    het = load_config({"train": {"methods": ["fedavg_peft", "flexlora"],
                                 "lora_aggregation": {"site_ranks": [["C1", 4], ["C2", 2]]}}})
    got = {r["method"]: r for r in communication_table(het, encoder="hibou-b")}
    saved = 2 * (lora_a + lora_b) * (4 / 8 + 6 / 8)  # C1 sends half its factors' columns, C2 a quarter
    assert float(got["flexlora"]["model_per_round_mib"]) == pytest.approx(full - saved / mib, abs=1e-6)


def test_the_flower_engine_refuses_a_method_with_one_model_per_site_by_name():
    pytest.importorskip("flwr")
    from fedhisto.federation.server import check_federable

    with pytest.raises(ValueError, match="method 'fedsa_lora' is not a federated method with one global model"):
        check_federable(build_method("fedsa_lora", load_config({})), ["C1", "C2"])


def test_tables_say_how_a_method_with_one_model_per_site_is_scored(tmp_path: Path):
    from fedhisto.report.stage import model_notes
    from fedhisto.stats.prediction_files import write_predictions

    def rows(models, clients, cohort):
        return [{"sample_id": f"{c}{m}", "label": "ACA", "p_ACA": "1", "p_Normal": "0", "p_SCC": "0", "pred": "ACA",
                 "cohort": cohort, "client": c, "differentiation": "", "magnification": "", "run_status": "finalised",
                 "model": m} for m in models for c in clients]

    files = {}
    for method, own in (("fedsa_lora", True), ("local_only", False), ("fedavg_peft", None)):
        folder = tmp_path / method
        models = ["global"] if own is None else ["C1", "C2"]
        write_predictions(folder / "external.csv", rows(models, ["EXT"], "external"))
        write_predictions(folder / "holdout.csv", [r for r in rows(models, ["C1", "C2"], "holdout")
                                                   if not own or r["model"] == r["client"]])
        files[method] = [str(folder / "external.csv")]
    notes = model_notes(files)
    assert len(notes) == 2  # the single-model method gets none
    assert notes[0].startswith("fedsa_lora: 2 models per run, one per site (C1, C2)")
    assert notes[0].endswith("that site's own model only") and notes[1].endswith("every site's model")


@pytest.mark.parametrize("name", ["ffa_lora", "past_v2"])
def test_ffa_lora_checks_every_returned_a_against_the_broadcast_a0(name: str):
    """A change of A made identically at every site (so every returned A agrees with client 0's) is still a
    trained A: the server compares each returned A with the A_0 it broadcast (the round's start)."""
    from types import SimpleNamespace

    from fedhisto.methods.base import RoundUpdate

    cfg = load_config({"model": {"lora_r": 2}, "train": {"past": {"lora_aggregator": "ffa_lora"}}})
    method = build_method(name, cfg)
    g = torch.Generator().manual_seed(3)
    key = "encoder.layer.0.attention.query"
    a0, b0 = torch.randn(2, 4, generator=g), torch.zeros(3, 2)
    start = {f"{key}.lora_A.default.weight": a0, f"{key}.lora_B.default.weight": b0, "head": torch.zeros(2)}
    moved = a0 + 0.1  # the same change at both sites
    states = {n: {**start, f"{key}.lora_A.default.weight": moved, f"{key}.lora_B.default.weight": torch.randn(
        3, 2, generator=g)} for n in ("C1", "C2")}
    update = RoundUpdate(0, states, dict.fromkeys(states, start), {"C1": 5, "C2": 5}, {"C1": 1, "C2": 1},
                         {"C1": 0.5, "C2": 0.5}, None)
    model = SimpleNamespace(lora_scaling=1.0, named_parameters=lambda: iter(()))
    with pytest.raises(ValueError, match=r"ffa_lora: client C1's .*lora_A.* differs from the broadcast A_0"):
        method.aggregate_train(update, model)
    same = {n: {**s, f"{key}.lora_A.default.weight": a0.clone()} for n, s in states.items()}
    merged, _ = method.aggregate_train(RoundUpdate(0, same, update.starts, update.counts, update.steps,
                                                   update.weights, None), model)
    assert torch.equal(merged[GLOBAL][f"{key}.lora_A.default.weight"], a0)
