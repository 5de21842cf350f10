"""The study's method family (FedAvg-PEFT .. PAST v2, the ablations and the stain-view arms) and the
two references (local_only, pooled), against the study's own equations written afresh in numpy
(FedHisto-PAST v2, sections 3.5-3.9) and Flower's FedAvg:

- the server: adaptive weights (eq. 4), then the weighted mean of the returned states with LoRA pairs
  through delta-SVD (Flower's FedAvg at those weights, numpy's truncated SVD);
- the prototype exchange (section 3.7): each client's normalised class centroids, the server's
  count^0.5-weighted prototypes, reliabilities, availability mask;
- one micro-batch of the local objective (eq. 2-3): class-balanced CE (effective number, beta 0.999),
  JS between the two views, feature consistency, the v1 / v2 prototype terms, FedProx's term;
- the model head every member shares: residual adapter, FiLM with the method's stain descriptor
  (the site's own, the centroid for the global model, zeros for FiLM-Zero), classifier.

Which method has which part is the study's Table 3, written out here (``TABLE3``), not read from the
registrations. The stain perturbation of the ``*_stain`` arms' single view is not checked here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from reference_peers import best_rank, dense, flower_round
from reference_support import (
    Reference,
    build,
    check,
    class_weights,
    client_upload,
    config,
    descriptors_of,
    drive_round,
    lora_scaling,
    members_of,
    model_for,
    objective_terms,
    participants,
    perturbed,
    prototypes_payload,
    returning,
    server_prototypes,
    split,
    trainable_state,
    upload_after_aggregation,
)

pytestmark = pytest.mark.reference

# The study's Table 3 (and the two stain-view arms): views per image, loss terms, FiLM descriptor, weights.
TABLE3 = {
    "fedavg_peft": {"views": 1, "js": False, "feat": False, "proto": None, "prox": False, "film": None, "adaptive": False},
    "fedprox_peft": {"views": 1, "js": False, "feat": False, "proto": None, "prox": True, "film": None, "adaptive": False},
    "film_zero": {"views": 1, "js": False, "feat": False, "proto": None, "prox": False, "film": "zero", "adaptive": False},
    "past_v1": {"views": 1, "js": False, "feat": False, "proto": "v1", "prox": False, "film": "site", "adaptive": True},
    "past_v2": {"views": 2, "js": True, "feat": True, "proto": "v2", "prox": False, "film": "site", "adaptive": True},
    "v2_no_js": {"views": 2, "js": False, "feat": True, "proto": "v2", "prox": False, "film": "site", "adaptive": True},
    "v2_no_feat": {"views": 2, "js": True, "feat": False, "proto": "v2", "prox": False, "film": "site", "adaptive": True},
    "v2_no_proto": {"views": 2, "js": True, "feat": True, "proto": None, "prox": False, "film": "site", "adaptive": True},
    "fedavg_peft_stain": {"views": 1, "js": False, "feat": False, "proto": None, "prox": False, "film": None,
                          "adaptive": False},
    "v1_stain": {"views": 1, "js": False, "feat": False, "proto": "v1", "prox": False, "film": "site", "adaptive": True},
}
ADAPTIVE = sorted(m for m, row in TABLE3.items() if row["adaptive"])
PROTOTYPES = sorted(m for m, row in TABLE3.items() if row["proto"])
WEIGHTS = {"js": 0.25, "feat": 0.10, "proto": 0.05, "mu": 0.001, "margin": 0.20}  # study eq. 2, section 3.8

REFERENCES = [
    *(Reference("method", m, "the study's adaptive weights (eq. 4), Flower FedAvg at them, numpy rank-r SVD",
                "test_adaptive_weights_and_the_weighted_server_step") for m in ADAPTIVE),
    *(Reference("method", m, "the study's prototype exchange and reliability (section 3.7) in numpy",
                "test_the_prototype_exchange_is_the_studys") for m in PROTOTYPES),
    *(Reference("method", m, "the study's local objective (eq. 2-3) in numpy",
                "test_one_micro_batch_of_the_objective_is_the_studys") for m in TABLE3),
    *(Reference("method", m, "the model head (adapter, FiLM with the study's descriptor rule, classifier) in numpy",
                "test_the_head_and_the_stain_descriptor_are_the_studys") for m in TABLE3),
    Reference("method", "local_only", "its definition: no exchange, each client's model its own",
              "test_local_only_and_pooled_are_their_definitions"),
    Reference("method", "pooled", "its definition: one participant on the union of the clients' images",
              "test_local_only_and_pooled_are_their_definitions"),
]

F64 = 1e-12  # float64 arithmetic on O(1) numbers
F32 = 1e-6   # terms the objective computes in float32 (CE weights, JS's mixture): float32 rounding of O(1) losses


# ------------------------------------------------------------------ numpy: the study's equations
def adaptive_weights(counts: list[int], updates: list[np.ndarray], floor: float = 0.03
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 4: a~_k = n_k^0.5 exp(-(1 - cos(D_k, mean_{j != k} D_j))) exp(-0.5 |ln(||D_k|| / median_j ||D_j||)|),
    normalised, floored at 0.03, renormalised. Returns (the weights, the normalised ones before the floor)."""
    d = np.stack(updates)
    norms = np.linalg.norm(d, axis=1)
    median = np.median(norms)
    raw = []
    for k in range(len(counts)):
        others = np.delete(d, k, axis=0).mean(0)
        cos = d[k] @ others / (np.linalg.norm(d[k]) * np.linalg.norm(others))
        raw.append(math.sqrt(counts[k]) * math.exp(-(1 - cos)) * math.exp(-0.5 * abs(math.log(norms[k] / median))))
    before = np.array(raw) / sum(raw)
    w = np.maximum(before, floor)
    return w / w.sum(), before


def flat_update(state, start) -> np.ndarray:
    """D_k: the returned trainable state minus the global one, flattened (any fixed key order)."""
    return np.concatenate([(state[k].double() - start[k].double()).numpy().ravel() for k in sorted(start)])


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def server_prototypes_ref(uploads: list[tuple[dict, dict]], n_classes: int, dim: int):
    """Section 3.7: p_c = normalise(sum_k n_kc^0.5 u_kc) over the clients that sent class c; reliability
    1 / max(variance, 1e-4) of the contributed centroids around p_c (mean over dimensions, with the same
    count^0.5 weights, normalised) for two or more contributors, else sqrt(n_c) / (sqrt(n_c) + 5); times
    the mask; normalised to mean 1 over valid classes; clipped to [0, 3]."""
    centroids, raw, mask = np.zeros((n_classes, dim)), np.zeros(n_classes), np.zeros(n_classes, bool)
    for c in range(n_classes):
        got = [(u[c].double().numpy(), n[c]) for u, n in uploads if c in u]
        if not got:
            continue
        w = np.array([math.sqrt(n) for _, n in got])
        vecs = np.stack([v for v, _ in got])
        p = unit((w[:, None] * vecs).sum(0))
        centroids[c], mask[c] = p, True
        if len(got) >= 2:
            var = ((w / w.sum())[:, None] * (vecs - p) ** 2).sum(0).mean()
            raw[c] = 1.0 / max(var, 1e-4)
        else:
            n_c = sum(n for _, n in got)
            raw[c] = math.sqrt(n_c) / (math.sqrt(n_c) + 5)
    raw = raw * mask
    reliability = np.clip(raw / raw[mask].mean(), 0, 3)
    return centroids, reliability, mask


def effective_number_weights(counts: list[int], beta: float = 0.999, cap: float = 4.0) -> np.ndarray:
    """Cui et al.'s (1 - beta) / (1 - beta^n_c) for present classes, 0 for absent ones, scaled so the
    client's mean per-image weight is 1 (the project's reading of "normalised over the client's
    available classes"), capped at 4."""
    n = np.asarray(counts, float)
    w = np.where(n > 0, (1 - beta) / (1 - beta ** np.maximum(n, 1)), 0.0)
    return np.minimum(w * n.sum() / (w * n).sum(), cap)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def objective_ref(row: dict, logits: list[np.ndarray], zs: list[np.ndarray], y: np.ndarray, w: np.ndarray,
                  protos: tuple[np.ndarray, np.ndarray, np.ndarray], prox: float) -> dict[str, float]:
    """Eq. 2: CE_cb on every view (sum_i w_{y_i} CE_i / B, averaged over the views) + 0.25 JS(p1, p2) +
    0.10 mean(1 - cos(z1, z2)) + 0.05 L_proto (v2: reliability-weighted attraction + margin over the
    available other classes; v1: unweighted attraction), over the samples whose class has a prototype,
    averaged over the views; FedProx's (mu / 2)||theta - theta_global||^2."""
    out = {"ce": np.mean([(w[y] * -np.log(softmax(lg)[np.arange(len(y)), y])).sum() / len(y) for lg in logits])}
    if row["js"]:
        p, q = softmax(logits[0]), softmax(logits[1])
        m = (p + q) / 2
        out["js"] = WEIGHTS["js"] * np.mean(0.5 * (p * np.log(p / m)).sum(1) + 0.5 * (q * np.log(q / m)).sum(1))
    if row["feat"]:
        out["feat"] = WEIGHTS["feat"] * np.mean(1 - (unit(zs[0]) * unit(zs[1])).sum(1))
    if row["proto"]:
        centroids, reliability, mask = protos
        keep = mask[y]
        per_view = []
        for z in zs:
            sim = unit(z[keep]) @ unit(centroids).T
            yk = y[keep]
            pos = sim[np.arange(len(yk)), yk]
            if row["proto"] == "v1":
                per_view.append(np.mean(1 - pos))
                continue
            others = np.where(mask[None, :] & (np.arange(len(mask))[None, :] != yk[:, None]), sim, -np.inf)
            margin = np.maximum(0.0, WEIGHTS["margin"] + others.max(1) - pos)
            per_view.append(np.mean(reliability[yk] * (1 - pos)) + np.mean(margin))
        out["proto"] = WEIGHTS["proto"] * np.mean(per_view)
    if row["prox"]:
        out["prox"] = prox
    return out


# ------------------------------------------------------------------ the tests
CLIENTS = ("C1", "C2", "C3", "C4")
COUNTS = {"C1": 10, "C2": 25, "C3": 40, "C4": 1}


@pytest.mark.parametrize("name", ADAPTIVE)
def test_adaptive_weights_and_the_weighted_server_step(name: str, request):
    """Four clients, each returning a random step; C4's (one image) is a hundred times as long as the
    others', so its weight falls under the 0.03 floor."""
    from flwr.serverapp.strategy import FedAvg

    method = build(name)
    model = model_for(method)
    x = trainable_state(model)
    trained = {c: perturbed(x, seed=k + 1, scale=5.0 if c == "C4" else 0.05) for k, c in enumerate(CLIENTS)}
    got = drive_round(method, model, members_of(method, list(CLIENTS), x), list(CLIENTS),
                      returning(trained, COUNTS, 4),
                      after=lambda n, members: client_upload({0: torch.ones(64)}, {0: 3}))
    expected, before = adaptive_weights([COUNTS[c] for c in CLIENTS], [flat_update(trained[c], x) for c in CLIENTS])
    assert before[-1] < 0.03 < before[:-1].min()  # the floor binds for C4 alone
    worst = max(abs(got.weights[c] - e) for c, e in zip(CLIENTS, expected, strict=True))
    s, r = lora_scaling(model), method.cfg.model.lora_r
    flower, _ = flower_round(FedAvg(min_train_nodes=4, min_available_nodes=4), 1, dense(x, s),
                             [(dense(trained[c], s), float(e)) for c, e in zip(CLIENTS, expected, strict=True)])
    ours = dense(got.members["global"], s)
    for key, ref in flower.items():
        worst = max(worst, float(np.abs(ours[key] - (best_rank(ref, r) if ".lora_BA." in key else ref)).max()))
    check(request, "method", name, worst, F64)


class _Embedder:
    """A stand-in encoder pathway for the prototype upload: a fixed random projection of the pixels,
    recording what it returned (so the reference sees the same embeddings)."""

    def __init__(self, dim: int = 64) -> None:
        self.proj = torch.randn(3 * 8 * 8, dim, generator=torch.Generator().manual_seed(5))
        self.seen: list[torch.Tensor] = []

    def eval(self):
        return self

    def embed(self, x, descriptor=None):
        z = torch.nn.functional.adaptive_avg_pool2d(x, 8).flatten(1) @ self.proj + 0.5
        self.seen.append(z.detach().clone())
        return z


@pytest.mark.parametrize("name", PROTOTYPES)
def test_the_prototype_exchange_is_the_studys(name: str, request):
    """Three clients upload after aggregation (C1 has every class, C2 and C3 no SCC, so SCC has one
    contributor and takes the count fallback); each keeps at most ``proto_max_images`` = 2 images per
    class (the study's 256, shrunk), in sample order. The server state against section 3.7 in numpy."""
    method = build(name, config(train={"past": {"proto_max_images": 2}}))
    model = model_for(method)
    x = trainable_state(model)
    data = {"C1": split(9, 1), "C2": split(6, 2), "C3": split(6, 3)}
    for c in ("C2", "C3"):
        data[c].labels[:] = [k % 2 for k in range(len(data[c].labels))]
    embedders = {c: _Embedder() for c in data}
    got = drive_round(method, model, members_of(method, list(data), x), list(data),
                      lambda n, start, payload: (perturbed(start, seed=len(n)), len(data[n]), 2),
                      after=lambda n, members: upload_after_aggregation(method, embedders[n], data[n]))
    uploads, worst = [], 0.0
    for c in sorted(data):
        z = torch.cat(embedders[c].seen).double().numpy()
        labels, kept = np.array(data[c].labels), []
        for cls in range(3):
            kept += list(np.flatnonzero(labels == cls)[:2])
        kept = sorted(kept)
        assert len(z) == len(kept)
        centroids = {cls: unit(unit(z)[labels[kept] == cls].mean(0)) for cls in np.unique(labels)}
        counts = {cls: int((labels[kept] == cls).sum()) for cls in np.unique(labels)}
        uploads.append(({k: torch.from_numpy(v) for k, v in centroids.items()}, counts))
    ref_c, ref_r, ref_m = server_prototypes_ref(uploads, 3, 64)
    # what the clients sent: the same centroids (float32 on the wire) and counts
    ours_c, ours_r, ours_m = server_prototypes(got.server_state)
    worst = max(worst, float(np.abs(ours_c.double().numpy() - ref_c).max()),
                float(np.abs(ours_r.double().numpy() - ref_r).max()))
    assert ours_m.numpy().tolist() == ref_m.tolist() == [True, True, True]
    assert 0 < ref_r[2] < ref_r[0]  # the one-contributor class's count fallback is far below the others
    check(request, "method", name, worst, F32)


@pytest.mark.parametrize("name", sorted(TABLE3))
def test_one_micro_batch_of_the_objective_is_the_studys(name: str, request):
    """Six images of a site with class counts (30, 12, 3), its views' logits and embeddings (float64),
    the round's global prototypes with class Normal unavailable: the named terms of the method's
    objective against eq. 2-3 in numpy. A term Table 3 does not list must be absent or zero."""
    row = TABLE3[name]
    method = build(name)
    g = np.random.default_rng(7)
    y = np.array([0, 1, 2, 0, 2, 1])
    logits = [g.normal(size=(6, 3)) for _ in range(row["views"])]
    zs = [g.normal(size=(6, 64)) for _ in range(row["views"])]
    counts = [30, 12, 3]
    w_ref = effective_number_weights(counts)
    w_ours = class_weights(method, counts)
    centroids, mask = g.normal(size=(3, 64)), np.array([True, False, True])
    reliability = np.array([1.4, 0.0, 0.6])
    params = start = None
    prox = 0.0
    if row["prox"]:
        start = {"a": torch.from_numpy(g.normal(size=(4, 5))), "b": torch.from_numpy(g.normal(size=3))}
        params = {k: torch.nn.Parameter(v + 0.1) for k, v in start.items()}
        prox = 0.5 * WEIGHTS["mu"] * sum(float(((params[k].detach() - start[k]) ** 2).sum()) for k in start)
    terms = objective_terms(method, [torch.from_numpy(v) for v in logits], [torch.from_numpy(v) for v in zs],
                            torch.from_numpy(y), w_ours,
                            payload=prototypes_payload(torch.from_numpy(centroids).float(),
                                                       torch.from_numpy(reliability).float(), torch.from_numpy(mask)),
                            params=params, start_state=start)
    # the objective sees the round's prototypes as the server sends them (float32)
    protos = (centroids.astype(np.float32).astype(float), reliability.astype(np.float32).astype(float), mask)
    expected = objective_ref(row, logits, zs, y, w_ref, protos, prox)
    ours = {k: float(v) for k, v in terms.items() if float(v) != 0.0}
    assert set(ours) == set(expected), (sorted(ours), sorted(expected))
    worst = max(float(np.abs(w_ours.double().numpy() - w_ref).max()), *(abs(ours[k] - expected[k]) for k in expected))
    check(request, "method", name, worst, F32)


def gelu(x: np.ndarray) -> np.ndarray:
    from scipy.special import erf

    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


def head_ref(model, cls: np.ndarray, descriptor: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Section 3.5-3.6: z = x + W2 act(W1 LayerNorm(x) + b1) + b2 (dropout off); FiLM: [gamma, beta] =
    V2 act(V1 d + c1) + c2, z <- z (1 + 0.1 gamma) + 0.1 beta; logits = C z + c."""
    p = {k: v.detach().double().numpy() for k, v in model.named_parameters() if not k.startswith("encoder.")}
    eps = model.adapter.norm.eps
    ln = (cls - cls.mean(1, keepdims=True)) / np.sqrt(cls.var(1, keepdims=True) + eps)
    ln = ln * p["adapter.norm.weight"] + p["adapter.norm.bias"]
    z = cls + gelu(ln @ p["adapter.down.weight"].T + p["adapter.down.bias"]) @ p["adapter.up.weight"].T + p["adapter.up.bias"]
    if descriptor is not None:
        h = gelu(descriptor @ p["film.hidden.weight"].T + p["film.hidden.bias"])
        gamma, beta = np.split(h @ p["film.out.weight"].T + p["film.out.bias"], 2)
        z = z * (1 + 0.10 * gamma) + 0.10 * beta
    return z @ p["classifier.weight"].T + p["classifier.bias"], z


@pytest.mark.parametrize("name", sorted(TABLE3))
def test_the_head_and_the_stain_descriptor_are_the_studys(name: str, request):
    """Descriptors (section 3.5): each client's own standardised descriptor, the centroid for the global
    model, zeros for FiLM-Zero, none without FiLM; the head on them against numpy."""
    row = TABLE3[name]
    method = build(name)
    model = model_for(method).eval()
    g = np.random.default_rng(4)
    doc = {"clients": {c: {"standardised": g.normal(size=14).tolist()} for c in CLIENTS},
           "centroid": {"standardised": g.normal(size=14).tolist()}}
    desc = descriptors_of(method, doc, list(CLIENTS))
    cls = g.normal(size=(5, 64))
    worst = 0.0
    for who in (*CLIENTS, "global"):
        expected = {None: None, "zero": np.zeros(14),
                    "site": np.array(doc["centroid" if who == "global" else "clients"][who]["standardised"]
                                     if who != "global" else doc["centroid"]["standardised"])}[row["film"]]
        got = desc[who]
        assert (got is None) == (expected is None), who
        if expected is not None:
            worst = max(worst, float(np.abs(got.double().numpy() - expected).max()))
        logits, z = model.head(torch.from_numpy(cls), None if got is None else got.double()[None])
        ref_logits, ref_z = head_ref(model, cls, expected)
        worst = max(worst, float(np.abs(logits.detach().numpy() - ref_logits).max()),
                    float(np.abs(z.detach().numpy() - ref_z).max()))
    check(request, "method", name, worst, F32)


def test_local_only_and_pooled_are_their_definitions(request):
    """local_only: a member per client, each starting from its own model and ending at its own returned
    state, nothing mixed. pooled: one participant holding every client's images (in client order), whose
    returned state is the global model."""
    clients = {"C1": split(4, 1), "C2": split(5, 2), "C3": split(3, 3)}
    for name in ("local_only", "pooled"):
        method = build(name)
        model = model_for(method)
        x = trainable_state(model)
        names = participants(method, clients)
        members = {m: perturbed(x, seed=k) for k, m in enumerate(method.members(names))}
        trained = {n: perturbed(x, seed=20 + k) for k, n in enumerate(names)}
        got = drive_round(method, model, members, names, returning(trained, 7, 1))
        worst = 0.0
        if name == "local_only":
            assert sorted(got.members) == sorted(clients) == names
            for c in names:
                worst = max(worst, *(float((got.starts[c][k] - members[c][k]).abs().max()) for k in x),
                            *(float((got.members[c][k] - trained[c][k]).abs().max()) for k in x))
        else:
            (only,) = names
            union = [i for c in sorted(clients) for i in clients[c].ids]
            assert list(method.participants(clients)[only].ids) == union
            worst = max(*(float((got.members["global"][k] - trained[only][k]).abs().max()) for k in x),
                        *(float((got.starts[only][k] - members["global"][k]).abs().max()) for k in x))
        check(request, "method", name, worst, 0.0)
