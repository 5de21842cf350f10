from __future__ import annotations

import numpy as np
import pytest

from fedhisto.config.study import StainConfig
from fedhisto.stain.stage import (
    REFERENCE_E,
    REFERENCE_H,
    client_descriptor,
    concentrations,
    descriptor_for,
    he_check,
    macenko_directions,
    optical_density,
    sample_client,
    standardise,
    tissue_mask,
)
from fedhisto.synth.stain_styles import HEMATOXYLIN_OD, render_rgb, unit


def synthetic_od(n: int = 4000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """OD pixels that are positive mixtures of two known stain vectors."""
    rng = np.random.default_rng(seed)
    h, e = unit(np.array([0.62, 0.72, 0.30])), unit(np.array([0.10, 0.95, 0.28]))
    c = rng.gamma(2.0, 0.4, (n, 2))
    return c @ np.stack([h, e]), np.stack([h, e], 1)


def test_macenko_recovers_known_directions_hematoxylin_first():
    od, truth = synthetic_od()
    d = macenko_directions(od, alpha=0.1)
    assert d.shape == (3, 2)
    assert np.allclose(np.linalg.norm(d, axis=0), 1)
    assert d[:, 0] @ truth[:, 0] > 0.99 and d[:, 1] @ truth[:, 1] > 0.99
    assert d[0, 0] > d[0, 1]  # hematoxylin has the larger red OD


def test_descriptor_is_deterministic_and_order_free():
    od, _ = synthetic_od()
    a = macenko_directions(od)
    b = macenko_directions(od[::-1].copy())
    assert np.allclose(a, b)


def test_od_background_rule():
    od = np.array([[0.2, 0.3, 0.16], [0.2, 0.1, 0.5], [0.0, 0.0, 0.0]])
    assert tissue_mask(od, 0.15).tolist() == [True, False, False]
    assert np.allclose(optical_density(np.full((1, 1, 3), 239), 240.0), 0.0)


def test_concentrations_invert_the_mixture():
    od, truth = synthetic_od(50)
    c = concentrations(od, truth)
    assert np.allclose(c.T @ truth.T, od, atol=1e-9)


def test_he_check_flags_dab_like_stain():
    dab = unit(np.array([0.27, 0.57, 0.78]))
    assert he_check(np.stack([REFERENCE_H, REFERENCE_E], 1), 0.8)["he_like"]
    assert not he_check(np.stack([REFERENCE_H, dab], 1), 0.8)["he_like"]


def _write_tile(path, seed, blank=False):
    from PIL import Image

    from fedhisto.synth.stain_styles import SITE_STYLES
    from fedhisto.synth.tissue import tissue

    rng = np.random.default_rng(seed)
    if blank:
        rgb = np.full((64, 64, 3), 250, np.uint8)
    else:
        h, e = tissue("SCC", rng, 96, 0.75)
        rgb = render_rgb(h, e, SITE_STYLES["site1"], rng)
    Image.fromarray(rgb).save(path)
    return str(path)


def test_client_descriptor_has_14_values_and_falls_back_on_glass(tmp_path):
    cfg = StainConfig()
    d = client_descriptor([_write_tile(tmp_path / f"t{k}.png", k) for k in range(3)], cfg)
    assert d["raw"].shape == (14,) and d["fallback"] is None and d["he_check"]["he_like"]
    cos_h = d["raw"][:3] @ unit(HEMATOXYLIN_OD)
    assert cos_h > 0.95
    assert d["raw"][6] > 0 and d["raw"][8] <= d["raw"][9]  # H mean positive, Q1 <= Q3
    glass = client_descriptor([_write_tile(tmp_path / "g.png", 0, blank=True)], cfg)
    assert glass["fallback"] and "tissue pixels" in glass["fallback"]
    assert np.allclose(glass["raw"][:3], REFERENCE_H)


def test_sample_is_class_aware_and_capped():
    rows = [{"sample_id": f"{i:04x}", "label": lab} for i, lab in enumerate(["ACA"] * 100 + ["Normal"] * 5 + ["SCC"] * 50)]
    chosen = sample_client(rows, 20, 2026, 0)
    labels = [r["label"] for r in chosen]
    assert len(chosen) == 20 and labels.count("Normal") == 5 and labels.count("ACA") == 8
    assert chosen == sample_client(list(reversed(rows)), 20, 2026, 0)


def test_standardisation_and_centroid_is_zero():
    raw = {f"C{k}": np.random.default_rng(k).normal(size=14) for k in range(1, 6)}
    std, _, _ = standardise(raw)
    mat = np.stack(list(std.values()))
    assert np.allclose(mat.mean(0), 0) and np.allclose(mat.std(0), 1)
    doc = {"clients": {"C1": {"standardised": std["C1"].tolist()}}, "centroid": {"standardised": [0.0] * 14}}
    assert np.allclose(descriptor_for(doc, "C1", "holdout"), std["C1"])
    assert np.allclose(descriptor_for(doc, "", "test"), 0)


@pytest.mark.parametrize("split", ["validation", "test", "external"])
def test_global_cohorts_use_the_centroid(split):
    doc = {"clients": {}, "centroid": {"standardised": [1.0] * 14}}
    assert descriptor_for(doc, "", split).tolist() == [1.0] * 14
