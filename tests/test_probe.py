"""The stain-sensitivity probe on hand-made cases whose answers are known."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedhisto.config.study import ViewsConfig
from fedhisto.model.stain_probe import (
    ProbeError,
    _measures,
    image_list,
    pair_sensitivity,
    stain_pair,
    stain_sensitivity,
)
from fedhisto.stats.resampling import resample_weights

VIEWS = ViewsConfig(crop_size=32)


def _tissue_images(n: int, size: int = 32) -> list[tuple[str, np.ndarray]]:
    """Dark pink blobs on white at random places: every image its own layout, all one palette."""
    out = []
    for k in range(n):
        rng = np.random.default_rng(k)
        rgb = np.full((size, size, 3), 245, np.uint8)
        for _ in range(3):
            y, x = rng.integers(2, size - 10, 2)  # pixel-aligned blobs, no resize: no mixed edge pixels
            rgb[y:y + 8, x:x + 8] = (120, 40, 110)
        out.append((f"img{k}", rgb))
    return out


class _MaskEncoder:
    """Ignores colour entirely: the embedding is the tissue mask (grey level below the white background
    by a margin no stain draw of these images can cross), so both stain draws embed identically.
    Offers what the probe uses of a FrozenEncoder: ``module`` and ``embed``."""

    module = torch.nn.Identity()

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(VIEWS.mean).view(1, 3, 1, 1)
        std = torch.tensor(VIEWS.std).view(1, 3, 1, 1)
        grey = (pixel_values * std + mean).mean(1)
        mask = (grey < 0.6).float().flatten(1)
        return torch.cat([mask, torch.ones(len(mask), 1)], 1)


class _ColourEncoder:
    """Sees colour only: the image's mean colour (all images share a palette, so tissues look alike)."""

    module = torch.nn.Identity()

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return pixel_values.mean((2, 3)) + 3.0


def test_an_encoder_that_ignores_colour_gives_ratio_zero_and_perfect_retrieval():
    got = stain_sensitivity(_MaskEncoder(), _tissue_images(12), VIEWS, seed=3, resamples=200, bootstrap_seed=1)
    assert got["images"] == 12
    assert got["within"]["estimate"] == pytest.approx(0.0, abs=1e-12)
    assert got["ratio"]["estimate"] == pytest.approx(0.0, abs=1e-12)
    assert got["ratio"]["ci_high"] == pytest.approx(0.0, abs=1e-12)
    assert got["between"]["estimate"] > 0.1  # different layouts are far apart
    assert got["retrieval_top1"] == {"estimate": 1.0, "ci_low": 1.0, "ci_high": 1.0}


def test_an_encoder_that_sees_only_colour_is_moved_by_the_stain_draws():
    got = stain_sensitivity(_ColourEncoder(), _tissue_images(12), VIEWS, seed=3, resamples=200, bootstrap_seed=1)
    # the two draws of one image differ in colour about as much as two different images do
    assert got["ratio"]["estimate"] > 0.3
    assert got["ratio"]["ci_low"] <= got["ratio"]["estimate"] <= got["ratio"]["ci_high"]
    assert got["retrieval_top1"]["estimate"] < 0.75


def test_stain_draws_are_seeded_share_geometry_and_differ_in_colour():
    _, rgb = _tissue_images(1)[0]
    a, b = stain_pair(rgb, VIEWS, 5, "img0")
    a2, b2 = stain_pair(rgb, VIEWS, 5, "img0")
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert not torch.equal(a, b)
    assert tuple(a.shape) == (3, 32, 32)
    # only the stain differs: the tissue mask (dark vs white) is the same in both draws
    assert torch.equal(_MaskEncoder().embed(a[None]), _MaskEncoder().embed(b[None]))
    assert not torch.equal(stain_pair(rgb, VIEWS, 6, "img0")[0], a)


def test_known_embeddings_give_known_measures():
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(40, 16))
    same = pair_sensitivity(emb, emb.copy(), resamples=100, seed=0)
    assert same["ratio"]["estimate"] == pytest.approx(0.0, abs=1e-12)
    assert same["retrieval_top1"]["estimate"] == 1.0
    shuffled = pair_sensitivity(emb, emb[np.roll(np.arange(40), 1)], resamples=100, seed=0)
    assert shuffled["retrieval_top1"]["estimate"] == 0.0  # every partner is another tissue's embedding
    independent = pair_sensitivity(emb, rng.normal(size=(40, 16)), resamples=300, seed=0)
    assert independent["ratio"]["estimate"] == pytest.approx(1.0, abs=0.1)  # a redraw is as far as another tissue
    assert independent["ratio"]["ci_low"] < 1.0 < independent["ratio"]["ci_high"]
    assert independent["chance_retrieval"] == pytest.approx(1 / 40)
    # partial retrieval: the interval brackets the estimate (the gallery is never shrunk by resampling, which
    # would make every replicate easier than the full set and push the interval above the estimate)
    noisy = pair_sensitivity(emb, emb + rng.normal(scale=1.2, size=emb.shape), resamples=400, seed=0)
    assert 0.2 < noisy["retrieval_top1"]["estimate"] < 0.9
    assert noisy["retrieval_top1"]["ci_low"] < noisy["retrieval_top1"]["estimate"] < noisy["retrieval_top1"]["ci_high"]


def test_resampled_measures_equal_a_brute_force_recomputation_on_the_drawn_images():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(9, 5)), rng.normal(size=(9, 5))
    a[1] = b[1] + 0.01  # some true partners are nearest, some not
    b[4] = a[4]
    dist = 1 - (a / np.linalg.norm(a, axis=1, keepdims=True)) @ (b / np.linalg.norm(b, axis=1, keepdims=True)).T
    w = resample_weights(np.random.default_rng(2), 9, 5)
    labels = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2])
    got = _measures(dist, w, labels)
    for r in range(5):
        idx = np.repeat(np.arange(9), w[r].astype(int))  # the resample's images, duplicates included
        within = np.mean([dist[i, i] for i in idx])
        pairs = [dist[i, j] for i in idx for j in idx if i != j]
        # retrieval: each drawn query against the full gallery of 9 (a shrunk gallery would bias it upwards)
        hits = [np.mean([np.argmin(d[i]) == i for i in idx]) for d in (dist, dist.T)]
        assert got["within"][r] == pytest.approx(within)
        assert got["between"][r] == pytest.approx(np.mean(pairs))
        assert got["ratio"][r] == pytest.approx(within / np.mean(pairs))
        assert got["retrieval_top1"][r] == pytest.approx(np.mean(hits))
        same = [dist[i, j] for i in idx for j in idx if i != j and labels[i] == labels[j]]
        assert got["between_same_class"][r] == pytest.approx(np.mean(same) if same else np.nan, nan_ok=True)
        assert got["ratio_same_class"][r] == pytest.approx(within / np.mean(same) if same else np.nan, nan_ok=True)


def test_pair_sensitivity_refuses_what_it_cannot_measure():
    with pytest.raises(ProbeError, match="at least 3"):
        pair_sensitivity(np.ones((2, 4)), np.ones((2, 4)), 100, 0)
    with pytest.raises(ProbeError, match="one shape"):
        pair_sensitivity(np.ones((5, 4)), np.ones((4, 4)), 100, 0)
    with pytest.raises(ProbeError, match="all zeros"):
        pair_sensitivity(np.zeros((5, 4)), np.ones((5, 4)), 100, 0)


def test_image_list_reads_folders_and_csvs_and_names_bad_input(tmp_path: Path):
    folder = tmp_path / "imgs"
    (folder / "sub").mkdir(parents=True)
    for name in ("b.png", "sub/a.jpg", "c.png"):
        Image.new("RGB", (8, 8), "white").save(folder / name)
    (folder / "notes.txt").write_text("not an image")
    assert [(sid, label) for sid, _, label in image_list(folder)] == [("b.png", None), ("c.png", None),
                                                                       ("sub/a.jpg", None)]
    assert len(image_list(folder, limit=3)) == 3
    rows = [{"sample_id": f"s{k}", "path": str(folder / "b.png"), "split": "optimisation" if k < 3 else "test"}
            for k in range(5)]
    manifest = tmp_path / "m.csv"
    with manifest.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, ["sample_id", "path", "split"])
        writer.writeheader()
        writer.writerows(rows)
    assert [sid for sid, *_ in image_list(manifest, split="optimisation")] == ["s0", "s1", "s2"]
    with pytest.raises(ProbeError, match="1 image"):
        image_list(manifest, split="optimisation", limit=1)
    with pytest.raises(ProbeError, match="split applies to a manifest"):
        image_list(folder, split="test")
    bad = tmp_path / "bad.csv"
    bad.write_text("id,file\nx,y\n")
    with pytest.raises(ProbeError, match=r"bad.csv: no column \['path', 'sample_id'\]"):
        image_list(bad)
    with pytest.raises(ProbeError, match="not found"):
        image_list(tmp_path / "missing")


def test_probe_command_writes_summary_and_per_image_rows(tmp_path: Path):
    from fedhisto.cli import main
    from fedhisto.model.encoder import random_encoder

    folder = tmp_path / "imgs"
    folder.mkdir()
    for sid, rgb in _tissue_images(6):
        Image.fromarray(np.kron(rgb, np.ones((2, 2, 1), np.uint8))).save(folder / f"{sid}.png")
    torch.manual_seed(0)
    random_encoder("tiny").save(tmp_path / "enc")
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  encoder:\n    name: tiny\nviews:\n  crop_size: 48\n")
    rc = main(["probe-encoder", "--images", str(folder), "--out", str(tmp_path / "out"), "--config", str(config),
               "--encoder-dir", str(tmp_path / "enc"), "--resamples", "100"])
    assert rc == 0
    summary = json.loads((tmp_path / "out/probe.json").read_text())
    assert summary["images"] == 6 and summary["encoder"] == "tiny"
    assert 0 <= summary["retrieval_top1"]["estimate"] <= 1
    assert set(summary["provenance"]["inputs"]) == {"images", "encoder"}
    with (tmp_path / "out/per_image.csv").open() as fh:
        per_image = list(csv.DictReader(fh))
    assert [r["sample_id"] for r in per_image] == [f"img{k}.png" for k in range(6)]
    hits = np.mean([int(r["hit_a_to_b"]) + int(r["hit_b_to_a"]) for r in per_image]) / 2
    assert hits == pytest.approx(summary["retrieval_top1"]["estimate"])
    assert main(["probe-encoder", "--images", str(tmp_path / "none"), "--out", str(tmp_path / "o2"),
                 "--config", str(config), "--encoder-dir", str(tmp_path / "enc")]) == 2
