"""FedStain (its paper's Algorithms 1-2 and eq. 1-6) and ``fedstain_code`` (its authors' public code,
onism-dev/Fedstain at cc6056e), against their formulas written afresh in numpy, with scipy's sample
moments as the reference for skewness and kurtosis:

- the statistics a client uploads before training: ceil(r n_i) images' channel mean and deviation of
  the RGB pixels and skewness and kurtosis of the restyle block's token features (``fedstain``);
  floor(r n_i) images' pixel skewness and excess kurtosis with the code's unbiased-variance deviation,
  clamped to +-10 (``fedstain_code``);
- the server's pool for each client: every other client's rows (Algorithm 2, lines 8-9);
- MixStyle with higher-order statistics (Algorithm 1) on one view's token features;
- one micro-batch of the objective: CE + alpha L_RA (SupCon, eq. 3-4) + beta L_JS (eq. 5) over the four
  views (``fedstain``); CE on three views + 0.1 JS (mixture clamped at 1e-7) + 0.1 the code's SupCon of
  each generated view against the originals, the anchor among its own positives (``fedstain_code``).

The server step itself (FedAvg by sample mass, delta-SVD) is checked against Flower in
``test_reference_flower.py``. The views (RandStain, AugMix, the code's pixel shift) are random draws of
the engine's view stream and are not checked here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from reference_support import (
    Reference,
    build,
    check,
    class_weights,
    drive_round,
    members_of,
    model_for,
    objective_terms,
    perturbed,
    restyle,
    restyle_block,
    split,
    trainable_state,
    upload_before_training,
)
from scipy import stats

pytestmark = pytest.mark.reference

REFERENCES = [
    Reference("method", "fedstain", "FedStain's statistics, pool and MixStyle (Algorithms 1-2; scipy moments; relative)",
              "test_fedstain_statistics_pool_and_mixstyle"),
    Reference("method", "fedstain", "FedStain's objective (eq. 3-6) in numpy", "test_fedstain_objective"),
    Reference("method", "fedstain_code", "the authors' code's statistics and pool in numpy",
              "test_fedstain_code_statistics_and_pool"),
    Reference("method", "fedstain_code", "the authors' code's objective in numpy", "test_fedstain_code_objective"),
]

# The statistics and losses are computed in float32, and every moment divides by the channel's variance
# plus 1e-6 (a stabiliser): relative to the largest value (or absolute below 1), a few 1e-6 at the
# variances here.
F32 = 1e-5


def relative(ours: np.ndarray, ref: np.ndarray) -> float:
    """The largest difference relative to the largest reference value (absolute where that is below 1)."""
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1.0))


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _balanced_ce(logits: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    return float((w[y] * -np.log(_softmax(logits)[np.arange(len(y)), y])).sum() / len(y))


def _eval_pixels(method, data, idx) -> np.ndarray:
    """The sampled images as the method sees them for its statistics (the evaluation view), in RGB on [0, 1]."""
    from fedhisto.data.views import eval_view

    views = method.cfg.views
    x = np.stack([eval_view(data.images[i], views).numpy() for i in idx])
    return np.clip(x * np.asarray(views.std)[:, None, None] + np.asarray(views.mean)[:, None, None], 0, 1)


def _three_clients(method, upload):
    """One round through the round driver with each client's pre-training upload; returns it."""
    model = model_for(method, dtype=torch.float32)
    x = trainable_state(model)
    data = {"C1": split(10, 1), "C2": split(7, 2), "C3": split(12, 3)}
    got = drive_round(method, model, members_of(method, list(data), x), list(data),
                      lambda n, start, payload: (perturbed(start, seed=len(n)), len(data[n]), 2),
                      pre=lambda n, start: upload(model, start, data[n], int(n[1:])))
    return model, data, got


def test_fedstain_statistics_pool_and_mixstyle(request):
    method = build("fedstain")
    captured = {}

    def upload(model, start, data, seed):
        hook = restyle_block(method, model).register_forward_hook(
            lambda mod, inp, out: captured.__setitem__(seed, (out[0] if isinstance(out, tuple) else out).detach()))
        try:
            got = upload_before_training(method, model, start, data, seed)
        finally:
            hook.remove()
        captured[f"up{seed}"] = got
        return got

    _, data, got = _three_clients(method, upload)
    r, worst = method.settings.upload_ratio, 0.0
    for n in sorted(data):
        seed = int(n[1:])
        count = math.ceil(r * len(data[n]))                     # Algorithm 2, line 5
        idx = sorted(np.random.default_rng(seed).choice(len(data[n]), size=count, replace=False).tolist())
        pixels = _eval_pixels(method, data[n], idx).reshape(count, 3, -1)
        feats = captured[seed].double().numpy().transpose(0, 2, 1)   # (images, channels, tokens)
        ours = captured[f"up{seed}"]
        ref = [pixels.mean(2), pixels.std(2), stats.skew(feats, axis=2), stats.kurtosis(feats, axis=2, fisher=False)]
        for mine, expected in zip((ours.pixel_mean, ours.pixel_std, ours.feat_skew, ours.feat_kurt), ref, strict=True):
            worst = max(worst, relative(mine.double().numpy(), expected))
    for n in sorted(data):  # each client's pool: the other clients' rows, in client order (Algorithm 2, lines 8-9)
        pool = got.payloads[n]["style_pool"]
        others = [captured[f"up{int(m[1:])}"] for m in sorted(data) if m != n]
        for field in ("pixel_mean", "pixel_std", "feat_skew", "feat_kurt"):
            expected = np.concatenate([getattr(o, field).numpy() for o in others])
            assert np.array_equal(getattr(pool, field).numpy(), expected), (n, field)
    # MixStyle on one view's tokens (Algorithm 1): x_hat = gamma_mix (x - mu) / sigma + beta_mix with
    # beta_mix = lam S' + (1 - lam) S(x), gamma_mix = lam K' + (1 - lam) K(x), lam ~ Beta(alpha, alpha) and
    # (S', K') one pooled row per image, drawn from the view's generator (rows, then lam)
    pool = got.payloads["C1"]["style_pool"]
    hidden = torch.randn(4, 17, 64, generator=torch.Generator().manual_seed(3)) * 0.7 + 0.2
    ours = restyle(method, hidden, pool, np.random.default_rng(8)).double().numpy()
    rng = np.random.default_rng(8)
    rows = rng.integers(len(pool.feat_skew), size=4)
    lam = rng.beta(method.settings.mixstyle_alpha, method.settings.mixstyle_alpha, size=(4, 1))
    x = hidden.double().numpy().transpose(0, 2, 1)
    beta_mix = lam * pool.feat_skew[rows].double().numpy() + (1 - lam) * stats.skew(x, axis=2)
    gamma_mix = lam * pool.feat_kurt[rows].double().numpy() + (1 - lam) * stats.kurtosis(x, axis=2, fisher=False)
    expected = gamma_mix[..., None] * (x - x.mean(2, keepdims=True)) / x.std(2, keepdims=True) + beta_mix[..., None]
    worst = max(worst, relative(ours, expected.transpose(0, 2, 1)))
    check(request, "method", "fedstain", worst, F32)


def supcon_paper(z: np.ndarray, labels: np.ndarray, tau: float) -> float:
    """Eq. 3 (Khosla et al. 2020's L_out) with cosine similarity over the anchors I = every sample:
    sum_i -1/|P(i)| sum_{p in P(i)} log(exp(s_ip / tau) / sum_{a != i} exp(s_ia / tau)), divided by the
    number of anchors that have a positive (the method's documented reading of the sum as a mean)."""
    z = _unit(z)
    sim = z @ z.T / tau
    total, anchors = 0.0, 0
    for i in range(len(z)):
        others = [a for a in range(len(z)) if a != i]
        positives = [p for p in others if labels[p] == labels[i]]
        if not positives:
            continue
        log_denominator = np.log(np.exp(sim[i, others]).sum())
        total += -np.mean([sim[i, p] - log_denominator for p in positives])
        anchors += 1
    return total / anchors


def test_fedstain_objective(request):
    """Four views (X, X_stain, X(1), X(2)) of six images: L = CE(X) + alpha (1/3) sum_X SupCon(Z, X) +
    beta (1/4) sum_v KL(Y_v || mean Y), alpha 0.10 and beta 0.25 (the paper tunes them; fedhisto's defaults)."""
    method = build("fedstain")
    s = method.settings
    g = np.random.default_rng(2)
    y = np.array([0, 1, 2, 0, 2, 1])
    logits = [g.normal(size=(6, 3)) for _ in range(4)]
    zs = [g.normal(size=(6, 64)) for _ in range(4)]
    w = class_weights(method, [30, 12, 3])
    terms = objective_terms(method, [torch.from_numpy(v) for v in logits], [torch.from_numpy(v) for v in zs],
                            torch.from_numpy(y), w)
    probs = [_softmax(lg) for lg in logits]
    mean = sum(probs) / 4
    expected = {
        "ce": _balanced_ce(logits[0], y, w.double().numpy()),
        "supcon": s.weight_supcon * np.mean([supcon_paper(np.concatenate([zs[0], x]), np.tile(y, 2), s.supcon_tau)
                                             for x in zs[1:]]),
        "js": s.weight_js * np.mean([(p * np.log(p / mean)).sum(1).mean() for p in probs]),
    }
    assert (s.weight_supcon, s.weight_js) == (0.10, 0.25)
    assert set(terms) == set(expected)
    check(request, "method", "fedstain", max(abs(float(terms[k]) - v) for k, v in expected.items()), F32)


def test_fedstain_code_statistics_and_pool(request):
    """The code's ``compute_statistic``: the first floor(r n_i) images (here a seeded draw of that many),
    per image and channel: sigma = max(sqrt(var + eps), eps) with the unbiased variance, skewness
    E[(x - mu)^3] / (sigma^3 + eps), excess kurtosis E[(x - mu)^4] / (sigma^4 + eps) - 3, both clamped
    to [-10, 10], eps 1e-6, on the normalised pixels; the pool: the other clients' rows in client order."""
    method = build("fedstain_code")
    seen = {}

    def upload(model, start, data, seed):
        seen[seed] = upload_before_training(method, model, start, data, seed)
        return seen[seed]

    _, data, got = _three_clients(method, upload)
    worst, eps = 0.0, 1e-6
    for n in sorted(data):
        seed = int(n[1:])
        count = max(1, math.floor(method.settings.upload_ratio * len(data[n])))
        idx = sorted(np.random.default_rng(seed).choice(len(data[n]), size=count, replace=False).tolist())
        from fedhisto.data.views import eval_view

        x = np.stack([eval_view(data[n].images[i], method.cfg.views).numpy() for i in idx]).reshape(count, 3, -1)
        centred = x - x.mean(2, keepdims=True)
        sigma = np.maximum(np.sqrt(x.var(2, ddof=1) + eps), eps)
        skew = np.clip((centred**3).mean(2) / (sigma**3 + eps), -10, 10)
        kurt = np.clip((centred**4).mean(2) / (sigma**4 + eps) - 3, -10, 10)
        worst = max(worst, float(np.abs(seen[seed].skew.double().numpy() - skew).max()),
                    float(np.abs(seen[seed].kurt.double().numpy() - kurt).max()))
    for n in sorted(data):
        pool = got.payloads[n]["style_pool"]
        others = [seen[int(m[1:])] for m in sorted(data) if m != n]
        assert np.array_equal(pool.skew.numpy(), np.concatenate([o.skew.numpy() for o in others]))
        assert np.array_equal(pool.kurt.numpy(), np.concatenate([o.kurt.numpy() for o in others]))
    check(request, "method", "fedstain_code", worst, F32)


def supcon_code(generated: np.ndarray, original: np.ndarray, labels: np.ndarray, tau: float) -> float:
    """The authors' ``supervised_contrastive_loss``: both views L2-normalised and stacked, s = z z^T / tau;
    per anchor, minus the mean of s over the same-label samples (itself included) plus the log of
    sum_{a != i} exp(s_ia); the mean over every anchor."""
    z = np.concatenate([_unit(generated), _unit(original)])
    lab = np.concatenate([labels, labels])
    sim = z @ z.T / tau
    same = lab[:, None] == lab[None, :]
    positive = (sim * same).sum(1) / same.sum(1)
    negative = np.log(np.exp(sim).sum(1) - np.exp(np.diag(sim)))
    return float(np.mean(negative - positive))


def test_fedstain_code_objective(request):
    """Three views (original, two generated) of six images: CE summed over the views (class-balanced, as
    every method here), 0.1 x the code's JS (KL of each view's softmax to their mean clamped to
    [1e-7, 1], batch-mean, averaged over the views), 0.1 x the code's SupCon averaged over the two."""
    method = build("fedstain_code")
    s = method.settings
    g = np.random.default_rng(3)
    y = np.array([0, 1, 2, 0, 2, 1])
    logits = [g.normal(size=(6, 3)) for _ in range(3)]
    zs = [g.normal(size=(6, 64)) for _ in range(3)]
    w = class_weights(method, [30, 12, 3])
    terms = objective_terms(method, [torch.from_numpy(v) for v in logits], [torch.from_numpy(v) for v in zs],
                            torch.from_numpy(y), w)
    probs = [_softmax(lg) for lg in logits]
    log_mixture = np.log(np.clip(sum(probs) / 3, 1e-7, 1))
    expected = {
        "ce": sum(_balanced_ce(lg, y, w.double().numpy()) for lg in logits),
        "js": 0.1 * np.mean([(p * (np.log(p) - log_mixture)).sum(1).mean() for p in probs]),
        "supcon": 0.1 * np.mean([supcon_code(z, zs[0], y, 0.1) for z in zs[1:]]),
    }
    assert (s.weight_supcon, s.weight_js, s.supcon_tau) == (0.10, 0.10, 0.1)
    assert set(terms) == set(expected)
    check(request, "method", "fedstain_code", max(abs(float(terms[k]) - v) for k, v in expected.items()), F32)
