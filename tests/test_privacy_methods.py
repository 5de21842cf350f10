"""DP-SGD as each method's own declaration: every registered method trains one DP round on the tiny cohort
with epsilon equal to an independent accountant's (DP-SGD and the prototype release at their own noise
multipliers), or is refused by the reason its own file gives; the engine and fedhisto.privacy name no
method; the clipped per-unit contribution is the sensitivity the accountant takes, with the class-balanced
weights held at their published values."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, train
from test_privacy_training import dp_cfg

from fedhisto.config.study import ConfigError
from fedhisto.entry import study_config
from fedhisto.methods import build_method, method_names, registration
from fedhisto.privacy.dpsgd import steps_per_epoch

PROTO_SIGMA = 2.5  # the prototype release's own multiplier (DP-SGD's is test_privacy_training's 1.1)


def _expected_epsilon(uploads_prototypes: bool, rounds: int = 1) -> float:
    rdp = pytest.importorskip("opacus.accountants.analysis.rdp")
    from fedhisto.privacy.rdp import DEFAULT_ORDERS

    orders = list(DEFAULT_ORDERS)
    curve = rdp.compute_rdp(q=0.25, noise_multiplier=1.1, steps=steps_per_epoch(0.25) * rounds, orders=orders)
    if uploads_prototypes:
        curve = curve + rdp.compute_rdp(q=1.0, noise_multiplier=PROTO_SIGMA, steps=rounds, orders=orders)
    return rdp.get_privacy_spent(orders=orders, delta=1e-4, rdp=curve)[0]


@pytest.mark.parametrize("name", method_names())
def test_every_registered_method_trains_a_dp_round_or_is_refused_by_its_own_declaration(prepared: dict,
                                                                                       tmp_path: Path, name: str):
    rounds = 2 if name == "scaffold" else 1  # its correction c - c_i is nonzero from round 2 on
    raw = json.loads(dp_cfg(prepared, rounds=rounds, methods=("fedavg_peft",)).model_dump_json())
    raw["train"]["methods"] = [name]
    raw["privacy"]["prototype_noise_multiplier"] = PROTO_SIGMA
    plain = study_config({**raw, "privacy": {"enabled": False}})
    why = build_method(name, plain.model_copy(update={"privacy": plain.privacy.model_copy(
        update={"prototypes": "noised"})})).objective.dp_refusal()
    if why is not None:  # the config refuses with the method's own words, before any training
        with pytest.raises(ConfigError, match=re.escape(f"method {name!r} cannot train under DP-SGD: {why}")):
            study_config(raw)
        assert name in ("fedstain", "fedstain_code"), name  # the two whose loss couples a batch's images
        return
    pytest.importorskip("opacus.accountants.analysis.rdp")
    cfg = study_config(raw)
    summary = train(prepared, name, tmp_path / name, cfg=cfg)
    uploads = bool(build_method(name, cfg).objective.post_uploads)
    expected = _expected_epsilon(uploads, rounds)
    eps = summary["privacy"]["epsilon"]
    assert sorted(eps) == (["pooled"] if name == "pooled" else ["C1", "C2", "C3", "C4", "C5"])
    assert all(v == pytest.approx(expected, rel=1e-9) for v in eps.values()), (eps, expected)
    report = json.loads((tmp_path / name / "report.json").read_text())["privacy"]
    assert report["prototype_noise_multiplier"] == (PROTO_SIGMA if uploads else None)
    assert report["class_counts"] == "public" and report["noise_multiplier"] == 1.1
    releases = {(r["kind"], r["noise_multiplier"], r["sample_rate"]) for row in report["history"] for r in row["releases"]}
    assert releases == ({("dpsgd", 1.1, 0.25), ("prototypes", PROTO_SIGMA, 1.0)} if uploads else {("dpsgd", 1.1, 0.25)})


def test_a_term_without_data_joins_after_the_noise_as_the_method_declares():
    """SCAFFOLD's correction and FedProx's proximal term are gradients without data: each method returns
    exactly correction_scale (c - c_i) and mu (theta - theta_start), whatever the local optimiser."""
    from fedhisto.config.study import Config

    cfg = Config()
    params = {"w": torch.nn.Parameter(torch.tensor([1.0, -2.0]))}
    start = {"w": torch.tensor([0.5, 0.5])}
    c, c_i = {"w": torch.tensor([0.3, -0.1])}, {"w": torch.tensor([0.1, 0.4])}
    run = SimpleNamespace(params=params, start_state=start, payload={"control": c, "client_control": c_i},
                          scratch={}, device=torch.device("cpu"), ce_weights=torch.ones(3), cfg=cfg)
    scaffold = build_method("scaffold", cfg).objective
    with scaffold.local_session(run):
        got = scaffold.private_objective(run).data_free_gradient(params)
    torch.testing.assert_close(got["w"], cfg.train.scaffold.correction_scale * torch.tensor([0.2, -0.5]))
    first_round = SimpleNamespace(**{**vars(run), "payload": {}, "scratch": {}})  # no variates yet: no term
    with scaffold.local_session(first_round):
        assert scaffold.private_objective(first_round).data_free_gradient(params) == {}
    fedprox = build_method("fedprox_peft", cfg).objective
    got = fedprox.private_objective(run).data_free_gradient(params)
    torch.testing.assert_close(got["w"], cfg.train.past.fedprox_mu * torch.tensor([0.5, -2.5]))
    assert build_method("fedavg_peft", cfg).objective.private_objective(run).data_free_gradient(params) == {}


def test_the_engine_and_privacy_name_no_method_and_privacy_reads_no_requires_grad():
    """Neither the engine nor privacy/ names a method; privacy/ decides nothing from requires_grad: what is
    differentiated, clipped and noised is the objective's declaration, passed in."""
    words = {"past", "scaffold", "fedadam", "fedprox", "fedstain", "fedavg"} | set(method_names())
    words |= {registration(n).method_class().__name__.lower() for n in method_names()}
    words |= {registration(n).method_class().objective_class.__name__.lower() for n in method_names()}
    words -= {"objective"}  # the base class every default-objective method names
    pattern = re.compile("|".join(sorted(map(re.escape, words), key=len, reverse=True)), re.IGNORECASE)
    hits = [f"{path.relative_to(REPO)}:{k}: {line.strip()}"
            for folder in ("src/fedhisto/privacy", "src/fedhisto/train") for path in sorted((REPO / folder).glob("*.py"))
            for k, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []
    assert [f"{p.name}:{k}" for p in sorted((REPO / "src/fedhisto/privacy").glob("*.py"))
            for k, line in enumerate(p.read_text().splitlines(), 1) if "requires_grad" in line] == []
    assert not (REPO / "src/fedhisto/methods/dp_capability.py").exists()  # the refusals are the objective's own


class _Linear(torch.nn.Module):
    """(V, 3, H, W) -> (logits (V, 3), z (V, 12)): a model small enough to read every gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.head = torch.nn.Linear(12, 3).double()

    def forward(self, x, descriptor=None):
        z = torch.nn.functional.avg_pool2d(x, x.shape[-1] // 2).reshape(x.shape[0], -1)
        return self.head(z), z


def test_the_accounted_sensitivity_is_the_clip_norm_given_public_class_counts():
    """Given the class counts (public), removing one unit moves the clipped sum by that unit's clipped
    gradient: at most C, the sensitivity the ledger accounts (noise std = sigma C). Were the weights
    recomputed from the counts without the unit, every other unit's term would move too and the change
    would exceed C: why docs/privacy.md states the guarantee with the weights held at their published values
    (neighbours never have equal counts)."""
    from fedhisto.config.study import Config
    from fedhisto.fedmath.losses import class_balanced_weights
    from fedhisto.methods.dp_objective import ImageCE
    from fedhisto.privacy.dpsgd import NoisyGradientSum, clip_and_sum
    from fedhisto.privacy.per_sample import per_image_gradients
    from fedhisto.privacy.releases import releases_of

    t = Config().train
    model = _Linear()
    every = {n: None for n, _ in model.named_parameters()}
    g = torch.Generator().manual_seed(4)
    labels = torch.tensor([0] * 12 + [1] * 3 + [2])  # one image of class 2: removing it drops the class
    views = torch.rand(len(labels), 1, 3, 4, 4, generator=g, dtype=torch.float64)

    def weights(keep):
        counts = torch.bincount(labels[keep], minlength=3).tolist()
        return class_balanced_weights(counts, t.cb_beta, t.cb_cap).double()

    def clipped_sum(keep, w, clip):
        grads = per_image_gradients(model, ImageCE(w), views[keep], labels[keep], trained=every, dropout="off")
        return torch.cat([v.reshape(-1) for v in clip_and_sum(grads, clip)[0].values()])

    everyone = torch.arange(len(labels))
    w_public = weights(everyone)
    norms = per_image_gradients(model, ImageCE(w_public), views, labels, trained=every, dropout="off")
    clip = float(torch.cat([v.reshape(len(labels), -1) for v in norms.values()], 1).norm(dim=1).max())
    full = clipped_sum(everyone, w_public, clip)  # C = the largest norm: no term is scaled, one is exactly C
    worst_public, worst_recomputed = 0.0, 0.0
    for u in range(len(labels)):
        rest = everyone[everyone != u]
        worst_public = max(worst_public, float((full - clipped_sum(rest, w_public, clip)).norm()))
        worst_recomputed = max(worst_recomputed, float((full - clipped_sum(rest, weights(rest), clip)).norm()))
    assert worst_public == pytest.approx(clip, rel=1e-9)  # removing the largest unit moves the sum by exactly C
    assert worst_recomputed > 1.1 * clip  # recomputed weights (1.28 C here): more than the ledger accounts

    # the ledger accounts a Gaussian mechanism of multiplier sigma on that sum: noise std sigma C
    privacy = SimpleNamespace(noise_multiplier=1.3, sample_rate=0.25, prototype_noise_multiplier=None)
    assert releases_of(privacy, 1, False)[0].noise_multiplier == 1.3
    acc = NoisyGradientSum(clip, 1.3, expected_units=1.0)
    noise = acc.release({"w": torch.zeros(200_000, dtype=torch.float64)}, torch.Generator().manual_seed(5))["w"]
    assert float(noise.std()) == pytest.approx(1.3 * clip, rel=0.01)  # 200k draws: SE of the SD 0.16 %
