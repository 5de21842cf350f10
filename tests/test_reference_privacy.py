"""DP-SGD (Abadi et al. 2016) as the sequential engine runs it under ``privacy.enabled``, against Opacus:
the first logical step's per-sample gradients (Opacus's ``GradSampleModule``), their norms over the
tensors the method trains and the clipped sum (Opacus's ``DPOptimizer`` clipping) on the same model
state, views and labels, and the round's epsilon against Opacus's RDP accountant.

Each case runs one participant's DP round through ``train.private.PrivateSites`` (the engine's path into
``fedhisto.privacy``) in float64, dropout off, so the two per-sample computations can agree to float64
rounding. Opacus clips with C / (||g|| + 1e-6) where fedhisto divides by ||g|| itself: on the norms here
(0.5-5) that moves a clipped gradient by at most 1e-6 C relatively, the tolerance of the clipped sum.

- ``fedavg_peft``: every LoRA factor, the adapter and the classifier are trained, all clipped together;
- ``ffa_lora``: FFA-LoRA (Sun et al. 2024) trains B alone, A stays at A_0, so Opacus is given A frozen
  and the per-sample norms are B's and the other trained tensors';
- ``flexlora`` with a rank-2 site: the site trains a rank-2 LoRA (Bai et al. 2024), so after its DP
  steps the factors' padded rows and columns are still exactly 0 and s B A has rank at most 2 (numpy).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference_support import (
    Reference,
    build,
    check,
    config,
    dp_round,
    lora_keys,
    members_of,
    model_for,
    split,
    trainable_state,
)

pytestmark = pytest.mark.reference

REFERENCES = [
    Reference("mechanism", "dp_sgd", "Opacus GradSampleModule per-sample gradients and DPOptimizer clipping (relative)",
              "test_dp_sgd_step_is_opacus"),
    Reference("mechanism", "rdp_accountant", "Opacus RDPAccountant epsilon of the round's steps (relative)",
              "test_dp_sgd_step_is_opacus"),
    Reference("method", "ffa_lora", "Opacus per-sample norms and clipping with A frozen, B trained alone (relative)",
              "test_ffa_lora_under_dp_clips_what_it_trains"),
    Reference("method", "flexlora", "a rank-2 site's factors after DP steps: padded block 0, rank of s B A (numpy)",
              "test_flexlora_site_keeps_its_rank_under_dp"),
]

PRIVACY = {"enabled": True, "noise_multiplier": 1.3, "clip_norm": 0.5, "sample_rate": 0.5, "delta": 1e-5,
           "micro_batch": 8, "dropout": "off", "noise_seed": "run"}
TRAIN = {"engine": "sequential", "local_epochs": 1}


def dp_method(name: str, **train):
    return build(name, config(train={**TRAIN, **train}, privacy=PRIVACY,
                              model={"lora_dropout": 0.0, "adapter_dropout": 0.0}))


def opacus_step(method, start, views: torch.Tensor, labels: torch.Tensor, ce_weights: torch.Tensor,
                trains=lambda name: True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Opacus on a fresh copy of the method's model at ``start``: the per-sample gradients of
    sum_i w_{y_i} CE_i over the tensors ``trains`` keeps, their norms, and DPOptimizer's clipped sum."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model = model_for(method)
    model.load_trainable_state(start)
    for n, p in model.named_parameters():
        if p.requires_grad and not trains(n):
            p.requires_grad_(False)
    model.train()
    for m in model.modules():  # dropout off, as privacy.dropout: off does for the per-sample pass
        if isinstance(m, torch.nn.Dropout):
            m.eval()
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = DPOptimizer(torch.optim.SGD(list(trained.values()), lr=0.0), noise_multiplier=0.0,
                      max_grad_norm=PRIVACY["clip_norm"], expected_batch_size=len(labels), loss_reduction="sum")
    logits, _ = gsm(views[:, 0])
    w = ce_weights.double()
    (torch.nn.functional.cross_entropy(logits, labels, reduction="none") * w[labels]).sum().backward()
    norms = torch.stack([p.grad_sample.reshape(len(labels), -1).norm(dim=1) for p in trained.values()], 1).norm(dim=1)
    opt.clip_and_accumulate()
    return norms.detach(), {n: p.summed_grad.detach().clone() for n, p in trained.items()}


def _compare(got, norms, clipped) -> float:
    assert got.clipped_names == sorted(clipped), "the tensors clipped differ"
    worst = float((got.norms - norms).abs().max() / norms.max())
    return max(worst, *(float((got.clipped_sum[k] - v).abs().max()) / PRIVACY["clip_norm"] for k, v in clipped.items()))


def test_dp_sgd_step_is_opacus(request):
    from opacus.accountants import RDPAccountant

    method = dp_method("fedavg_peft")
    model = model_for(method)
    start = trainable_state(model)
    got = dp_round(method, model, split(8, 1), start)
    norms, clipped = opacus_step(method, start, got.views, got.labels, got.ce_weights)
    assert len(got.labels) >= 2 and (norms > PRIVACY["clip_norm"]).any()  # a batch, and clipping binds
    check(request, "mechanism", "dp_sgd", _compare(got, norms, clipped), 1e-6)
    accountant = RDPAccountant()
    for _ in range(got.steps):
        accountant.step(noise_multiplier=PRIVACY["noise_multiplier"], sample_rate=PRIVACY["sample_rate"])
    reference = accountant.get_epsilon(delta=PRIVACY["delta"])
    check(request, "mechanism", "rdp_accountant", abs(got.epsilon - reference) / reference, 1e-9)


def test_ffa_lora_under_dp_clips_what_it_trains(request):
    method = dp_method("ffa_lora")
    model = model_for(method)
    start = trainable_state(model)
    got = dp_round(method, model, split(8, 2), start)
    norms, clipped = opacus_step(method, start, got.views, got.labels, got.ce_weights,
                                 trains=lambda name: ".lora_A." not in name)
    difference = max(float((got.norms - norms).abs().max() / norms.max()),
                     *(float((got.clipped_sum[k] - v).abs().max()) / PRIVACY["clip_norm"] for k, v in clipped.items()))
    a_after = max(float((got.state[a] - start[a]).abs().max()) for a, _ in lora_keys(start))
    check(request, "method", "ffa_lora", max(difference, a_after), 1e-6)


def test_flexlora_site_keeps_its_rank_under_dp(request):
    method = dp_method("flexlora", lora_aggregation={"site_ranks": [["C1", 2]]})
    model = model_for(method)
    x = trainable_state(model)
    start = method.start_state(members_of(method, ["C1", "C2"], x), "C1")
    got = dp_round(method, model, split(8, 3), start)
    worst, rank = 0.0, 0
    for a, b in lora_keys(start):
        assert float(start[a][2:].abs().max()) == 0.0  # the site starts at rank 2
        worst = max(worst, float(got.state[a][2:].abs().max()), float(got.state[b][:, 2:].abs().max()))
        rank = max(rank, int(np.linalg.matrix_rank((got.state[b] @ got.state[a]).numpy())))
    check(request, "method", "flexlora", worst, 0.0)
    assert rank <= 2, f"a rank-2 site ends its DP round with s B A of rank {rank}"
