"""Device views (``fedhisto.data.device_views``) against the host path (``fedhisto.data.views``).

Tolerances, from measurements on synthetic tissue (fedhisto.synth, sensor noise and speckle, so the
hardest case for resampling differences), crop 96 from images of 120-200 px:
- draws: exact (same generator, same order, same float64 arithmetic);
- identity geometry: the grid hits pixel centres, so only float32 vs float64 stain math differs
  (measured below 1e-5 in [0, 1] RGB; bound 1e-4);
- random draws, two passes (default): the host rounds to uint8 after each interpolation, the device
  does not, about half a grey level on average (measured mean 0.0005-0.0022, max 0.005; bounds
  0.004 and 0.012, correlation > 0.999);
- random draws, one grid: one interpolation instead of two is sharper after a rotation (measured
  mean 0.004-0.031, correlation 0.964-0.989; bounds 0.05 and 0.95).
Checked that they can fail: a wrong rotation sense or a crop with top and left swapped gives mean
differences of 0.020-0.025 (5x the two-pass bound) and correlations of 0.25-0.40; a transposed OD
mix noise gives 0.057 on identity geometry (bound 1e-4).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedhisto.data.device_views as dv
import fedhisto.data.views as host
from fedhisto.config.study import ViewsConfig
from fedhisto.data.device_views import DeviceImages, ViewDraws, draw_stain, draw_views, render_views
from fedhisto.data.views import Geometry, stain_perturb, training_views
from fedhisto.synth.stain_styles import SITE_STYLES, render_rgb
from fedhisto.synth.tissue import tissue

CFG = ViewsConfig(crop_size=96)
IDS = [f"{k * 7919 + 12345:016x}" for k in range(4)]


def synth(label: str, site: str, edge: int, seed: int = 0, width: int | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    h, e = tissue(label, rng, edge, edge / 256)
    rgb = render_rgb(h, e, SITE_STYLES[site], rng, edge / 256)
    return np.ascontiguousarray(rgb[:, :width]) if width else rgb


@pytest.fixture(scope="module")
def images() -> list[np.ndarray]:
    # mixed sizes (one not square) so one call pads and crops per image
    return [synth("ACA", "site1", 192, 0), synth("SCC", "site2", 160, 1, width=140),
            synth("Normal", "site4", 200, 2), synth("ACA", "site5", 120, 3)]


def rgb01(t: torch.Tensor, cfg: ViewsConfig = CFG) -> torch.Tensor:
    """Normalised CHW (or ...CHW) back to [0, 1] RGB."""
    return t * torch.tensor(cfg.std).view(3, 1, 1) + torch.tensor(cfg.mean).view(3, 1, 1)


class Recorder:
    """Passes a generator's calls through and keeps what they returned."""

    def __init__(self, rng: np.random.Generator):
        self.rng, self.values = rng, []

    def __getattr__(self, name):
        fn = getattr(self.rng, name)

        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.values.append(np.asarray(out))
            return out
        return call


@pytest.mark.parametrize(("paired", "stain_single"), [(True, None), (False, None), (False, True), (False, False)])
def test_draws_equal_the_host_paths_draws(monkeypatch, images, paired, stain_single):
    cfg = CFG.model_copy(update={"single_view_stain": True}) if stain_single is None else CFG
    for sid, im in zip(IDS, images, strict=True):
        seen: dict = {"stains": [], "rngs": []}
        make_rng = host.view_rng

        def keep_rng(*args, seen=seen, make_rng=make_rng):
            seen["rngs"].append(make_rng(*args))
            return seen["rngs"][-1]

        def keep_geometry(rgb, g, size, seen=seen, orig=host.apply_geometry):
            seen["geometry"] = g
            return orig(rgb, g, size)

        def keep_stain(rgb, rng, c, seen=seen):
            rec = Recorder(rng)
            out = stain_perturb(rgb, rec, c)
            seen["stains"].append(rec.values)
            return out

        monkeypatch.setattr(host, "view_rng", keep_rng)
        monkeypatch.setattr(host, "apply_geometry", keep_geometry)
        monkeypatch.setattr(host, "stain_perturb", keep_stain)
        monkeypatch.setattr(dv, "view_rng", keep_rng)
        training_views(im, cfg, 5, 2, sid, paired, stain_single)
        draws = draw_views(5, 2, sid, im.shape[0], im.shape[1], cfg, paired, stain_single)
        host_rng, dev_rng = seen["rngs"]
        # nothing more and nothing less was drawn
        assert host_rng.bit_generator.state == dev_rng.bit_generator.state
        assert draws.geometry == seen["geometry"]
        assert len(draws.stains) == (2 if paired else 1)
        assert sum(s is not None for s in draws.stains) == len(seen["stains"])
        for stain, (noise, diag, bright, contrast) in zip([s for s in draws.stains if s], seen["stains"], strict=True):
            mix = np.eye(3) + noise
            mix[np.diag_indices(3)] *= diag
            assert np.array_equal(stain.mix, mix)
            assert (stain.brightness, stain.contrast) == (float(bright), float(contrast))
        monkeypatch.undo()


@pytest.mark.parametrize("two_pass", [True, False])
@pytest.mark.parametrize(("hflip", "vflip"), [(False, False), (True, False), (False, True), (True, True)])
def test_identity_geometry_stain_equals_host(two_pass, hflip, vflip):
    im = synth("SCC", "site3", 96, 7)
    g = Geometry(0, 0, 96, 96, hflip, vflip, 0.0)
    want = stain_perturb(host.apply_geometry(im, g, 96), np.random.default_rng(3), CFG)
    draws = ViewDraws(g, (draw_stain(np.random.default_rng(3), CFG),))
    got = rgb01(render_views(DeviceImages([im]), torch.tensor([0]), [draws], CFG, two_pass=two_pass)[0, 0])
    assert np.abs(got.permute(1, 2, 0).numpy() - want).max() < 1e-4


@pytest.mark.parametrize("two_pass", [True, False])
def test_flips_mirror_the_unflipped_view(images, two_pass):
    store, plain = DeviceImages(images[:1]), Geometry(11, 7, 170, 176, False, False, 0.0)

    def view(g):
        return rgb01(render_views(store, torch.tensor([0]), [ViewDraws(g, (None,))], CFG, two_pass=two_pass)[0, 0])

    ref = view(plain)
    for flags, dims in (((True, False), [2]), ((False, True), [1]), ((True, True), [1, 2])):
        flipped = view(Geometry(11, 7, 170, 176, *flags, 0.0))
        # the grid's pixel coordinates are the same numbers mirrored; grid_sample's normalisation
        # leaves float32 rounding (measured 4e-6 in [0, 1] RGB, a 1/1000 of a grey level)
        assert (flipped - torch.flip(ref, dims)).abs().max() < 1e-5
        assert not torch.allclose(flipped, ref, atol=1e-2)


@pytest.mark.parametrize(("two_pass", "mean_bound", "max_bound", "corr_bound"),
                         [(True, 0.004, 0.012, 0.999), (False, 0.05, None, 0.95)])
@pytest.mark.parametrize(("paired", "stain_single"), [(True, None), (False, True), (False, False)])
def test_random_views_match_host_in_one_mixed_size_call(images, two_pass, mean_bound, max_bound, corr_bound,
                                                        paired, stain_single):
    draws = [draw_views(3, 1, sid, im.shape[0], im.shape[1], CFG, paired, stain_single)
             for sid, im in zip(IDS, images, strict=True)]
    store = DeviceImages(images)
    assert store.data.shape == (4, 3, 200, 200) and store.heights == [192, 160, 200, 120]
    order = torch.tensor([2, 0, 3, 1])  # any order of the store's rows
    out = render_views(store, order, [draws[k] for k in order.tolist()], CFG, two_pass=two_pass)
    assert out.shape == (2 if paired else 1, 4, 3, 96, 96) and out.dtype == torch.float32
    for b, k in enumerate(order.tolist()):
        want = training_views(images[k], CFG, 3, 1, IDS[k], paired, stain_single)
        for v, w in enumerate(want):
            a, d = rgb01(w), rgb01(out[v, b])
            diff = (a - d).abs()
            assert diff.mean() < mean_bound
            assert max_bound is None or diff.max() < max_bound
            assert np.corrcoef(a.flatten().numpy(), d.flatten().numpy())[0, 1] > corr_bound


def test_a_row_does_not_depend_on_its_batch(images):
    draws = [draw_views(9, 0, sid, im.shape[0], im.shape[1], CFG, True) for sid, im in zip(IDS, images, strict=True)]
    store = DeviceImages(images)
    together = render_views(store, torch.arange(4), draws, CFG)
    alone = render_views(store, torch.tensor([2]), draws[2:3], CFG)
    assert (together[:, 2] - alone[:, 0]).abs().max() < 1e-5


def test_device_images_pad_and_reject_wrong_input(images):
    store = DeviceImages(images)
    assert store.widths == [192, 140, 200, 120] and len(store) == 4
    assert torch.equal(store.data[1].permute(1, 2, 0)[:160, :140], torch.from_numpy(images[1]))
    with pytest.raises(ValueError, match="uint8"):
        DeviceImages([images[0].astype(np.float32)])
