"""Issue 23 item 4: fedstain_code with torchvision's AugMix (as the authors' code calls it) where
torchvision is importable, refused with a clear error where it is not; the default stays the
morphology AugMix, identities unchanged."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import load_config
from fedhisto.fedmath.fedstain_code_ops import torchvision_augmix
from fedhisto.fedmath.fedstain_ops import augmix

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def _unit(seed: int = 0, n: int = 3, size: int = 32) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.2, 0.9, (n, 3, size // 4, size // 4))
    return torch.tensor(np.kron(base, np.ones((1, 1, 4, 4))), dtype=torch.float32)


def test_default_augmix_is_the_morphology_one_and_identities_stay():
    cfg = load_config({})
    assert cfg.train.fedstain_code.augmix_ops == "morphology"
    assert "augmix_ops" not in stage_block(cfg, "train", method="fedstain_code", seed=11)["train"]["fedstain_code"]
    other = load_config({"train": {"fedstain_code": {"augmix_ops": "torchvision"}}})
    assert stage_block(other, "train", method="fedstain_code", seed=11)["train"]["fedstain_code"]["augmix_ops"] == \
        "torchvision"


@pytest.mark.skipif(HAS_TORCHVISION, reason="the refusal is for environments without torchvision")
def test_torchvision_augmix_is_refused_clearly_without_torchvision():
    with pytest.raises(RuntimeError, match="augmix_ops"):
        torchvision_augmix(_unit(), np.random.default_rng(0))


@pytest.mark.zoo
def test_torchvision_augmix_is_seeded_per_image_and_changes_colour():
    unit = _unit()
    a = torchvision_augmix(unit, np.random.default_rng(7))
    b = torchvision_augmix(unit, np.random.default_rng(7))
    c = torchvision_augmix(unit, np.random.default_rng(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == unit.shape and a.min() >= 0 and a.max() <= 1
    # the torch global generator is left as it was (each image's draws are forked)
    torch.manual_seed(3)
    before = torch.rand(1)
    torch.manual_seed(3)
    torchvision_augmix(unit, np.random.default_rng(7))
    assert torch.equal(torch.rand(1), before)
    # not the morphology AugMix: over several draws the colour operations move channel means,
    # which flips, rotations and zoom of a constant-mean image barely do
    rng = np.random.default_rng(0)
    tv = torch.stack([torchvision_augmix(unit, rng) for _ in range(8)])
    morph = torch.stack([torch.stack([augmix(img, rng) for img in unit]) for _ in range(8)])
    shift_tv = (tv.mean((3, 4)) - unit.mean((2, 3))).abs().mean()
    shift_morph = (morph.mean((3, 4)) - unit.mean((2, 3))).abs().mean()
    assert shift_tv > 2 * shift_morph


@pytest.mark.zoo
def test_generated_views_use_torchvision_augmix_when_asked():
    from fedhisto.fedmath.fedstain_code_ops import PixelMoments
    from fedhisto.methods.fedstain import from_unit
    from fedhisto.methods.fedstain_code import generated_views

    cfg = load_config({"train": {"fedstain_code": {"augmix_ops": "torchvision"}}})
    base = load_config({})
    x = from_unit(_unit(), cfg.views)
    pool = PixelMoments(torch.zeros(4, 3), torch.zeros(4, 3))
    tv = generated_views(x, pool, cfg.train.fedstain_code, cfg, np.random.default_rng(1))
    morph = generated_views(x, pool, base.train.fedstain_code, base, np.random.default_rng(1))
    assert len(tv) == 2 and not torch.allclose(tv[0], morph[0])
