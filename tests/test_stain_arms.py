"""Issue 23 item 1: the stain-augmented single-view arms (fedavg_peft_stain, v1_stain).

Each arm's one view is v2's first view (same geometry, same OD / brightness / contrast draw, from
the same per-image generator); every other single-view method keeps following
``views.single_view_stain``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedhisto.config.study import load_config, load_config_file
from fedhisto.data.splits import Split
from fedhisto.data.views import training_views
from fedhisto.methods import build_method, default_comparisons, registration
from fedhisto.methods.base import Batch

IDS = ["00000000000000a1", "00000000000000b2", "00000000000000c3"]


def tissue(seed: int, size: int = 64) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.integers(60, 230, (size // 8, size // 8, 3)).astype(np.uint8)
    return np.kron(base, np.ones((8, 8, 1), np.uint8))


def views_of(method: str, cfg, pipeline: str = "host") -> torch.Tensor:
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"view_pipeline": pipeline})})
    data = Split(IDS, [0, 1, 2], [tissue(k) for k in range(3)])
    run = SimpleNamespace(cfg=cfg, data=data, seed=11, device=torch.device("cpu"))
    batch = Batch(np.arange(3), torch.tensor([0, 1, 2]), epoch=0, view_epoch=4, number=0)
    (x,) = build_method(method, cfg).objective.batch_inputs(run, batch).views
    return x


@pytest.fixture(scope="module")
def cfg():
    return load_config({"views": {"crop_size": 32}})


def test_stain_arm_view_is_v2_first_view_and_baseline_stays_geometry_only(cfg):
    data = [tissue(k) for k in range(3)]
    v2_first = torch.stack([training_views(im, cfg.views, 11, 4, sid, paired=True)[0] for im, sid in zip(data, IDS, strict=True)])
    geometry = torch.stack([training_views(im, cfg.views, 11, 4, sid, paired=False, stain_single=False)[0]
                            for im, sid in zip(data, IDS, strict=True)])
    for arm in ("fedavg_peft_stain", "v1_stain"):
        assert torch.equal(views_of(arm, cfg), v2_first)  # v2's first-view law, draw for draw
    plain = views_of("fedavg_peft", cfg)
    assert torch.equal(plain, geometry)
    # same geometry, other stain: the colour moves, the edges stay
    arm = views_of("fedavg_peft_stain", cfg)
    assert (arm - plain).abs().mean() > 0.02
    grey_a, grey_p = arm.mean(1), plain.mean(1)
    edges = np.corrcoef(torch.diff(grey_a, dim=2).ravel(), torch.diff(grey_p, dim=2).ravel())[0, 1]
    assert edges > 0.8


def test_global_switch_still_governs_the_other_single_view_methods(cfg):
    stained = cfg.model_copy(update={"views": cfg.views.model_copy(update={"single_view_stain": True})})
    for method in ("fedavg_peft", "fedprox_peft", "film_zero", "past_v1"):
        assert torch.equal(views_of(method, stained), views_of("fedavg_peft_stain", cfg))
        assert not torch.equal(views_of(method, cfg), views_of("fedavg_peft_stain", cfg))
    # the arms do not depend on the switch
    assert torch.equal(views_of("v1_stain", stained), views_of("v1_stain", cfg))


def test_device_pipeline_draws_the_same_stain(cfg):
    host, device = views_of("fedavg_peft_stain", cfg), views_of("fedavg_peft_stain", cfg, "device")
    plain = views_of("fedavg_peft", cfg, "device")
    # the device renders float32 geometry without the host's uint8 rounding (views_device docstring)
    assert (host - device).abs().mean() < 0.03
    assert (device - plain).abs().mean() > 0.02


def test_arms_are_registered_comparators_of_their_single_view_method():
    assert default_comparisons()["v2_vs_fedavg_stain"] == "fedavg_peft_stain"
    assert default_comparisons()["v2_vs_v1_stain"] == "v1_stain"
    v1, arm = registration("past_v1").options, registration("v1_stain").options
    assert {k: v for k, v in arm.items() if k != "stain_views"} == v1
    assert registration("fedavg_peft_stain").options == {"stain_views": True}
    embedded = load_config_file("config/config.yaml")
    assert {"fedavg_peft_stain", "v1_stain"} <= set(embedded.train.methods)
    assert "v2_vs_fedavg_stain" in embedded.trained_comparisons()
    # comparators, not study methods: train.comparator_seeds applies to them
    thinned = load_config({"train": {"methods": ["fedavg_peft", "past_v2", "fedavg_peft_stain"],
                                     "comparator_seeds": [11, 33]}})
    assert thinned.trained_seeds("fedavg_peft_stain") == [11, 33]
    assert thinned.trained_seeds("fedavg_peft") == list(thinned.train.seeds)


def test_stain_views_refuses_paired_views():
    from fedhisto.methods.past import PastObjective

    with pytest.raises(ValueError, match="stain_views"):  # the views are the client objective's
        PastObjective("x", load_config({}), "past", paired_views=True, stain_views=True)
