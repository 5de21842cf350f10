"""DP-SGD on the real training path (train.private through train.stage.run_train): epsilon in history.csv and
report.json is an independent accountant's, a killed run resumes exactly, the privacy unit is what is
clipped (two views of an image as one sample; a family as one), and the budget stops or refuses by name."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import train

from fedhisto.config.study import ConfigError
from fedhisto.entry import study_config
from fedhisto.privacy.dpsgd import NoisyGradientSum, steps_per_epoch

PRIVACY = {"enabled": True, "noise_multiplier": 1.1, "clip_norm": 0.5, "sample_rate": 0.25, "delta": 1e-4,
           "micro_batch": 6, "noise_seed": "run", "prototypes": "noised"}


def dp_cfg(prepared: dict, rounds: int = 2, methods: tuple[str, ...] = ("fedavg_peft", "past_v2"), **privacy):
    raw = json.loads(prepared["cfg"].model_dump_json())
    raw["train"].update(max_rounds=rounds, local_epochs=1, engine="sequential", methods=list(methods), ablations=[],
                        ablation_seeds=[])
    raw["bootstrap"]["comparisons"] = {}
    raw["privacy"] = {**PRIVACY, **privacy}
    return study_config(raw)


def history(out: Path) -> list[dict]:
    with (out / "history.csv").open() as fh:
        return list(csv.DictReader(fh))


def state(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)["members"]["global"]


def test_epsilon_is_the_independent_accountants_and_a_killed_run_resumes_exactly(prepared: dict, tmp_path: Path):
    rdp = pytest.importorskip("opacus.accountants.analysis.rdp")
    from fedhisto.privacy.rdp import DEFAULT_ORDERS

    cfg = dp_cfg(prepared)
    reference = tmp_path / "reference"
    summary = train(prepared, "fedavg_peft", reference, cfg=cfg)
    steps = steps_per_epoch(0.25)  # local_epochs 1
    expected = [rdp.get_privacy_spent(orders=list(DEFAULT_ORDERS), delta=1e-4,
                                      rdp=rdp.compute_rdp(q=0.25, noise_multiplier=1.1, steps=steps * (r + 1),
                                                          orders=list(DEFAULT_ORDERS)))[0] for r in range(2)]
    rows = history(reference)
    sites = sorted(summary["privacy"]["epsilon"])
    assert sites == ["C1", "C2", "C3", "C4", "C5"] and len(rows) == 2
    for r, row in enumerate(rows):
        for s in sites:
            assert float(row[f"epsilon_{s}"]) == pytest.approx(expected[r], rel=1e-5)  # written to 6 decimals
        assert float(row["epsilon_max"]) == pytest.approx(expected[r], rel=1e-5)
        assert json.loads(row["losses"]) == {s: {} for s in sites}  # no un-noised data-dependent losses
    report = json.loads((reference / "report.json").read_text())["privacy"]
    assert report["epsilon_max"] == pytest.approx(expected[1], rel=1e-9)
    assert all(v == pytest.approx(expected[1], rel=1e-9) for v in report["epsilon"].values())
    assert report["steps_per_round"] == dict.fromkeys(sites, steps) and report["stopped_by_budget"] is None
    status = json.loads((reference / "status.json").read_text())
    assert status["privacy"]["epsilon_max"] == report["epsilon_max"]

    stopped = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        train(prepared, "fedavg_peft", stopped, cfg=cfg, stop_after_round=1)
    saved = torch.load(stopped / "checkpoint.pt", map_location="cpu", weights_only=False)["participants"]["privacy"]
    assert [len(saved[s]["ledger"]["rounds"]) for s in sites] == [1] * 5
    resumed = train(prepared, "fedavg_peft", stopped, cfg=cfg)
    assert resumed["resumed_at_rounds"] == [1]
    assert resumed["privacy"]["epsilon"] == summary["privacy"]["epsilon"]  # bit-equal epsilons after the resume
    a, b = state(reference), state(stopped)
    assert all(torch.equal(a[k], b[k]) for k in a)  # and the same noise and batches (noise_seed: run)
    assert [r["epsilon_max"] for r in history(stopped)] == [r["epsilon_max"] for r in rows]

    # privacy off: another run identity, and the embedded default path untouched
    plain = tmp_path / "plain"
    off = train(prepared, "fedavg_peft", plain, cfg=prepared["cfg"].model_copy(
        update={"train": cfg.train}))
    assert "privacy" not in off and "epsilon_max" not in history(plain)[0]
    assert off["identity"]["config_hash"] != summary["identity"]["config_hash"]

    # Tables 4-5 read each run's epsilon from status.json; a non-private run adds no column
    from fedhisto.metrics.stage import privacy_epsilon
    from fedhisto.report.stage import privacy_columns

    assert privacy_epsilon(reference) == (report["epsilon_max"], 1e-4) and privacy_epsilon(plain) is None
    assert privacy_columns({"method": "fedavg_peft", "epsilon_max": 2.5, "delta": 1e-4}) == {"epsilon_max": 2.5,
                                                                                            "delta": 1e-4}
    assert privacy_columns({"method": "fedavg_peft"}) == {}


def test_dp_is_refused_on_the_flower_path_by_name(prepared: dict):
    pytest.importorskip("flwr")
    from fedhisto.federation.server import check_federable
    from fedhisto.methods import build_method

    with pytest.raises(ValueError, match=r"privacy\.enabled: DP-SGD runs on the in-process sequential engine only"):
        check_federable(build_method("fedavg_peft", dp_cfg(prepared)), ["C1", "C2"])


def test_a_secret_noise_seed_is_kept_in_the_checkpoint_and_reused_on_resume(prepared: dict, tmp_path: Path):
    cfg = dp_cfg(prepared, noise_seed="secret")
    out = tmp_path / "secret"
    with pytest.raises(KeyboardInterrupt):
        train(prepared, "fedavg_peft", out, cfg=cfg, stop_after_round=1)
    first = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)["participants"]["privacy"]
    train(prepared, "fedavg_peft", out, cfg=cfg)
    after = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)["participants"]["privacy"]
    assert {s: v["seed"] for s, v in first.items()} == {s: v["seed"] for s, v in after.items()}
    assert len(set(v["seed"] for v in first.values())) == 5  # one secret per site
    report = json.loads((out / "report.json").read_text())
    assert "seed" not in json.dumps(report["privacy"])  # the secret never reaches the report


def test_two_views_of_an_image_are_one_clipped_unit_and_a_family_is_one(prepared: dict, tmp_path: Path, monkeypatch):
    """past_v2 trains on two stain views per image: every clipped gradient is one image's (both views
    together), and with privacy.unit: family one family's, never one view's."""
    seen: list[tuple[int, float]] = []
    real_add = NoisyGradientSum.add

    def spy(self, per_unit):
        norms = real_add(self, per_unit)
        clipped = {n: g * (self.clip_norm / norms.clamp_min(1e-12)).clamp(max=1).to(g.dtype).reshape(
            -1, *[1] * (g.dim() - 1)) for n, g in per_unit.items()}
        flat = torch.cat([g.reshape(g.shape[0], -1).double() for g in clipped.values()], 1)
        seen.append((norms.numel(), float(flat.norm(dim=1).max())))
        return norms

    views_seen: list[tuple[int, int]] = []
    import fedhisto.privacy.step as step

    real_grads = step.per_unit_gradients

    def spy_grads(model, loss, views, labels, unit_index, n_units, *a, **k):
        views_seen.append((views.shape[0], views.shape[1], n_units))
        return real_grads(model, loss, views, labels, unit_index, n_units, *a, **k)

    monkeypatch.setattr(NoisyGradientSum, "add", spy)
    monkeypatch.setattr(step, "per_unit_gradients", spy_grads)
    train(prepared, "past_v2", tmp_path / "image", cfg=dp_cfg(prepared, rounds=1))
    assert views_seen and all(v == 2 and images == units for images, v, units in views_seen)
    assert all(c <= 0.5 * (1 + 1e-6) for _, c in seen)  # each unit's (two views') gradient clipped to C
    assert sum(n for n, _ in seen) == sum(images for images, _, _ in views_seen)  # one gradient per image

    # families of two images: one gradient per family, its two images (four views) clipped together
    import fedhisto.train.stage as stage

    def paired_families(manifest_csv):
        with Path(manifest_csv).open() as fh:
            ids = sorted(r["sample_id"] for r in csv.DictReader(fh))
        return {i: f"fam{k // 2}" for k, i in enumerate(ids)}

    monkeypatch.setattr(stage, "manifest_families", paired_families)
    seen.clear()
    views_seen.clear()
    summary = train(prepared, "past_v2", tmp_path / "family", cfg=dp_cfg(prepared, rounds=1, unit="family"))
    assert summary["privacy"]["unit"] == "family"
    assert any(images > units for images, _, units in views_seen)  # families of two images in a micro-batch
    assert sum(n for n, _ in seen) == sum(units for _, _, units in views_seen)
    assert all(c <= 0.5 * (1 + 1e-6) for _, c in seen)


def test_the_budget_stops_the_run_and_says_so_or_refuses_before_training(prepared: dict, tmp_path: Path):
    from fedhisto.privacy import rdp

    steps = steps_per_epoch(0.25)
    after = [rdp.epsilon(1.1, 0.25, steps * (r + 1), 1e-4) for r in range(3)]
    cfg = dp_cfg(prepared, rounds=3, methods=("fedavg_peft",), target_epsilon=(after[0] + after[1]) / 2,
                 on_budget="stop")
    out = tmp_path / "budget"
    summary = train(prepared, "fedavg_peft", out, cfg=cfg)
    assert summary["rounds"] == 1 and len(history(out)) == 1
    assert "privacy budget: site C1: round 1 would raise epsilon" in summary["privacy"]["stopped_by_budget"]
    assert json.loads((out / "status.json").read_text())["status"] == "finalised"
    raw = json.loads(cfg.model_dump_json())
    with pytest.raises(ConfigError, match=r"privacy.target_epsilon: method 'fedavg_peft' \(every site\): the plan "
                                          r"reaches .*unsatisfiable: a single round exceeds it"):
        study_config({**raw, "privacy": {**raw["privacy"], "target_epsilon": after[0] / 2}})
    with pytest.raises(ConfigError, match=r"privacy.target_epsilon: .*3 rounds are planned \(privacy.on_budget: refuse\)"):
        study_config({**raw, "privacy": {**raw["privacy"], "on_budget": "refuse"}})
