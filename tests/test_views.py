from __future__ import annotations

import numpy as np
import torch

from fedhisto.config.study import ViewsConfig
from fedhisto.data.views import (
    apply_geometry,
    denormalise,
    eval_view,
    sample_geometry,
    stain_perturb,
    training_views,
    view_rng,
)

CFG = ViewsConfig()


def tissue_like(seed: int = 0, size: int = 256) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.integers(60, 230, (size // 8, size // 8, 3)).astype(np.uint8)
    return np.kron(base, np.ones((8, 8, 1), np.uint8))


def test_paired_views_share_geometry_but_not_stain():
    img = tissue_like()
    a, b = training_views(img, CFG, seed=11, epoch=0, sample_id="00ff", paired=True)
    assert a.shape == b.shape == (3, 224, 224)
    assert not torch.allclose(a, b)
    # same geometry: with the stain perturbation switched off both views are the same pixels
    flat = CFG.model_copy(update={"od_noise_sd": 0.0, "od_diag_scale": (1.0, 1.0), "brightness": (1.0, 1.0),
                                  "contrast": (1.0, 1.0)})
    a0, b0 = training_views(img, flat, seed=11, epoch=0, sample_id="00ff", paired=True)
    assert torch.allclose(a0, b0)
    # and the edges (structure) of the two stained views coincide
    ga, gb = denormalise(a, CFG).mean(2), denormalise(b, CFG).mean(2)
    assert np.corrcoef(np.diff(ga, axis=1).ravel(), np.diff(gb, axis=1).ravel())[0, 1] > 0.8


def test_views_are_reproducible_per_sample_and_epoch():
    img = tissue_like()
    v1 = training_views(img, CFG, 11, 3, "abcd", paired=True)
    v2 = training_views(img, CFG, 11, 3, "abcd", paired=True)
    v3 = training_views(img, CFG, 11, 4, "abcd", paired=True)
    assert all(torch.equal(x, y) for x, y in zip(v1, v2, strict=True))
    assert not torch.equal(v1[0], v3[0])


def test_geometry_parameters_stay_in_range():
    for k in range(200):
        g = sample_geometry(view_rng(1, 0, f"{k:04x}"), 300, 300, CFG)
        area = g.height * g.width / 300**2
        assert 0.85 - 0.02 <= area <= 1.0 and 0.9 - 0.05 <= g.width / g.height <= 1.1 + 0.05
        assert -10 <= g.angle <= 10
    flips = [sample_geometry(view_rng(2, 0, f"{k:04x}"), 300, 300, CFG) for k in range(2000)]
    assert abs(np.mean([g.hflip for g in flips]) - 0.5) < 0.04
    assert abs(np.mean([g.vflip for g in flips]) - 0.2) < 0.03


def test_rotation_fills_white():
    g = sample_geometry(view_rng(0, 0, "01"), 100, 100, CFG)
    g = type(g)(0, 0, 100, 100, False, False, 10.0)
    out = apply_geometry(np.zeros((100, 100, 3), np.uint8), g, 224)
    assert out[0, 0].tolist() == [255, 255, 255] and out[112, 112].tolist() == [0, 0, 0]


def test_stain_perturbation_ranges():
    img = tissue_like()
    ident = CFG.model_copy(update={"od_noise_sd": 0.0, "od_diag_scale": (1.0, 1.0), "brightness": (1.0, 1.0),
                                   "contrast": (1.0, 1.0)})
    same = stain_perturb(img, np.random.default_rng(0), ident)
    assert np.abs(same * 255 - img).max() <= 1.0  # OD round trip is lossless to a grey level
    out = stain_perturb(img, np.random.default_rng(0), CFG)
    assert out.min() >= 0 and out.max() <= 1 and np.abs(out * 255 - img).mean() > 1


def test_eval_view_is_deterministic_whole_image():
    img = tissue_like(size=300)
    a, b = eval_view(img, CFG), eval_view(img, CFG)
    assert torch.equal(a, b) and a.shape == (3, 224, 224)
    back = denormalise(a, CFG)
    assert abs(int(back.mean()) - int(img.mean())) <= 2


def test_single_view_pathway():
    img = tissue_like()
    (v,) = training_views(img, CFG, 1, 0, "aa", paired=False)
    assert v.shape == (3, 224, 224)
    (w,) = training_views(img, CFG, 1, 0, "aa", paired=False, stain_single=True)
    assert not torch.equal(v, w)


def _field_1600x1200() -> np.ndarray:
    """A LungHist700-shaped field (1200 rows, 1600 columns) whose every pixel says where it came from:
    red = column / 1600, green = row / 1200 (scaled to 0..255), plus a centred black disc."""
    rows, cols = np.mgrid[0:1200, 0:1600]
    img = np.stack([cols * 255 // 1599, rows * 255 // 1199, np.full_like(rows, 128)], -1).astype(np.uint8)
    img[(rows - 600) ** 2 + (cols - 800) ** 2 < 300 ** 2] = 0
    return img


def test_eval_resize_squash_is_the_default_and_the_old_transform_byte_for_byte():
    import cv2

    from fedhisto.data.views import eval_resize

    img = _field_1600x1200()
    assert ViewsConfig().eval_resize == "squash"
    old = cv2.resize(img, (224, 224), interpolation=cv2.INTER_LINEAR)  # the transform before the option existed
    assert np.array_equal(eval_resize(img, 224), old)
    cfg = ViewsConfig()
    assert torch.equal(eval_view(img, cfg), eval_view(img, ViewsConfig(eval_resize="squash")))
    # squash keeps every column: the left and right edges' red survives at the output's edges
    assert old[112, 0, 0] < 3 and old[112, -1, 0] > 252
    # and changes the aspect ratio: the disc (600 px across, 1/2 of the height, 3/8 of the width) is 84 px wide, 112 tall
    dark = old[..., 2] < 64
    assert abs(dark.any(0).sum() - 84) <= 2 and abs(dark.any(1).sum() - 112) <= 2


def test_eval_resize_keep_aspect_scales_the_shorter_side_and_crops_the_centre():
    from fedhisto.data.views import eval_resize

    img = _field_1600x1200()
    out = eval_resize(img, 224, "keep_aspect")
    assert out.shape == (224, 224, 3)
    # 1200 -> 224 rows (every row kept: green spans 0..255); 1600 -> 299 columns, the centre 224 kept, so
    # the first kept column is original column (299 - 224) // 2 / 224 * 1200 ~ 200 of 1600 (red ~ 32)
    assert out[0, 112, 1] < 3 and out[-1, 112, 1] > 252
    assert abs(int(out[112, 0, 0]) - 200 * 255 // 1599) <= 3 and abs(int(out[112, -1, 0]) - 1400 * 255 // 1599) <= 3
    # the disc stays round: 600 px of 1200 rows -> 112 px both ways
    dark = out[..., 2] < 64
    assert abs(dark.any(0).sum() - 112) <= 2 and abs(dark.any(1).sum() - 112) <= 2
    # a portrait field is cropped top and bottom; a square image is the same either way
    tall = np.ascontiguousarray(img.transpose(1, 0, 2))
    assert np.abs(eval_resize(tall, 224, "keep_aspect").astype(int) - out.transpose(1, 0, 2)).max() <= 1
    square = img[:1200, 200:1400]
    assert np.array_equal(eval_resize(square, 224, "keep_aspect"), eval_resize(square, 224, "squash"))
    view = eval_view(img, ViewsConfig(eval_resize="keep_aspect"))
    assert view.shape == (3, 224, 224) and not torch.equal(view, eval_view(img, CFG))


def test_eval_resize_is_a_checked_config_key():
    import pytest

    from fedhisto.config.study import ConfigError, load_config

    assert load_config({"views": {"eval_resize": "keep_aspect"}}).views.eval_resize == "keep_aspect"
    with pytest.raises(ConfigError, match=r"views\.eval_resize"):
        load_config({"views": {"eval_resize": "pad"}})
