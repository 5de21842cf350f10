"""Methods as a registered strategy and objective: registry, a method defined here running through the real engine,
one round of every registered method, and the engine rules every method shares (CE normalisation,
run identity, prototype reliability)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, train

from fedhisto.config.study import ConfigError, load_config
from fedhisto.fedmath.prototypes import ClientPrototypes, aggregate_prototypes
from fedhisto.methods import build_method, method_names, register, registration, unregister, wildcard_pattern
from fedhisto.methods.base import balanced_cross_entropy
from fedhisto.methods.objective import Objective
from fedhisto.methods.strategy import Strategy

ONE_ROUND = {**TINY, "train": {**TINY["train"], "max_rounds": 1, "local_epochs": 1}}


class HeadNormObjective(Objective):
    """Its client half: FedAvg-PEFT's objective plus an L2 penalty on the classifier weights."""

    def extra_terms(self, run, batch, logits, zs):
        return {"head_l2": 1e-3 * run.params["classifier.weight"].pow(2).sum()}


class HeadNormPenalty(Strategy):
    """A method that exists only in this test (one strategy naming its objective, one registration): equal
    client weights instead of sample mass, and ``HeadNormObjective`` at the clients."""

    objective_class = HeadNormObjective

    def client_weights(self, counts, updates):
        return [1.0 / len(counts)] * len(counts)


@pytest.fixture
def test_method():
    register("head_norm_penalty", HeadNormPenalty)
    yield "head_norm_penalty"
    unregister("head_norm_penalty")


def history_rows(out: Path) -> list[dict]:
    with (out / "history.csv").open() as fh:
        return list(csv.DictReader(fh))


def test_a_method_defined_in_a_test_module_runs_through_the_real_engine(prepared, tmp_path, test_method):
    cfg = load_config({**ONE_ROUND, "train": {**ONE_ROUND["train"], "methods": [test_method]}})
    summary = train(prepared, test_method, tmp_path / "run", cfg=cfg)
    assert summary["rounds"] == 1 and 0 <= summary["validation_macro_f1"] <= 1
    (row,) = history_rows(tmp_path / "run")
    weights = json.loads(row["weights"])
    assert weights == pytest.approx(dict.fromkeys(weights, 0.2))  # its own weighting, not sample mass
    assert all(set(terms) == {"ce", "head_l2"} and terms["head_l2"] > 0 for terms in json.loads(row["losses"]).values())


def test_registry_names_config_and_wildcards():
    assert {"past_v2", "fedstain", "local_only", "pooled"} <= set(method_names())
    with pytest.raises(ValueError, match="registered already"):
        register("past_v2", HeadNormPenalty)
    with pytest.raises(ConfigError, match="unknown method 'nope'"):
        load_config({"train": {"methods": ["nope"]}})
    assert registration("past_v2").options["prototypes"] == "v2"
    import re

    pattern = re.compile(f"^(?:{wildcard_pattern()})$")
    assert pattern.match("v2_no_js") and not pattern.match("v2_no_js/seed11") and not pattern.match("past")


@pytest.mark.parametrize("method", method_names())
def test_one_round_of_every_registered_method(prepared, tmp_path, method):
    summary = train(prepared, method, tmp_path / method, cfg=load_config(ONE_ROUND))
    assert summary["rounds"] == 1 and 0 <= summary["validation_macro_f1"] <= 1
    ckpt = torch.load(tmp_path / method / "checkpoint.pt", map_location="cpu", weights_only=False)
    members = ckpt["best"]["members"]
    expected = ["C1", "C2", "C3", "C4", "C5"] if method in ("local_only", "fedsa_lora") else ["global"]  # one model per site
    assert sorted(members) == expected
    (row,) = history_rows(tmp_path / method)
    trained = set(json.loads(row["losses"]))
    assert trained == ({"pooled"} if method == "pooled" else {"C1", "C2", "C3", "C4", "C5"})
    if method == "local_only":  # every client trained alone: five different models
        heads = [members[c]["classifier.weight"] for c in expected]
        assert not any(torch.equal(heads[0], h) for h in heads[1:])


def test_parsing_the_workflow_config_imports_no_torch():
    code = ("import sys; from fedhisto.config.study import load_config; from fedhisto.config.stage_blocks import stage_block; "
            "from fedhisto.methods import wildcard_pattern, method_names; cfg = load_config({}); "
            "[stage_block(cfg, 'train', method=m, seed=11) for m in method_names()]; "
            "[stage_block(cfg, s) for s in ('cohort', 'clearance', 'manifest', 'stain', 'pretrain', 'metrics')]; "
            "wildcard_pattern(); print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_stain_stage_block_holds_the_split_seed_it_samples_with():
    from fedhisto.config.stage_blocks import stage_block

    a = load_config({})
    b = load_config({"manifest": {"split_seed": 7}})
    assert stage_block(a, "stain") != stage_block(b, "stain")


def test_training_identity_ignores_other_families_settings():
    from fedhisto.config.stage_blocks import stage_block

    base = load_config({})
    changed = load_config({"train": {"fedstain": {"weight_js": 0.5}}})
    assert stage_block(base, "train", method="past_v2", seed=11) == stage_block(changed, "train", method="past_v2",
                                                                                 seed=11)
    assert stage_block(base, "train", method="fedstain", seed=11) != stage_block(changed, "train", method="fedstain",
                                                                                  seed=11)


# ------------------------------------------------ class-balanced CE (issue 11 item 3)
def _grads(batches: list[tuple[torch.Tensor, torch.Tensor]], weights: torch.Tensor, nominal: int) -> torch.Tensor:
    torch.manual_seed(0)
    head = torch.nn.Linear(5, 3)
    for x, y in batches:
        (balanced_cross_entropy(head(x), y, weights, nominal) / len(batches)).backward()
    return torch.cat([head.weight.grad.flatten(), head.bias.grad])


def test_two_accumulated_micro_batches_of_four_equal_one_batch_of_eight():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 5, generator=g), torch.tensor([0, 0, 0, 0, 1, 1, 0, 2])
    w = torch.tensor([0.5, 2.0, 4.0])
    one = _grads([(x, y)], w, 8)
    two = _grads([(x[:4], y[:4]), (x[4:], y[4:])], w, 4)
    assert torch.allclose(one, two, atol=1e-7)  # float32 sums in a different order only


def test_a_majority_only_batch_keeps_its_weight_and_a_lone_minority_image_gets_its_own():
    logits, w = torch.zeros(4, 3), torch.tensor([0.5, 2.0, 4.0])
    ce = torch.log(torch.tensor(3.0))  # uniform logits: every image's CE is ln 3
    majority = balanced_cross_entropy(logits, torch.tensor([0, 0, 0, 0]), w, 4)
    assert majority == pytest.approx(0.5 * ce)  # F.cross_entropy(weight=w) would give ln 3: weights cancel
    lone = balanced_cross_entropy(logits, torch.tensor([0, 0, 0, 2]), w, 4)
    assert lone == pytest.approx((3 * 0.5 + 4.0) * ce / 4)


# ------------------------------------------------ run identity (issue 11 item 5)
def test_changed_descriptors_refuse_the_old_checkpoint(prepared, tmp_path):
    from fedhisto.train.stage import run_train

    cfg, out = load_config(ONE_ROUND), tmp_path / "past_v1"
    doc = json.loads(Path(prepared["descriptors"]).read_text())
    doc["clients"]["C1"]["standardised"][0] += 0.5
    changed = tmp_path / "descriptors.json"
    changed.write_text(json.dumps(doc))
    run_train("past_v1", 11, prepared["manifest"], prepared["identity"], prepared["descriptors"], cfg, out)
    old = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)["identity"]
    run_train("past_v1", 11, prepared["manifest"], prepared["identity"], changed, cfg, out)
    new = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)["identity"]
    assert list(out.glob("checkpoint.refused-*.pt")), "the stale checkpoint must not be resumed"
    assert old["descriptor_digest"] != new["descriptor_digest"] and old["config_hash"] == new["config_hash"]
    assert len(old["encoder_digest"]) == 64


# ------------------------------------------------ prototype reliability (issue 11 item 9)
def _upload(classes: dict[int, torch.Tensor], n: int = 100) -> ClientPrototypes:
    return ClientPrototypes({c: torch.nn.functional.normalize(v, dim=0) for c, v in classes.items()},
                            dict.fromkeys(classes, n))


def test_one_contributor_class_is_nearly_dropped_by_the_studys_formula_and_kept_by_the_bounded_variant():
    g = torch.Generator().manual_seed(0)
    centre = torch.randn(3, 768, generator=g)
    uploads = [_upload({0: centre[0] + 0.05 * torch.randn(768, generator=g),
                        1: centre[1] + 0.05 * torch.randn(768, generator=g)}) for _ in range(4)]
    uploads.append(_upload({0: centre[0], 2: centre[2]}))  # only this client holds class 2
    study = aggregate_prototypes(uploads, 3, 768).reliability
    assert study[2] < 0.01 and study[0] > 0.9 and study[1] > 0.9  # ~1e-3: class 2 drops out of the v2 term
    bounded = aggregate_prototypes(uploads, 3, 768, variant="bounded").reliability
    assert bounded[2] > 0.5 and bounded[:2].min() > 0.5 and bounded.mean() == pytest.approx(1.0, abs=1e-6)


def test_method_settings_come_from_the_family_block():
    cfg = load_config({"train": {"past": {"weight_js": 0.5}}})
    assert build_method("past_v2", cfg).settings.weight_js == 0.5
    assert build_method("fedstain", cfg).settings.upload_ratio == 0.1


# ------------------------------------------------ FedStain under its own paper's protocol (issue 11 item 8)
def test_fedstain_paper_protocol_switches_optimiser_epochs_batch_and_lr_schedule(prepared, tmp_path):
    from fedhisto.methods.base import LocalSchedule

    study = build_method("fedstain", load_config({}))
    assert study.objective.local_schedule(3) == LocalSchedule("adamw", 1e-4, 1e-4, 2, 8, 1, 5.0)  # the study's
    paper = build_method("fedstain", load_config({"train": {"max_rounds": 5, "fedstain": {"protocol": "paper"}}}))
    plan = paper.objective.local_schedule
    assert plan(0) == LocalSchedule("adam", 1e-4, 0.0, 3, 32, 1, 5.0)
    assert plan(4).lr == pytest.approx(2.5e-6) and plan(2).lr == pytest.approx(5.125e-5)
    cfg = load_config({**ONE_ROUND, "train": {**ONE_ROUND["train"],
                                              "fedstain": {"protocol": "paper", "paper_local_epochs": 1}}})
    train(prepared, "fedstain", tmp_path / "paper", cfg=cfg)
    (row,) = history_rows(tmp_path / "paper")
    assert all(set(t) == {"ce", "supcon", "js"} for t in json.loads(row["losses"]).values())


# ------------------------------------------------ comparators declare their papers' assumptions
def test_comparators_under_the_studys_adamw_are_marked_and_under_their_own_optimiser_are_not():
    """FedAdam's Algorithm 2 and FedStain's paper train their clients with SGD and Adam; under the study's
    AdamW protocol the report marks them, under FedStain's own protocol nothing is marked. The study's
    arms and the references declare nothing (their protocol is the study's)."""
    from fedhisto.caveats import method_caveats

    cfg = load_config({"train": {"methods": ["fedavg_peft", "past_v2", "fedadam", "fedstain", "fedstain_code",
                                             "local_only", "pooled", "scaffold"]}})
    marks = method_caveats(cfg)
    assert sorted(marks) == ["fedadam", "fedstain", "fedstain_code"]
    assert marks["fedadam"] == ["fedadam: local steps are adamw (lr 0.0001); Reddi et al. 2021 (Algorithm 2) assumes sgd"]
    assert marks["fedstain"] == ["fedstain: local steps are adamw (lr 0.0001); FedStain (its paper's Tables I-II and "
                                 "code) assumes adam"]
    paper = load_config({"train": {"methods": ["fedavg_peft", "past_v2", "fedstain"],
                                   "fedstain": {"protocol": "paper"}}})
    assert method_caveats(paper) == {}


@pytest.mark.parametrize("method", ["scaffold", "fedstain", "fedavg_peft"])
def test_the_report_names_the_local_optimiser_learning_rate_and_schedule_the_run_trained_with(prepared, tmp_path,
                                                                                              method):
    """SCAFFOLD trains with plain SGD at train.scaffold.local_lr (0.1), FedStain's paper protocol with Adam and a
    learning rate decayed linearly from 1e-4 to 2.5e-6 over the rounds, FedAvg-PEFT with the study's AdamW at
    train.lr: report.json says so, round by round, without reading the method's file."""
    raw = {**TINY, "train": {**TINY["train"], "max_rounds": 3, "local_epochs": 1, "patience": 10,
                             "fedstain": {"protocol": "paper", "paper_local_epochs": 1}}}
    cfg = load_config(raw)
    train(prepared, method, tmp_path / method, cfg=cfg)
    got = json.loads((tmp_path / method / "report.json").read_text())["local_schedule"]
    t = cfg.train
    expected = {"scaffold": ("sgd", [0.1, 0.1, 0.1], 0.0, None, 1),
                "fedstain": ("adam", [1e-4, (1e-4 + 2.5e-6) / 2, 2.5e-6], 0.0, t.grad_clip, 1),
                "fedavg_peft": ("adamw", [t.lr] * 3, t.weight_decay, t.grad_clip, t.local_epochs)}[method]
    assert (got["optimizer"], got["weight_decay"], got["grad_clip"], got["epochs"]) == (
        expected[0], expected[2], expected[3], expected[4])
    assert got["lr"] == pytest.approx(expected[1][0], rel=1e-12)
    assert got["lr_by_round"] == pytest.approx(expected[1], rel=1e-12)


def test_one_registration_builds_both_halves_and_refuses_an_option_neither_takes():
    """The strategy and the objective it names are built from the same registration; each option goes to the
    half whose constructor names it (PAST's switches split between them), and an unknown one is refused."""
    cfg = load_config({})
    v2 = build_method("past_v2", cfg)
    assert isinstance(v2, Strategy) and isinstance(v2.objective, Objective)
    assert (v2.film, v2.aggregation, v2.prototypes) == (True, "adaptive", "v2")
    assert (v2.objective.paired_views, v2.objective.js, v2.objective.prototypes) == (True, True, "v2")
    assert build_method("scaffold_adamw", cfg).objective.local_optimizer == "adamw"
    register("head_norm_typo", HeadNormPenalty, flim=True)
    try:
        with pytest.raises(TypeError, match=r"method 'head_norm_typo': unexpected options \['flim'\] \(neither "
                                            r"HeadNormPenalty nor HeadNormObjective takes them\)"):
            build_method("head_norm_typo", cfg)
    finally:
        unregister("head_norm_typo")
