"""Per-unit gradients (fedhisto.privacy.per_sample) against single-image backward passes, the privacy
unit (both views of an image, a whole family) and dropout under vmap."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from fedhisto.config.study import ModelConfig
from fedhisto.fedmath.losses import feature_consistency, js_divergence, prototype_v1, prototype_v2
from fedhisto.methods.base import balanced_cross_entropy
from fedhisto.methods.past import PastUnitLoss
from fedhisto.model.encoder import random_encoder
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.privacy.dpsgd import clip_and_sum, flat_norms
from fedhisto.privacy.per_sample import dropout_disabled, per_image_gradients, per_unit_gradients

D = 64  # tiny encoder width


def _model(dropout: float = 0.0, dtype=torch.float64) -> FedHistoModel:
    torch.manual_seed(0)
    m = FedHistoModel(random_encoder("tiny"), ModelConfig(adapter_hidden=16, film_hidden=8, lora_dropout=dropout,
                                                          adapter_dropout=dropout), film=True).to(dtype)
    with torch.no_grad():  # LoRA B and FiLM's output start at zero: randomise so no gradient is trivially 0
        for p in m.parameters():
            if p.requires_grad:
                p.normal_(0, 0.2)
    return m.train()


def _loss() -> PastUnitLoss:
    g = torch.Generator().manual_seed(1)
    f64 = torch.float64
    return PastUnitLoss(ce_weights=torch.tensor([0.7, 1.0, 2.5], dtype=f64), weight_js=0.25, weight_feat=0.10,
                        weight_proto=0.05, prototypes="v2", centroids=torch.randn(3, D, generator=g, dtype=f64),
                        mask=torch.tensor([True, False, True]), reliability=torch.tensor([0.9, 0.0, 0.6], dtype=f64))


def _batch(n: int = 3, dtype=torch.float64):
    g = torch.Generator().manual_seed(2)
    views = torch.rand(n, 2, 3, 48, 48, generator=g, dtype=dtype)
    labels = torch.tensor([0, 1, 2, 0, 2][:n])
    return views, labels, torch.rand(1, 14, generator=g, dtype=dtype)


def _all(model) -> dict[str, None]:
    """The declaration of a method that trains every trainable tensor, unmasked."""
    return {n: None for n, p in model.named_parameters() if p.requires_grad}


def _single_backward(model, loss, views_i, y_i, desc) -> dict[str, torch.Tensor]:
    model.zero_grad()
    logits, z = model(views_i, desc)
    loss(logits, z, y_i).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_per_image_gradients_equal_single_image_backward_passes_float64():
    model, loss = _model(), _loss()
    views, labels, desc = _batch()
    per_image = per_image_gradients(model, loss, views, labels, desc, trained=_all(model), dropout="off")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(per_image) == sorted(names) and len(names) == 36  # 24 LoRA, adapter 6, FiLM 4, classifier 2
    for i in range(len(labels)):
        ref = _single_backward(model, loss, views[i], labels[i], desc)
        for n in names:
            assert ref[n].abs().max() > 0, n  # every tensor really receives gradient
            torch.testing.assert_close(per_image[n][i], ref[n], rtol=1e-9, atol=1e-12)


def test_per_image_gradients_float32_close_to_float64():
    model64, loss64 = _model(), _loss()
    views, labels, desc = _batch()
    ref = per_image_gradients(model64, loss64, views, labels, desc, trained=_all(model64), dropout="off")
    model32 = copy.deepcopy(model64).float()
    loss32 = dataclasses.replace(loss64, ce_weights=loss64.ce_weights.float(), centroids=loss64.centroids.float(),
                                 reliability=loss64.reliability.float())
    got = per_image_gradients(model32, loss32, views.float(), labels, desc.float(), trained=_all(model32),
                              dropout="off")
    rel = (flat_norms({n: got[n].double() - ref[n] for n in ref}) / flat_norms(ref)).max()
    assert rel < 1e-4  # float32 round-off through a 3-block ViT, relative to each image's gradient norm


def test_unit_loss_is_the_method_objective_on_one_image():
    """Per image, PastUnitLoss equals the batch losses of fedmath/methods on a batch of that image alone;
    over a batch, the images' mean equals the batch CE + JS + feature terms."""
    model, loss = _model(), _loss()
    views, labels, desc = _batch(4)
    with torch.no_grad():
        outs = [model(views[:, v], desc) for v in range(2)]
    logits, zs = [o[0] for o in outs], [o[1] for o in outs]
    c, m, r = loss.centroids, loss.mask, loss.reliability
    for i in range(4):
        lg, z, y = [x[i:i + 1] for x in logits], [x[i:i + 1] for x in zs], labels[i:i + 1]
        ref = (sum(balanced_cross_entropy(v, y, loss.ce_weights, 1) for v in lg) / 2 + 0.25 * js_divergence(*lg)
               + 0.10 * feature_consistency(*z) + 0.05 * sum(prototype_v2(v, y, c, m, r, 0.2) for v in z) / 2)
        got = loss(torch.cat(lg), torch.cat(z), labels[i])
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    no_proto = PastUnitLoss(ce_weights=loss.ce_weights, weight_js=0.25, weight_feat=0.10)
    batch = (sum(balanced_cross_entropy(v, labels, loss.ce_weights, 4) for v in logits) / 2
             + 0.25 * js_divergence(*logits) + 0.10 * feature_consistency(*zs))
    mean = sum(no_proto(torch.stack([logits[0][i], logits[1][i]]), torch.stack([zs[0][i], zs[1][i]]), labels[i])
               for i in range(4)) / 4
    torch.testing.assert_close(mean, batch, rtol=1e-6, atol=0)  # js_divergence works in float32
    zero_ce = torch.zeros(3, dtype=torch.float64)
    v1 = PastUnitLoss(ce_weights=zero_ce, weight_proto=1.0, prototypes="v1", centroids=c, mask=m)
    for i in range(4):  # label 1 has no prototype: contributes exactly 0
        ref = sum(prototype_v1(v[i:i + 1], labels[i:i + 1], c, m) for v in zs) / 2
        torch.testing.assert_close(v1(torch.stack([x[i] for x in logits]), torch.stack([x[i] for x in zs]), labels[i]),
                                   ref)


def test_two_views_of_an_image_are_clipped_as_one_sample():
    """One gradient per image (not per view), and after clipping the image's two views together
    contribute at most C: the contribution is the two-view gradient scaled to norm C."""
    model, loss = _model(), _loss()
    views, labels, desc = _batch()
    per_image = per_image_gradients(model, loss, views, labels, desc, trained=_all(model), dropout="off")
    assert all(g.shape[0] == 3 for g in per_image.values())  # 3 images with 2 views each: 3 samples
    norms = flat_norms(per_image)
    clip = 0.5 * float(norms.min())  # binds for every image
    for i in range(3):
        whole = _single_backward(model, loss, views[i], labels[i], desc)  # both views in one loss
        clipped, _ = clip_and_sum({n: g[i:i + 1] for n, g in per_image.items()}, clip)
        assert float(flat_norms({n: g[None] for n, g in clipped.items()})) == pytest.approx(clip, rel=1e-9)
        scale = clip / float(flat_norms({n: g[None] for n, g in whole.items()}))
        for n in whole:
            torch.testing.assert_close(clipped[n], whole[n] * scale, rtol=1e-8, atol=1e-12)
        # clipping each view on its own would let the image contribute up to 2C
        per_view = [per_image_gradients(model, loss, views[i:i + 1, v:v + 1], labels[i:i + 1], desc,
                                        trained=_all(model), dropout="off")
                    for v in range(2)]
        separate = [clip_and_sum(g, clip)[0] for g in per_view]
        combined = {n: separate[0][n] + separate[1][n] for n in separate[0]}
        assert float(flat_norms({n: g[None] for n, g in combined.items()})) > 1.2 * clip


def test_family_unit_gradient_is_the_sum_over_its_images():
    model, loss = _model(), _loss()
    views, labels, desc = _batch(3)
    per_image = per_image_gradients(model, loss, views, labels, desc, trained=_all(model), dropout="off")
    per_unit = per_unit_gradients(model, loss, views, labels, torch.tensor([1, 0, 1]), 2, desc, trained=_all(model),
                                  dropout="off",
                                  chunk_size=2)
    for n, g in per_image.items():
        torch.testing.assert_close(per_unit[n][1], g[0] + g[2], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(per_unit[n][0], g[1], rtol=1e-10, atol=1e-12)
    clipped, _ = clip_and_sum(per_unit, 1e-3)
    assert float(flat_norms({n: g[None] for n, g in clipped.items()})) <= 2e-3 * (1 + 1e-9)  # two units, C each


def test_dropout_per_sample_draws_independent_masks_and_off_is_deterministic():
    model, loss = _model(dropout=0.5), _loss()
    views, labels, desc = _batch(2)
    twins, twin_labels = views[[0, 0]], labels[[0, 0]]  # the same image twice
    torch.manual_seed(5)
    a = per_image_gradients(model, loss, twins, twin_labels, desc, trained=_all(model), dropout="per_sample")
    diff = flat_norms({n: g[0:1] - g[1:2] for n, g in a.items()})
    assert float(diff) > 1e-3 * float(flat_norms({n: g[0:1] for n, g in a.items()}))  # masks differ per image
    torch.manual_seed(5)
    b = per_image_gradients(model, loss, twins, twin_labels, desc, trained=_all(model), dropout="per_sample")
    for n in a:  # reproducible from the torch seed
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=0)
    off = per_image_gradients(model, loss, twins, twin_labels, desc, trained=_all(model), dropout="off")
    for n in off:
        torch.testing.assert_close(off[n][0], off[n][1], rtol=0, atol=0)
    assert all(m.training for m in model.modules())  # dropout switched back on after the 'off' pass
    with dropout_disabled(model):
        ref = _single_backward(model, loss, views[0], labels[0], desc)
    for n in off:
        torch.testing.assert_close(off[n][0], ref[n], rtol=1e-9, atol=1e-12)


def test_bad_inputs_are_refused():
    model, loss = _model(), _loss()
    views, labels, desc = _batch(2)
    with pytest.raises(ValueError, match="images, views"):
        per_image_gradients(model, loss, views[:, 0], labels, desc, trained=_all(model))
    with pytest.raises(ValueError, match=r"privacy\.dropout"):
        per_image_gradients(model, loss, views, labels, desc, trained=_all(model), dropout="sometimes")
    model.bn = torch.nn.BatchNorm1d(3)
    with pytest.raises(ValueError, match="batch normalisation"):
        per_image_gradients(model, loss, views, labels, desc, trained=_all(model))
