from __future__ import annotations

import csv
import dataclasses
import json
from collections import Counter
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedhisto.config.study import load_config
from fedhisto.experiments.severity_render import (
    plan_shift,
    render_shift_cohort,
    render_styles,
    run_render_shift,
    tissue_maps,
)
from fedhisto.synth.stain_styles import JPEG_QUALITY_RANGE, SITE_STYLES, style_at

ANCHORS = [s for s in SITE_STYLES if s != "external"]
# small tiles and the minimum tissues per class keep the rendering to about a second
SMALL = {"cohort": {"synthetic": {"external_image_size": 64}},
         "experiments": {"dose_response": {"images_per_class": 5}}}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("shift")
    return out, run_render_shift(load_config(SMALL), out)


def read_rows(path: Path) -> list[dict]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


@pytest.mark.parametrize("anchor", ANCHORS)
def test_severity_zero_is_the_anchor_and_one_the_external_site(anchor: str):
    for severity, expected in ((0, SITE_STYLES[anchor]), (0.0, SITE_STYLES[anchor]), (1.0, SITE_STYLES["external"])):
        got = style_at(severity, anchor)
        for field in dataclasses.fields(expected):
            assert getattr(got, field.name) == getattr(expected, field.name), (severity, field.name)
    half, a, b = style_at(0.5, anchor), SITE_STYLES[anchor], SITE_STYLES["external"]
    assert half.h_gain == pytest.approx((a.h_gain + b.h_gain) / 2)
    assert half.blur_sigma == pytest.approx((a.blur_sigma + b.blur_sigma) / 2)
    assert half.illuminant == pytest.approx(tuple((x + y) / 2 for x, y in zip(a.illuminant, b.illuminant, strict=True)))


@pytest.mark.parametrize("anchor", ANCHORS)
@pytest.mark.parametrize("severity", [2.0, 3.0, 6.0])
def test_extrapolated_styles_stay_physical(anchor: str, severity: float):
    s = style_at(severity, anchor)
    for vec in (s.hematoxylin, s.eosin):
        assert np.linalg.norm(vec) == pytest.approx(1.0) and min(vec) >= 0.01 - 1e-12
    assert s.h_gain >= 0.05 and s.e_gain >= 0.05 and s.gamma >= 0.3
    assert s.blur_sigma >= 0 and s.noise_sd >= 0 and all(0 <= c <= 255 for c in s.illuminant)
    assert isinstance(s.jpeg_quality, int) and JPEG_QUALITY_RANGE[0] <= s.jpeg_quality <= JPEG_QUALITY_RANGE[1]
    with pytest.raises(ValueError, match=">= 0"):
        style_at(-0.5, anchor)


def unmix(rgb: np.ndarray, style) -> tuple[np.ndarray, np.ndarray]:
    """Beer-Lambert inverse for a blur-free, noise-free, linear-tone rendering: H and E concentrations."""
    od = -np.log(np.maximum(rgb.astype(float), 0.5) / np.asarray(style.illuminant, float))
    basis = np.stack([np.asarray(style.hematoxylin) * style.h_gain, np.asarray(style.eosin) * style.e_gain], 1)
    conc, *_ = np.linalg.lstsq(basis, od.reshape(-1, 3).T, rcond=None)
    return conc[0].reshape(rgb.shape[:2]), conc[1].reshape(rgb.shape[:2])


def test_every_severity_renders_the_same_tissue():
    shift = load_config(SMALL).experiments.dose_response
    severities = [0.0, 1.0, 2.0]
    # scanner blur, tone curve and noise off: the rendering is then invertible to concentrations
    styles = [dataclasses.replace(style_at(s), blur_sigma=0.0, noise_sd=0.0, gamma=1.0) for s in severities]
    tissues = plan_shift(shift)
    for t, other in ((tissues[0], tissues[1]), (tissues[7], tissues[12])):
        h_true, e_true, _ = tissue_maps(t, shift.seed, 64)
        recovered = [unmix(rgb, style) for rgb, style in render_styles(t, shift.seed, 64, styles)]
        h_other, _, _ = tissue_maps(other, shift.seed, 64)
        # unsaturated pixels only: uint8 rounding and clipping lose the concentration elsewhere
        ok = (h_true + e_true) < 1.5
        for h, e in recovered:
            assert np.corrcoef(h[ok], h_true[ok])[0, 1] > 0.98
            assert np.corrcoef(e[ok], e_true[ok])[0, 1] > 0.98
        (h0, _), (h2, _) = recovered[0], recovered[-1]
        assert np.corrcoef(h0[ok], h2[ok])[0, 1] > 0.98
        assert np.corrcoef(h0[ok], h_other[ok])[0, 1] < 0.5, "a different tissue must not pass as the same one"


def test_colour_distance_from_the_anchor_grows_with_severity(rendered):
    out, _ = rendered
    rows = read_rows(out / "cohort.csv")
    by_tissue: dict[str, dict[float, np.ndarray]] = {}
    for r in rows:
        by_tissue.setdefault(r["tissue_id"], {})[float(r["severity"])] = np.asarray(Image.open(r["path"]), float)
    for tid in list(by_tissue)[::3]:  # five tissues across the three classes
        images = by_tissue[tid]
        distance = [np.linalg.norm(images[s] - images[0.0], axis=-1).mean() for s in (0.0, 0.5, 1.0, 1.5, 2.0)]
        assert all(b > a + 1.0 for a, b in pairwise(distance)), (tid, distance)


def test_rows_pair_every_tissue_across_severities(rendered):
    out, summary = rendered
    rows = read_rows(out / "cohort.csv")
    severities = [0.0, 0.5, 1.0, 1.5, 2.0]
    assert len(rows) == 3 * 5 * len(severities) == summary["images"]
    assert len({r["sample_id"] for r in rows}) == len(rows)
    assert summary["images_per_severity"] == {"s0": 15, "s0.5": 15, "s1": 15, "s1.5": 15, "s2": 15}
    by_tissue: dict[str, list[dict]] = {}
    for r in rows:
        by_tissue.setdefault(r["tissue_id"], []).append(r)
        assert Path(r["path"]).is_absolute() and Path(r["path"]) == out.resolve() / "images" / r["relpath"]
        assert r["relpath"].startswith(f"s{float(r['severity']):g}/") and Path(r["path"]).is_file()
    assert len(by_tissue) == 15
    for group in by_tissue.values():
        assert sorted(float(r["severity"]) for r in group) == severities
        assert len({(r["label"], r["differentiation"], r["magnification"]) for r in group}) == 1
    tissues = [g[0] for g in by_tissue.values()]
    assert Counter(t["label"] for t in tissues) == {"ACA": 5, "Normal": 5, "SCC": 5}
    assert Counter(t["differentiation"] for t in tissues if t["label"] == "SCC") == {"well": 2, "moderately": 2,
                                                                                     "poorly": 1}
    assert {t["differentiation"] for t in tissues if t["label"] == "Normal"} == {""}
    assert Counter(t["magnification"] for t in tissues if t["label"] == "ACA") == {"20x": 3, "40x": 2}


def test_outputs_carry_provenance_and_a_contact_sheet(rendered):
    out, summary = rendered
    prov = json.loads((out / "cohort.csv.prov.json").read_text())
    assert prov["stage"] == "experiments" and prov["inputs"] == {}
    with Image.open(out / "contact_sheet.png") as sheet:
        assert sheet.width > 5 * 64 and sheet.height > 6 * 64  # five severities by two tissues of three classes
    assert summary["styles"]["s1"]["jpeg_quality"] == SITE_STYLES["external"].jpeg_quality


def test_same_config_gives_identical_bytes_serial_or_parallel(tmp_path: Path, rendered):
    out, _ = rendered
    cfg = load_config(SMALL)
    rows = render_shift_cohort(cfg.cohort.synthetic, cfg.experiments.dose_response, tmp_path, threads=2)
    reference = read_rows(out / "cohort.csv")
    assert [r["sample_id"] for r in rows] == [r["sample_id"] for r in reference]
    for mine, theirs in zip(rows, reference, strict=True):
        assert Path(mine["path"]).read_bytes() == Path(theirs["path"]).read_bytes(), mine["relpath"]
    other = load_config({**SMALL, "experiments": {"dose_response": {"images_per_class": 5, "seed": 7}}})
    moved = render_shift_cohort(other.cohort.synthetic, other.experiments.dose_response, tmp_path / "b")
    assert Path(moved[0]["path"]).read_bytes() != Path(rows[0]["path"]).read_bytes(), "the shift seed must matter"


def test_severities_share_the_slide_jitter_and_noise_draw():
    shift = load_config(SMALL).experiments.dose_response
    t = plan_shift(shift)[4]
    bases = [style_at(s) for s in (0.0, 0.5, 2.0)]
    jittered = [style for _, style in render_styles(t, shift.seed, 64, bases)]
    for base, style in zip(bases, jittered, strict=True):  # the same uptake jitter factor at every severity
        assert style.h_gain / base.h_gain == pytest.approx(jittered[0].h_gain / bases[0].h_gain)
        assert style.e_gain / base.e_gain == pytest.approx(jittered[0].e_gain / bases[0].e_gain)
    assert jittered[0].hematoxylin != bases[0].hematoxylin, "the slide jitter must act"
    # the noise field is one draw scaled by the severity's noise level
    quiet, noisy, louder = (dataclasses.replace(bases[0], noise_sd=n) for n in (0.0, 4.0, 8.0))
    rgb0, rgb4, rgb8 = (rgb.astype(float) for rgb, _ in render_styles(t, shift.seed, 64, [quiet, noisy, louder]))
    inside = ((rgb0 > 30) & (rgb0 < 220)).all(-1)  # away from the clip at 0 and 255
    assert np.corrcoef((rgb4 - rgb0)[inside].ravel(), (rgb8 - rgb0)[inside].ravel())[0, 1] > 0.95
