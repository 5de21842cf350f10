from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhisto.config.study import ConfigError, EncoderConfig, load_config
from fedhisto.model.encoder import load_encoder
from fedhisto.pretrain.stage import CLIENT_SITES, render_pool, run_pretrain

SMALL = {"model": {"encoder": {"name": "tiny"}, "pretrain": {"enabled": True, "images_per_class": 10, "epochs": 1}},
         "views": {"crop_size": 48}}


def test_pretrained_encoder_loads_through_the_strict_loader(tmp_path: Path):
    cfg = load_config(SMALL)
    report = run_pretrain(cfg, tmp_path / "enc")
    assert report["pool_images"] == 30 and "external" not in report["sites"]
    assert json.loads((tmp_path / "enc/pretrain_report.json").read_text())["history"][0]["epoch"] == 1
    enc = load_encoder(EncoderConfig(name="tiny", require_pretrained=True), tmp_path / "enc")
    assert not any(p.requires_grad for p in enc.parameters())
    fresh = load_encoder(EncoderConfig(name="tiny", require_pretrained=False))
    moved = any(not torch.equal(a, b) for a, b in zip(enc.module.state_dict().values(), fresh.module.state_dict().values(),
                                                       strict=True))
    assert moved, "pretraining must change the weights"


def test_pool_is_deterministic_and_uses_client_sites_only():
    cfg = load_config(SMALL)
    a, la = render_pool(cfg)
    b, lb = render_pool(cfg)
    assert la == lb == [0] * 10 + [1] * 10 + [2] * 10
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert "external" not in CLIENT_SITES and len(CLIENT_SITES) == 5


def test_pretraining_hibou_is_refused():
    with pytest.raises(ConfigError, match="only applies to the tiny encoder"):
        load_config({"model": {"pretrain": {"enabled": True}}})


def test_plain_encoder_views_carry_no_stain_perturbation():
    from fedhisto.data.views import training_views
    from fedhisto.pretrain.stage import pretrain_view

    plain = load_config({**SMALL, "model": {**SMALL["model"], "pretrain": {**SMALL["model"]["pretrain"],
                                                                            "stain_views": False}}})
    default = load_config(SMALL)
    images, _ = render_pool(default)
    seed = default.model.pretrain.seed
    for i in (0, 13, 27):
        geometry_only = training_views(images[i], plain.views, seed, 2, f"{i:x}", paired=False, stain_single=False)[0]
        perturbed = training_views(images[i], plain.views, seed, 2, f"{i:x}", paired=False, stain_single=True)[0]
        assert torch.equal(pretrain_view(images[i], plain, 2, i), geometry_only)
        assert torch.equal(pretrain_view(images[i], default, 2, i), perturbed)
        assert not torch.equal(geometry_only, perturbed), "the stain perturbation must change the view"


def test_stain_views_default_leaves_stage_blocks_unchanged():
    from fedhisto.config.stage_blocks import stage_block

    default, plain = load_config(SMALL), load_config(
        {**SMALL, "model": {**SMALL["model"], "pretrain": {**SMALL["model"]["pretrain"], "stain_views": False}}})
    blocks = {name: [stage_block(c, name, method="past_v2", seed=11) for c in (default, plain)]
              for name in ("pretrain", "train", "accounting")}
    for name, (base, changed) in blocks.items():
        model = base["pretrain"] if name == "pretrain" else base["model"]["pretrain"]
        changed_model = changed["pretrain"] if name == "pretrain" else changed["model"]["pretrain"]
        assert "stain_views" not in model, f"default {name} block gained a key: existing results would rerun"
        assert changed_model["stain_views"] is False, f"the plain encoder must change the {name} block"
        assert base != changed
