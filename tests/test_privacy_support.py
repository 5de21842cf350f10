"""The privacy: config block, the refusals by name (fedhisto.train.private.dp_refusals: the engine, what each method's
client objective declares, the budget), the noised prototype release and its own noise multiplier, and the
sensitivity the clipping bounds."""

from __future__ import annotations

import pytest
import torch

from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import Config, ConfigError, load_config
from fedhisto.entry import study_config
from fedhisto.fedmath.prototypes import client_prototypes
from fedhisto.methods import build_method, register, unregister
from fedhisto.privacy.accountant import SiteAccountant
from fedhisto.privacy.releases import SENSITIVITY, noised_prototypes, prototype_release, unit_contributions

ONLY_FEDAVG = {"train": {"methods": ["fedavg_peft"], "ablations": [], "seeds": [11], "ablation_seeds": [],
                         "engine": "sequential"},
               "bootstrap": {"comparisons": {}}}


def _cfg(privacy: dict, **train) -> dict:
    raw = {k: dict(v) for k, v in ONLY_FEDAVG.items()}
    raw["train"].update(train)
    return raw | {"privacy": privacy}


def test_privacy_off_leaves_every_train_identity_unchanged():
    cfg = Config()
    for method in [*cfg.train.methods, *cfg.train.ablations]:
        assert "privacy" not in stage_block(cfg, "train", method=method, seed=11)
    with pytest.raises(ConfigError, match=r"privacy\.target_epsilon is set but privacy\.enabled is false"):
        study_config({"privacy": {"target_epsilon": 3.0}})
    with pytest.raises(ConfigError, match=r"unknown key 'privacy\.epsilon'"):
        study_config({"privacy": {"epsilon": 3.0}})


def test_refusals_name_the_method_and_the_reason():
    cfg = study_config(_cfg({"enabled": True, "noise_multiplier": 1.2}))
    block = stage_block(cfg, "train", method="fedavg_peft", seed=11)
    assert block["privacy"]["noise_multiplier"] == 1.2  # a DP run is another run
    with pytest.raises(ConfigError, match=r"method 'fedstain' cannot train under DP-SGD: its loss does not "
                                          r"decompose per sample: .*SupCon"):
        study_config(_cfg({"enabled": True}, methods=["fedavg_peft", "fedstain"]))
    with pytest.raises(ConfigError, match=r"method 'fedstain_code' cannot train under DP-SGD"):
        study_config(_cfg({"enabled": True}, methods=["fedavg_peft", "fedstain_code"]))
    with pytest.raises(ConfigError, match=r"train.engine: 'batched' cannot run DP-SGD; set train.engine: sequential"):
        study_config(_cfg({"enabled": True}, engine="batched"))
    with pytest.raises(ConfigError, match=r"method 'past_v2' cannot train under DP-SGD: it uploads class prototypes"):
        study_config(_cfg({"enabled": True}, methods=["fedavg_peft", "past_v2"]))
    ok = study_config(_cfg({"enabled": True, "prototypes": "noised"}, methods=["fedavg_peft", "past_v2", "fedprox_peft"]))
    assert ok.privacy.prototypes == "noised"
    for name in ("local_only", "pooled", "film_zero", "v2_no_proto", "fedadam", "scaffold", "fedavg_peft_stain"):
        assert build_method(name, cfg).objective.dp_refusal() is None, name
    with pytest.raises(ConfigError, match=r"method 'scaffold' cannot train under DP-SGD: train.scaffold.variates: "
                                          r"start_gradient uploads each site's full-data gradient"):
        study_config(_cfg({"enabled": True}, methods=["scaffold"]) | {"train": {
            **ONLY_FEDAVG["train"], "methods": ["scaffold"], "scaffold": {"variates": "start_gradient"}}})


def test_the_objective_refuses_a_reading_without_a_per_image_form_by_name():
    with pytest.raises(ConfigError, match=r"method 'fedavg_peft' cannot train under DP-SGD: "
                                          r"train.readings.ce_reduction: weighted_mean divides"):
        study_config(_cfg({"enabled": True}, readings={"ce_reduction": "weighted_mean"}))
    ok = study_config(_cfg({"enabled": True}, readings={"ce_views": "sum"}))  # ce_views has a per-image form
    assert ok.train.readings.ce_views == "sum"


def test_whether_a_method_runs_under_dp_follows_from_what_its_objective_declares():
    """A strategy that changes only the server keeps the default objective, which has its per-image form: it
    trains under DP with no declaration. An objective that changes the batch loss without declaring its
    per-image form beside it is refused by name; declaring it makes the same objective acceptable. An
    objective that uploads before training is refused (nothing noises the upload), and a class that cannot
    be imported is refused by name."""
    import torch as _torch

    from fedhisto.methods.dp_objective import PrivateObjective, image_ce
    from fedhisto.methods.objective import Objective
    from fedhisto.methods.strategy import Strategy
    from fedhisto.train.private import dp_refusals

    class ServerOnly(Strategy):
        def client_weights(self, counts, updates):
            return [1.0 / len(counts)] * len(counts)

    class Penalised(Objective):
        def extra_terms(self, run, batch, logits, zs):
            return {"l2": 1e-3 * run.params["classifier.weight"].pow(2).sum()}

    class PenalisedDeclared(Penalised):
        def private_objective(self, run):
            return PrivateObjective(image_ce(run), lambda: 1e-3 * run.params["classifier.weight"].pow(2).sum())

    class Uploads(Objective):
        pre_uploads = True

        def upload_before_training(self, model, start_state, data, rng, device):
            return {"mean": _torch.zeros(1)}

    strategies = {"my_server_only": ServerOnly}
    for name, objective in (("my_penalised", Penalised), ("my_declared", PenalisedDeclared), ("my_uploads", Uploads)):
        strategies[name] = type(f"{objective.__name__}Strategy", (Strategy,), {"objective_class": objective})
    for name, cls in strategies.items():
        register(name, cls)
    register("my_missing", "mypkg.methods:Mine")
    try:
        cfg = study_config(_cfg({"enabled": False}))
        assert build_method("my_server_only", cfg).objective.dp_refusal() is None
        assert build_method("my_declared", cfg).objective.dp_refusal() is None
        why = build_method("my_penalised", cfg).objective.dp_refusal()
        assert why is not None and "Penalised changes the batch loss (extra_terms) but declares no objective of one image" in why
        assert "uploads statistics of the site's data before training" in build_method("my_uploads", cfg).objective.dp_refusal()
        # the wrapper's own list (the config door raises it): load_config alone does not refuse
        lines = dp_refusals(load_config(_cfg({"enabled": True}, methods=["my_server_only", "my_penalised",
                                                                           "my_missing"])))
        assert [line.split(":")[0] for line in lines] == ["method 'my_penalised' cannot train under DP-SGD",
                                                          "method 'my_missing' cannot train under DP-SGD"]
        assert "cannot be imported" in lines[1]
    finally:
        for name in [*strategies, "my_missing"]:
            unregister(name)


def _embeddings(n: int = 30, dim: int = 16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, dim, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


def test_prototype_release_sensitivity_is_sqrt2_per_unit():
    z, y = _embeddings()
    images = unit_contributions(z, y, torch.arange(30), 30, 3)
    assert torch.allclose(images.norm(dim=1), torch.full((30,), SENSITIVITY, dtype=torch.float64))
    families = unit_contributions(z, y, torch.arange(30) // 5, 6, 3)  # six families of five images
    assert float(families.norm(dim=1).max()) <= SENSITIVITY * (1 + 1e-12)
    # removing any one unit moves the released sum by at most the sensitivity
    total = families.sum(0)
    assert max(float((total - (total - families[u])).norm()) for u in range(6)) <= SENSITIVITY * (1 + 1e-12)


def test_noised_prototypes_approach_the_plain_upload_and_are_accounted():
    z, y = _embeddings(300)
    plain = client_prototypes(z, y, 3)
    noised = noised_prototypes(z, y, torch.arange(300), 300, 3, 0.01, torch.Generator().manual_seed(1))
    assert noised.counts == plain.counts  # noise 0.014 on counts of ~100: rounds back
    for c, u in plain.centroids.items():
        assert float(torch.dot(u, noised.centroids[c])) > 0.999
    loud = noised_prototypes(z, y, torch.arange(300), 300, 3, 50.0, torch.Generator().manual_seed(1))
    assert min(float(torch.dot(plain.centroids[c], loud.centroids[c])) for c in loud.centroids) < 0.9
    with pytest.raises(ValueError, match="noise multiplier > 0"):
        noised_prototypes(z, y, torch.arange(300), 300, 3, 0.0, torch.Generator())
    ledger = SiteAccountant("C1", 1e-5)
    ledger.record_round(0, [prototype_release(5.0)])
    assert ledger.epsilon() == pytest.approx(SiteAccountant("C1", 1e-5).epsilon([prototype_release(5.0)]))
    assert ledger.all_releases()[0].sample_rate == 1.0 and ledger.all_releases()[0].kind == "prototypes"


def test_round_releases_feed_the_plan_check():
    from fedhisto.privacy.accountant import check_plan
    from fedhisto.privacy.dpsgd import steps_per_epoch
    from fedhisto.privacy.releases import releases_of, round_releases

    plain = round_releases(1.0, 0.05, 2, uploads_prototypes=False)
    assert [(r.steps, r.kind) for r in plain] == [(2 * steps_per_epoch(0.05), "dpsgd")]
    with_protos = round_releases(1.0, 0.05, 2, uploads_prototypes=True)
    assert [r.kind for r in with_protos] == ["dpsgd", "prototypes"]
    eps_plain = check_plan("C4", 400, plain, 5, 1e-5, None, "stop")
    eps_protos = check_plan("C4", 400, with_protos, 5, 1e-5, None, "stop")
    assert all(b > a for a, b in zip(eps_plain, eps_protos, strict=True))  # the prototype upload costs epsilon
    # the prototype release takes its own noise multiplier, accounted as its own Gaussian mechanism
    louder = round_releases(1.0, 0.05, 2, uploads_prototypes=True, prototype_noise_multiplier=8.0)
    assert [(r.noise_multiplier, r.sample_rate, r.steps) for r in louder] == [
        (1.0, 0.05, 2 * steps_per_epoch(0.05)), (8.0, 1.0, 1)]
    eps_louder = check_plan("C4", 400, louder, 5, 1e-5, None, "stop")
    assert all(a < b < c for a, b, c in zip(eps_plain, eps_louder, eps_protos, strict=True))
    cfg = study_config(_cfg({"enabled": True, "prototype_noise_multiplier": 8.0}))
    assert [r.noise_multiplier for r in releases_of(cfg.privacy, 2, True)] == [1.0, 8.0]
    assert [r.noise_multiplier for r in releases_of(study_config(_cfg({"enabled": True})).privacy, 2, True)] == [1.0, 1.0]
    with pytest.raises(ConfigError, match=r"prototype_noise_multiplier is set but privacy\.enabled is false"):
        study_config(_cfg({"prototype_noise_multiplier": 8.0}))


def test_past_unit_loss_reads_the_method_and_its_round_payload():
    from fedhisto.fedmath.prototypes import ServerPrototypes
    from fedhisto.methods import build_method

    def past_unit_loss(method, payload, w):
        return method.objective.unit_loss(payload, w)

    cfg = Config()
    w = torch.tensor([1.0, 2.0, 0.5])
    protos = ServerPrototypes(torch.randn(3, 8), torch.ones(3), torch.tensor([True, True, False]), torch.ones(3))
    v2 = past_unit_loss(build_method("past_v2", cfg), {"prototypes": protos}, w)
    s = cfg.train.past
    assert (v2.weight_js, v2.weight_feat, v2.weight_proto, v2.prototypes, v2.margin) == (
        s.weight_js, s.weight_feat, s.weight_proto, "v2", s.proto_margin)
    assert torch.equal(v2.centroids, protos.centroids) and torch.equal(v2.ce_weights, w)
    first_round = past_unit_loss(build_method("past_v2", cfg), {"prototypes": None}, w)
    assert first_round.prototypes == "none" and first_round.weight_proto == 0.0  # no global prototypes yet
    fedavg = past_unit_loss(build_method("fedavg_peft", cfg), {"prototypes": protos}, w)
    assert (fedavg.weight_js, fedavg.weight_feat, fedavg.prototypes) == (0.0, 0.0, "none")
    no_js = past_unit_loss(build_method("v2_no_js", cfg), {"prototypes": protos}, w)
    assert no_js.weight_js == 0.0 and no_js.weight_feat == s.weight_feat
