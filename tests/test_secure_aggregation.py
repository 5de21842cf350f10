"""Secure aggregation (issue 47), without Flower: every registered method declares what its server step needs
and a method without a declaration is caught; the masked-sum arithmetic keeps its bound; adaptive weights,
prototypes and every LoRA aggregator from sums equal the study's equations written afresh here; an
in-process secure round equals those equations on the sites' own states within the bound; DP-SGD runs
with it at the same epsilon; refusals name the method; the guides hold the generated table.
(Flower's SecAgg+ on stock processes: tests/test_flower_secure.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedhisto.config.study import ConfigError, load_config, load_config_file
from fedhisto.entry import study_config
from fedhisto.fedmath.secure_sums import Quantiser, field_sum, mean_bound

REPO = Path(__file__).resolve().parents[1]
SCALING, RANK = 2.0, 8  # the tiny config's lora_alpha / lora_r and lora_r


def secure_cfg(prepared: dict, methods: tuple[str, ...], rounds: int = 1, secure: bool = True, **settings):
    raw = json.loads(prepared["cfg"].model_dump_json())
    raw["train"].update(max_rounds=rounds, engine="sequential", methods=list(methods), ablations=[], ablation_seeds=[])
    raw["bootstrap"]["comparisons"] = {}
    if secure:
        raw["secure_aggregation"] = {"enabled": True, **settings}
    return study_config(raw)


def undeclared(names: list[str]) -> list[str]:
    """Registered methods whose strategy leaves ``Strategy.secure_aggregation`` as the base's (undeclared)."""
    from fedhisto.methods import build_method
    from fedhisto.methods.strategy import Strategy

    cfg = load_config({})
    return [n for n in names if type(build_method(n, cfg)).secure_aggregation is Strategy.secure_aggregation]


# ------------------------------------------------------------------ declarations
def test_every_registered_method_declares_secure_aggregation_in_its_own_class():
    from fedhisto.methods import build_method, method_names

    assert undeclared(method_names()) == []
    cfg = load_config({})
    for name in method_names():
        decl = build_method(name, cfg).secure_aggregation()
        if decl.runs and decl.exchanges:
            assert decl.summed and decl.learns and decl.masked_sums >= 1, name
        elif not decl.runs:
            assert decl.refusal and "declares nothing" not in decl.refusal, name


def test_server_hooks_live_on_the_strategy_and_site_hooks_on_the_objective():
    """What the server makes of the sums is the strategy's; what a site masks is its objective's: no
    method puts a server hook on its client half or a site hook on its server half."""
    from fedhisto.methods import build_method, method_names
    from fedhisto.methods.objective import Objective
    from fedhisto.methods.strategy import Strategy

    server = ("secure_aggregation", "aggregate_sums", "secure_weights", "aggregate_post_sums")
    site = ("secure_terms", "secure_statistic", "secure_post_terms")
    assert all(hasattr(Strategy, h) and not hasattr(Objective, h) for h in server)
    assert all(hasattr(Objective, h) and not hasattr(Strategy, h) for h in site)
    cfg = load_config({})
    for name in method_names():
        m = build_method(name, cfg)
        assert not [h for c in type(m).__mro__ for h in site if h in c.__dict__], name
        assert not [h for c in type(m.objective).__mro__ for h in server if h in c.__dict__], name


def test_a_method_registered_without_a_declaration_is_caught_and_refused_by_name():
    from fedhisto.methods import register, unregister

    register("undeclared_secure_test", "fedhisto.methods.strategy:Strategy")
    try:
        assert undeclared(["undeclared_secure_test"]) == ["undeclared_secure_test"]
        raw = {"train": {"methods": ["undeclared_secure_test"], "ablations": [], "ablation_seeds": []},
               "bootstrap": {"comparisons": {}}, "secure_aggregation": {"enabled": True}}
        with pytest.raises(ConfigError, match=r"undeclared_secure_test.*declares nothing"):
            study_config(raw)
    finally:
        unregister("undeclared_secure_test")


def test_refused_methods_are_named_with_what_the_coordinator_would_see_and_off_changes_no_identity():
    from fedhisto.config.stage_blocks import stage_block

    raw = {"train": {"methods": ["fedavg_peft", "scaffold", "fedstain"], "ablations": [], "ablation_seeds": []},
           "bootstrap": {"comparisons": {}}, "secure_aggregation": {"enabled": True}}
    with pytest.raises(ConfigError) as err:
        study_config(raw)
    assert "'scaffold' cannot run under secure aggregation" in str(err.value) and "c_i" in str(err.value)
    assert "'fedstain' cannot run" in str(err.value) and "'fedavg_peft'" not in str(err.value)
    off = load_config({})
    on = load_config({"secure_aggregation": {"enabled": True}})
    assert "secure_aggregation" not in stage_block(off, "train", method="fedavg_peft", seed=11)
    assert stage_block(on, "train", method="fedavg_peft", seed=11)["secure_aggregation"]["enabled"] is True


# ------------------------------------------------------------------ arithmetic
def test_quantised_sums_are_unbiased_and_within_k_steps_of_the_exact_sum():
    q = Quantiser(clip=1.0, levels=2 ** 12)  # coarse, so that the rounding is visible
    rng = np.random.default_rng(3)
    xs = [[rng.uniform(-0.9, 0.9, size=(50, 40))] for _ in range(5)]
    exact = sum(x[0] for x in xs)
    draws = [[rng.random((50, 40))] for _ in xs]
    got = field_sum(xs, q, draws)[0]
    assert np.abs(got - exact).max() < q.sum_bound(5)
    # written afresh: t = (x + c) L / 2c rounds to ceil(t), or down by one when the draw u < ceil(t) - t
    t = (xs[0][0] + 1.0) * 2 ** 11
    expected = np.ceil(t) - (draws[0][0] < np.ceil(t) - t)
    assert np.array_equal(q.quantise(xs[0][0], draws[0][0]), expected.astype(np.int64))
    mean_err = np.mean([field_sum(xs, q, [[rng.random((50, 40))] for _ in xs])[0] - exact for _ in range(30)], axis=0)
    assert np.abs(mean_err).mean() < 0.1 * q.sum_bound(5)  # unbiased: the mean error shrinks with repeats
    assert mean_bound(q, 5, 0.5) == pytest.approx(5 * 2 * 1.0 / 2 ** 12 / 0.5)
    with pytest.raises(ValueError, match="wrap"):
        Quantiser(8.0, 2 ** 30).check(5)


def eq4(counts: list[int], d: np.ndarray, floor: float = 0.03) -> np.ndarray:
    """Study eq. 4, written afresh: a~_k = n_k^0.5 exp(-(1 - cos(D_k, mean_{j!=k} D_j))) exp(-0.5 |ln(||D_k|| / median)|)."""
    norms = np.linalg.norm(d, axis=1)
    med = np.median(norms)
    raw = []
    for k in range(len(counts)):
        others = np.delete(d, k, axis=0).mean(0)
        cos = d[k] @ others / (norms[k] * np.linalg.norm(others))
        raw.append(counts[k] ** 0.5 * np.exp(-(1 - cos)) * np.exp(-0.5 * abs(np.log(norms[k] / med))))
    w = np.array(raw) / np.sum(raw)
    w = np.maximum(w, floor)
    return w / w.sum()


@pytest.mark.parametrize("k", [4, 5])
def test_adaptive_weights_from_the_masked_sum_and_stated_scalars_are_equation_4(k: int):
    from fedhisto.fedmath.weights import Adaptive

    rng = np.random.default_rng(k)
    d = rng.normal(size=(k, 60)) * rng.uniform(0.3, 3.0, size=(k, 1)) + rng.normal(size=60)
    counts = [31, 44, 17, 25, 60][:k]
    s = d.sum(0)
    got = Adaptive(0.03).from_statistics(counts, list((d ** 2).sum(1)), list(d @ s), float(s @ s), k)
    np.testing.assert_allclose(got, eq4(counts, d), rtol=1e-12)
    np.testing.assert_allclose(got, Adaptive(0.03)(counts, [torch.from_numpy(x) for x in d]), rtol=1e-12)


@pytest.mark.parametrize("variant", ["study", "bounded"])
def test_prototypes_from_summed_terms_are_the_study_formula(variant: str):
    from fedhisto.fedmath.prototypes import (
        ClientPrototypes,
        aggregate_prototypes,
        aggregate_prototypes_from_sums,
        prototype_terms,
    )

    rng = np.random.default_rng(7)
    dim, cap = 16, 256
    present = [(0, 1, 2), (0, 2), (0,), (0, 1)]  # class 1 at two sites, class 2 at two, class 0 at all four
    uploads = []
    for classes in present:
        cents = {c: F.normalize(torch.from_numpy(rng.normal(size=dim) + 3 * (c == 0)), dim=0).float() for c in classes}
        uploads.append(ClientPrototypes(cents, {c: int(rng.integers(5, 256)) for c in classes}))
    terms = [prototype_terms(u, 3, dim, cap) for u in uploads]
    sums = {k: sum(t[k] for t in terms) for k in terms[0]}
    got = aggregate_prototypes_from_sums(sums, 3, dim, cap, variant)
    # section 3.7 written afresh
    raw = np.zeros(3)
    for c in range(3):
        us = [(u.centroids[c].double().numpy(), u.counts[c]) for u in uploads if c in u.centroids]
        w = np.array([n ** 0.5 for _, n in us])
        p = (w[:, None] * np.stack([x for x, _ in us])).sum(0)
        p /= np.linalg.norm(p)
        np.testing.assert_allclose(got.centroids[c].double().numpy(), p, atol=1e-6)
        assert got.counts[c] == sum(n for _, n in us) and bool(got.mask[c])
        var = ((w / w.sum())[:, None] * (np.stack([x for x, _ in us]) - p) ** 2).sum(0).mean()
        raw[c] = (1 / max(var, 1e-4)) if variant == "study" else 1 / (1 + var * dim)
    rel = np.clip(raw / raw.mean(), 0, 3)
    np.testing.assert_allclose(got.reliability.numpy(), rel, rtol=1e-5)
    ref = aggregate_prototypes(uploads, 3, dim, variant)
    np.testing.assert_allclose(got.reliability.numpy(), ref.reliability.numpy(), rtol=1e-5)


def random_pair_states(k: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base = {"m.lora_A.default.weight": torch.randn(RANK, 24, generator=g) * 0.1,
            "m.lora_B.default.weight": torch.randn(20, RANK, generator=g) * 0.1,
            "head.weight": torch.randn(3, 24, generator=g) * 0.1}
    out = []
    for _ in range(k):
        out.append({n: (t + 0.05 * torch.randn(t.shape, generator=g)).float() for n, t in base.items()})
    return out


@pytest.mark.parametrize("name", ["delta_svd", "factor_mean", "flexlora", "fedex_lora", "ffa_lora"])
def test_every_lora_aggregator_from_masked_means_is_its_aggregate_of_the_sites(name: str):
    from fedhisto.fedmath.lora_aggregators import aggregate_means, aggregator, secure_state_terms
    from fedhisto.fedmath.secure_sums import dense

    agg = aggregator(name)
    states = random_pair_states(4)
    if name == "ffa_lora":  # A stays A_0 at every site
        for st in states[1:]:
            st["m.lora_A.default.weight"] = states[0]["m.lora_A.default.weight"].clone()
    w = [0.1, 0.2, 0.3, 0.4]
    terms = [secure_state_terms(agg, st, SCALING) for st in states]
    means = {k: sum(wk * dense(t[k]) for t, wk in zip(terms, w, strict=True)) for k in terms[0]}
    got, residuals = aggregate_means(agg, means.__getitem__, states[0], SCALING, RANK)
    # the weighted mean of the sites' models, written afresh
    product = sum(wk * SCALING * (st["m.lora_B.default.weight"].double() @ st["m.lora_A.default.weight"].double())
                  for st, wk in zip(states, w, strict=True))
    head = sum(wk * st["head.weight"].double() for st, wk in zip(states, w, strict=True))
    torch.testing.assert_close(got["head.weight"].double(), head, atol=1e-7, rtol=0)
    a, b = got["m.lora_A.default.weight"].double(), got["m.lora_B.default.weight"].double()
    if name in ("delta_svd", "flexlora"):  # Eckart-Young: the best rank-r approximation of the weighted product
        u, s, vh = torch.linalg.svd(product)
        torch.testing.assert_close(SCALING * b @ a, (u[:, :RANK] * s[:RANK]) @ vh[:RANK], atol=1e-6, rtol=0)
    elif name == "factor_mean":
        fa = sum(wk * st["m.lora_A.default.weight"].double() for st, wk in zip(states, w, strict=True))
        torch.testing.assert_close(a, fa, atol=1e-7, rtol=0)
    elif name == "fedex_lora":  # folded residual + s B' A' is the exact weighted product
        torch.testing.assert_close(residuals["m.lora_A.default.weight"] + SCALING * b @ a, product, atol=1e-6, rtol=0)
    else:
        assert torch.equal(got["m.lora_A.default.weight"], states[0]["m.lora_A.default.weight"])
        torch.testing.assert_close(SCALING * b @ a, product, atol=1e-6, rtol=0)


def test_fedadam_from_masked_means_is_its_step_on_the_sites_states(prepared: dict):
    from fedhisto.methods import build_method
    from fedhisto.methods.base import RoundUpdate
    from fedhisto.methods.secure_capability import SecureSums
    from fedhisto.model.build import build_model

    cfg = secure_cfg(prepared, ("fedadam",))
    m = build_method("fedadam", cfg)
    model = build_model(cfg, m, 11, None)
    start = model.trainable_state()
    g = torch.Generator().manual_seed(1)
    states = [{k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in start.items()} for _ in range(3)]
    w = {"C1": 0.2, "C2": 0.3, "C3": 0.5}
    names = sorted(w)
    plain, _ = m.aggregate_train(RoundUpdate(0, dict(zip(names, states, strict=True)), dict.fromkeys(names, start),
                                             dict.fromkeys(names, 1), dict.fromkeys(names, 1), w, None), model)
    from fedhisto.fedmath.secure_sums import dense

    terms = [m.objective.secure_terms(st, start, model.lora_scaling) for st in states]
    sums = {k: sum(w[n] * dense(t[k]) for n, t in zip(names, terms, strict=True)) for k in terms[0]}
    secure, state = m.aggregate_sums(SecureSums(0, sums, w, start, None), model)
    for k, v in plain["global"].items():
        if ".lora_" not in k:
            torch.testing.assert_close(secure["global"][k], v, atol=1e-6, rtol=0)
    assert state["t"] == 1


# ------------------------------------------------------------------ in-process rounds
def _plain_round(prepared, tmp_path, monkeypatch, method, cls) -> dict:
    """One round of ``method`` without secure aggregation, recording the sites' states, starts and counts its
    in-process aggregation (``cls.aggregate_train``) receives."""
    from conftest import train

    seen = []
    original = cls.aggregate_train

    def spy(self, update, model):
        seen.append({"states": {n: {k: v.clone() for k, v in s.items()} for n, s in update.states.items()},
                     "starts": update.starts, "counts": dict(update.counts)})
        return original(self, update, model)

    monkeypatch.setattr(cls, "aggregate_train", spy)
    train(prepared, method, tmp_path / "plain", secure_cfg(prepared, (method,), secure=False))
    monkeypatch.undo()
    return seen[0]


def _secure_global(prepared, method, tmp_path, **settings):
    from conftest import train

    ckpt_dir = tmp_path / f"{method}_secure"
    train(prepared, method, ckpt_dir, secure_cfg(prepared, (method,), **settings))
    return torch.load(ckpt_dir / "checkpoint.pt", map_location="cpu", weights_only=False)


def _assert_pairs_match(secure: dict, reference: dict, bound: float) -> None:
    """Each pair's s B A equals the rank-r truncation of ``reference[A key]`` (the weighted product), and
    every other tensor ``reference[key]``, within the quantisation bound plus float32's rounding."""
    for key, ref in reference.items():
        if ".lora_A." in key:
            b_key = key.replace("lora_A", "lora_B")
            u, s, vh = torch.linalg.svd(ref)
            want = (u[:, :RANK] * s[:RANK]) @ vh[:RANK]
            got = SCALING * secure[b_key].double() @ secure[key].double()
        else:
            want, got = ref, secure[key].double()
        tol = 4 * bound + 2e-7 * float(want.abs().max())
        assert float((got - want).abs().max()) <= tol, (key, float((got - want).abs().max()), tol)


def _reference(states: dict, weights: dict) -> dict:
    """The weighted mean of the sites' models, per pair the weighted s B_k A_k: the study's eq. 5 input."""
    names = sorted(states)
    out = {}
    for key in states[names[0]]:
        if ".lora_B." in key:
            continue
        if ".lora_A." in key:
            b_key = key.replace("lora_A", "lora_B")
            out[key] = sum(weights[n] * SCALING * (states[n][b_key].double() @ states[n][key].double()) for n in names)
        else:
            out[key] = sum(weights[n] * states[n][key].double() for n in names)
    return out


def test_an_in_process_secure_round_of_fedavg_peft_is_equation_5_on_the_sites_states(prepared, tmp_path, monkeypatch):

    from fedhisto.methods.past import PastFamily

    seen = _plain_round(prepared, tmp_path, monkeypatch, "fedavg_peft", PastFamily)
    ckpt = _secure_global(prepared, "fedavg_peft", tmp_path)
    states, counts = seen["states"], seen["counts"]
    weights = {n: counts[n] / sum(counts.values()) for n in counts}
    row = ckpt["history"][0]
    assert row["weights"] == pytest.approx(weights, abs=1e-15)
    bound = row["secure_aggregation"]["terms"]["bound"]
    assert bound == pytest.approx(5 * 16 / 2 ** 28)
    _assert_pairs_match(ckpt["members"]["global"], _reference(states, weights), bound)
    assert set(row["losses"]) == {"weighted_mean"}  # never a site's own losses


def test_an_in_process_secure_round_of_past_v2_is_equations_4_and_5_and_its_prototypes(prepared, tmp_path,
                                                                                         monkeypatch):

    from fedhisto.data.splits import load_partitions
    from fedhisto.methods import build_method
    from fedhisto.methods.past import PastFamily
    from fedhisto.model.build import build_model

    seen = _plain_round(prepared, tmp_path, monkeypatch, "past_v2", PastFamily)
    ckpt = _secure_global(prepared, "past_v2", tmp_path)
    states, starts, counts = seen["states"], seen["starts"], seen["counts"]
    names = sorted(states)
    d = np.stack([torch.cat([(states[n][k].double() - starts[n][k].double()).flatten() for k in sorted(starts[n])])
                  .numpy() for n in names])
    weights = dict(zip(names, eq4([counts[n] for n in names], d), strict=True))
    row = ckpt["history"][0]
    assert row["weights"] == pytest.approx(weights, abs=1e-7)  # from the quantised S
    _assert_pairs_match(ckpt["members"]["global"], _reference(states, row["weights"]),
                        row["secure_aggregation"]["terms"]["bound"])
    # prototypes: the sites' uploads under the secure global model, aggregated by section 3.7's formula
    cfg = secure_cfg(prepared, ("past_v2",))
    m = build_method("past_v2", cfg)
    model = build_model(cfg, m, 11, None)
    model.load_trainable_state(ckpt["members"]["global"])
    parts = load_partitions(prepared["manifest"], cfg.views.crop_size)
    desc = m.descriptors(json.loads(Path(prepared["descriptors"]).read_text()), names)
    uploads = [m.objective.upload_after_aggregation(model, parts[n], desc[n], torch.device("cpu")) for n in names]
    from fedhisto.fedmath.prototypes import aggregate_prototypes

    ref = aggregate_prototypes(uploads, 3, uploads[0].centroids[0].numel())
    got = ckpt["server_state"]
    torch.testing.assert_close(got["centroids"], ref.centroids, atol=1e-5, rtol=0)
    torch.testing.assert_close(got["reliability"], ref.reliability, atol=1e-3, rtol=1e-3)
    assert torch.equal(got["mask"], ref.mask) and torch.equal(got["counts"], ref.counts)


def test_an_in_process_secure_round_of_fedex_lora_folds_the_exact_weighted_product(prepared, tmp_path, monkeypatch):

    from fedhisto.fedmath.lora_aggregators.fold import folded_key
    from fedhisto.methods.lora_aggregated import LoraAggregated

    seen = _plain_round(prepared, tmp_path, monkeypatch, "fedex_lora", LoraAggregated)
    ckpt = _secure_global(prepared, "fedex_lora", tmp_path)
    states, counts = seen["states"], seen["counts"]
    weights = {n: counts[n] / sum(counts.values()) for n in counts}
    ref = _reference(states, weights)
    got = ckpt["members"]["global"]
    bound = ckpt["history"][0]["secure_aggregation"]["terms"]["bound"]
    for key, want in ref.items():
        if ".lora_A." in key:  # W0 + folded + s B' A' is the sites' weighted model (FedEx-LoRA's exactness)
            b_key = key.replace("lora_A", "lora_B")
            have = got[folded_key(key)].double() + SCALING * got[b_key].double() @ got[key].double()
        else:
            have = got[key].double()
        assert float((have - want).abs().max()) <= 4 * bound + 2e-7 * float(want.abs().max()), key


def test_dp_sgd_and_secure_aggregation_run_together_with_the_same_epsilon(prepared, tmp_path):
    from conftest import train

    privacy = {"enabled": True, "noise_multiplier": 1.1, "clip_norm": 0.5, "sample_rate": 0.25, "delta": 1e-4,
               "micro_batch": 6, "noise_seed": "run"}
    raw = json.loads(prepared["cfg"].model_dump_json())
    raw["train"].update(max_rounds=1, local_epochs=1, engine="sequential", methods=["fedavg_peft"], ablations=[],
                        ablation_seeds=[])
    raw["bootstrap"]["comparisons"] = {}
    raw["privacy"] = privacy
    plain = train(prepared, "fedavg_peft", tmp_path / "plain", study_config(raw))
    raw["secure_aggregation"] = {"enabled": True}
    secure = train(prepared, "fedavg_peft", tmp_path / "secure", study_config(raw))
    assert secure["privacy"]["epsilon"] == plain["privacy"]["epsilon"] and secure["privacy"]["epsilon_max"] > 0
    a, b = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=False) for d in ("plain", "secure"))
    bound = b["history"][0]["secure_aggregation"]["terms"]["bound"]
    for key, v in a["members"]["global"].items():  # the same noised states, summed in the clear or masked
        if ".lora_" not in key:
            assert float((b["members"]["global"][key].double() - v.double()).abs().max()) <= bound + 1e-7, key
    assert b["history"][0]["losses"] == {}  # under DP a site reports no losses, masked or not


def test_a_value_outside_the_clipping_range_is_refused_by_the_site_not_clipped(prepared, tmp_path):
    from conftest import train

    from fedhisto.train.loop import ClientFailure

    with pytest.raises(ClientFailure, match=r"client C1 failed in round 1.*term .* outside the clipping range"):
        train(prepared, "fedavg_peft", tmp_path / "clip", secure_cfg(prepared, ("fedavg_peft",), clipping_range=1e-4))


def test_a_masked_sum_never_covers_fewer_sites_than_the_method_needs(prepared):
    from fedhisto.methods import build_method
    from fedhisto.train.loop import TooManyUnavailable
    from fedhisto.train.secure_round import Kept, run_secure_round

    cfg = secure_cfg(prepared, ("past_v2",))
    m = build_method("past_v2", cfg)

    class ThreeLeft:  # two of five sites lost in training: three would let a site solve for the others
        names = ("C1", "C2", "C3", "C4", "C5")

        def train_and_keep(self, r, starts, payloads):
            return {n: Kept(10, 2, []) for n in self.names[:3]}, {"C4": "away", "C5": "away"}

        def masked_sum(self, *args):
            raise AssertionError("no masked sum below the method's least number of sites")

    ckpt = {"members": {"global": {}}, "server_state": None}
    with pytest.raises(TooManyUnavailable, match="at least 4"):
        run_secure_round(m, ThreeLeft(), ckpt, 0, None)


# ------------------------------------------------------------------ the generated table
def test_the_guides_hold_the_generated_secure_aggregation_table():
    from fedhisto.methods.secure_table import BLOCK, block_of, render_secure_aggregation

    body = render_secure_aggregation()
    assert block_of((REPO / "docs/methods.md").read_text(), BLOCK) == body, "docs/methods.md: run `fedhisto records`"
    from fedhisto.methods import method_names

    named = [cell.strip() for row in body.splitlines()[2:] for cell in row.split("|")[1].split(",")]
    assert sorted(named) == sorted(method_names())  # the guide names what the coordinator learns for every method
    assert load_config_file(REPO / "config/config.yaml").model.adapter_hidden == 32  # the tiny model it describes


@pytest.mark.parametrize("method", ["local_only", "pooled"])
def test_a_reference_that_aggregates_nothing_runs_as_without_secure_aggregation(prepared, tmp_path, method):
    from conftest import train

    train(prepared, method, tmp_path / "plain", secure_cfg(prepared, (method,), secure=False))
    train(prepared, method, tmp_path / "secure", secure_cfg(prepared, (method,)))
    a, b = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=False)["members"] for d in ("plain", "secure"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[m][k], b[m][k]) for m in a for k in a[m])
