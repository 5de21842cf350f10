"""DP-SGD step pieces (fedhisto.privacy.dpsgd): units, Poisson sampling, packing, clipping, noise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhisto.privacy.dpsgd import (
    NoisyGradientSum,
    clip_and_sum,
    flat_norms,
    noise_generator,
    pack_micro_batches,
    poisson_sample,
    privacy_units,
    steps_per_epoch,
)


def test_units_image_and_family():
    ids = ["a", "b", "c", "d", "e"]
    img = privacy_units(ids, "image")
    assert img.n_units == 5 and img.unit_of.tolist() == [0, 1, 2, 3, 4]
    fam = privacy_units(ids, "family", {"a": "F1", "b": "F2", "c": "F1", "d": "F3", "e": "F2"})
    assert fam.names == ["F1", "F2", "F3"] and fam.unit_of.tolist() == [0, 1, 0, 2, 1]
    assert fam.sizes().tolist() == [2, 2, 1] and fam.images_of(1).tolist() == [1, 4]
    with pytest.raises(ValueError, match="2 images have no family"):
        privacy_units(ids, "family", {"a": "F1", "b": "F2", "c": "F1"})
    with pytest.raises(ValueError, match="'image' or 'family'"):
        privacy_units(ids, "patient")


def test_poisson_sampling_rate_and_independence():
    rng = np.random.default_rng(0)
    n, q, draws = 2000, 0.05, 200
    sizes = [poisson_sample(n, q, rng).size for _ in range(draws)]
    # mean of 200 Binomial(2000, 0.05) sizes: sd of the mean = sqrt(2000 * 0.05 * 0.95 / 200) = 0.69
    assert np.mean(sizes) == pytest.approx(n * q, abs=4 * 0.69)
    assert np.std(sizes) == pytest.approx(np.sqrt(n * q * (1 - q)), rel=0.2)  # random size, not fixed
    assert poisson_sample(10, 1.0, rng).tolist() == list(range(10))
    with pytest.raises(ValueError, match="sample_rate"):
        poisson_sample(10, 0.0, rng)
    assert steps_per_epoch(0.05) == 20 and steps_per_epoch(0.8) == 1


def test_micro_batches_hold_whole_units():
    sizes = [1, 3, 2, 5, 1, 1]
    packs = pack_micro_batches([0, 1, 2, 3, 4, 5], sizes, max_images=4)
    assert packs == [[0, 1], [2], [3], [4, 5]]  # unit 3 (5 images) alone; no unit ever split
    assert sorted(u for p in packs for u in p) == [0, 1, 2, 3, 4, 5]
    assert pack_micro_batches([], sizes, 4) == []


def test_clip_and_sum_by_hand():
    per_unit = {"a": torch.tensor([[3.0, 0.0], [0.3, 0.0]]), "b": torch.tensor([[[4.0]], [[0.4]]])}
    summed, norms = clip_and_sum(per_unit, 1.0)
    assert norms.tolist() == pytest.approx([5.0, 0.5])
    # unit 0 scaled by 1/5 (norm over BOTH tensors), unit 1 untouched
    assert summed["a"].tolist() == pytest.approx([0.6 + 0.3, 0.0])
    assert summed["b"].flatten().tolist() == pytest.approx([0.8 + 0.4])


def test_noisy_gradient_sum_mean_and_noise_scale():
    like = {"w": torch.zeros(200_000)}
    acc = NoisyGradientSum(clip_norm=2.0, noise_multiplier=0.5, expected_units=10.0)
    acc.add({"w": torch.full((3, 200_000), 1e-3)})  # norms 0.447 < C: unclipped
    acc.add({"w": torch.full((1, 200_000), 1.0)})   # norm 447 > C: scaled to 2
    assert acc.units == 4 and acc.clipped == 1
    gen, seed = noise_generator("cpu", seed=7)
    out = acc.release(like, gen)["w"]
    signal = (3e-3 + 2.0 / np.sqrt(200_000)) / 10.0
    assert float(out.mean()) == pytest.approx(signal, abs=4 * 1.0 / 10 / np.sqrt(200_000))
    assert float(out.std()) == pytest.approx(0.5 * 2.0 / 10.0, rel=0.01)  # sigma C / (q N); 200k draws: 0.3 %
    assert acc.units == 0 and acc.total == {}  # reset for the next logical batch
    gen2, _ = noise_generator("cpu", seed=seed)
    empty = NoisyGradientSum(2.0, 0.5, 10.0).release(like, gen2)["w"]  # an empty Poisson batch: noise only
    torch.testing.assert_close(empty * 10.0, torch.randn(200_000, generator=torch.Generator().manual_seed(7)) * 1.0)
    _, secret = noise_generator("cpu")
    _, secret2 = noise_generator("cpu")
    assert secret != secret2 and secret != seed


def test_clipped_norms_are_bounded():
    g = torch.Generator().manual_seed(3)
    per_unit = {"a": torch.randn(50, 7, generator=g) * 10, "b": torch.randn(50, 3, 2, generator=g)}
    _, norms = clip_and_sum(per_unit, 1.5)
    single = [clip_and_sum({k: v[i:i + 1] for k, v in per_unit.items()}, 1.5)[0] for i in range(50)]
    each = flat_norms({k: torch.stack([s[k] for s in single]) for k in per_unit})
    assert float(each.max()) == pytest.approx(1.5, rel=1e-6) and bool((norms > 1.5).all())


def test_logical_step_without_noise_or_clipping_is_the_plain_gradient():
    """sigma = 0 and a clip norm no gradient reaches: the step is grad(sum of unit losses) / (q N), whatever
    the packing into micro-batches; with noise it is that plus N(0, (sigma C / (q N))^2)."""
    from fedhisto.config.study import ModelConfig
    from fedhisto.methods.past import PastUnitLoss
    from fedhisto.model.encoder import random_encoder
    from fedhisto.model.peft_model import FedHistoModel
    from fedhisto.privacy.step import logical_step, set_gradients

    torch.manual_seed(0)
    model = FedHistoModel(random_encoder("tiny"), ModelConfig(adapter_hidden=16, lora_dropout=0.0, adapter_dropout=0.0),
                          film=False).double().train()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.2)
    g = torch.Generator().manual_seed(1)
    views, labels = torch.rand(6, 2, 3, 48, 48, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    units = privacy_units([f"i{k}" for k in range(6)], "family", {"i0": "A", "i1": "B", "i2": "A", "i3": "C",
                                                                   "i4": "D", "i5": "D"})
    loss = PastUnitLoss(ce_weights=torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64), weight_js=0.25, weight_feat=0.1)
    fetched = []

    def fetch(idx):
        fetched.append(idx.tolist())
        return views[idx], labels[idx]

    selected = np.array([0, 2, 3])  # families A (i0, i2), C (i3), D (i4, i5); B not sampled
    acc = NoisyGradientSum(clip_norm=1e9, noise_multiplier=0.0, expected_units=2.0)
    trained = {n: None for n, p in model.named_parameters() if p.requires_grad}
    got = logical_step(model, loss, units, selected, fetch, acc, torch.Generator(), trained=trained, micro_batch=3,
                       dropout="off")
    assert fetched == [[0, 2, 3], [4, 5]]  # whole families per micro-batch
    model.zero_grad()
    sum(loss(*model(views[i]), labels[i]) for i in (0, 2, 3, 4, 5)).backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(got[n], p.grad / 2.0, rtol=1e-9, atol=1e-13)
    set_gradients(model, got, trained)
    assert all(torch.equal(p.grad, got[n]) for n, p in model.named_parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="does not fit the declared trained tensors"):
        set_gradients(model, {k: v for k, v in list(got.items())[1:]}, trained)
