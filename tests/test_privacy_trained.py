"""DP-SGD clips and noises exactly the tensors a method trains: FFA-LoRA's frozen A is never given a
gradient, never clipped or noised (each image's clipping norm is that of B and the other trained tensors
alone, checked against single-image autograd passes), in either engine; a FlexLoRA site at rank r_k keeps
the padded rows of A and columns of B exactly 0 under DP, so it trains a rank-r_k adapter and Table 8's
rank-r_k traffic is what it sends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import train
from test_privacy_training import dp_cfg

import fedhisto.privacy.dpsgd as dpsgd
import fedhisto.privacy.step as step
from fedhisto.entry import study_config
from fedhisto.methods import build_method

A = ".lora_A."


def _dropout_off(model: torch.nn.Module) -> list[torch.nn.Module]:
    drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.training]
    for m in drops:
        m.eval()
    return drops


def _reference_norms(model, unit_loss, views, labels, descriptor, trained) -> torch.Tensor:
    """||grad_theta l_i|| over ``trained`` for each image i, one backward pass per image (dropout off)."""
    drops = _dropout_off(model)
    params = [p for n, p in model.named_parameters() if n in trained]
    out = []
    try:
        for x, y in zip(views, labels, strict=True):
            logits, z = model(x, descriptor)
            grads = torch.autograd.grad(unit_loss(logits.float(), z.float(), y), params)
            out.append(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))
    finally:
        for m in drops:
            m.train()
    return torch.stack(out)


def test_ffa_lora_under_dp_clips_and_noises_b_alone(prepared: dict, monkeypatch):
    """One site's DP round of ffa_lora from a start with B far from 0 (at B = 0 A's gradient s B^T G is 0
    and would hide the defect): each image's clipping norm equals the norm of its gradient over B and the
    other trained tensors, written afresh as one autograd pass per image; A is never clipped, noised or
    given a gradient, and stays bitwise at the start."""
    from fedhisto.data.splits import load_partitions
    from fedhisto.model.build import build_model
    from fedhisto.train.private import PrivateSites

    clipped_keys: set[str] = set()
    checked: list[tuple[float, bool]] = []
    real_grads, real_clip = step.per_unit_gradients, dpsgd.clip_and_sum

    def spy_grads(model, unit_loss, views, labels, unit_index, n_units, descriptor=None, *args, **kwargs):
        got = real_grads(model, unit_loss, views, labels, unit_index, n_units, descriptor, *args, **kwargs)
        trained = [n for n, p in model.named_parameters() if p.requires_grad and A not in n]
        want = _reference_norms(model, unit_loss, views, labels, descriptor, trained)
        norms = torch.sqrt(sum(g.reshape(g.shape[0], -1).double().pow(2).sum(1) for g in got.values()))
        frozen_grad = any(p.grad is not None for n, p in model.named_parameters() if A in n)
        checked.append((float(((norms - want).abs() / want).max()), frozen_grad))
        return got

    def spy_clip(per_unit, clip_norm):
        clipped_keys.update(per_unit)
        return real_clip(per_unit, clip_norm)

    monkeypatch.setattr(step, "per_unit_gradients", spy_grads)
    monkeypatch.setattr(dpsgd, "clip_and_sum", spy_clip)
    raw = json.loads(dp_cfg(prepared, rounds=1, methods=("ffa_lora",)).model_dump_json())
    raw["privacy"]["dropout"] = "off"
    cfg = study_config(raw)
    method = build_method("ffa_lora", cfg)
    model = build_model(cfg, method, 11, None)
    data = load_partitions(prepared["manifest"], cfg.views.crop_size, splits=("optimisation",))["C1"]
    g = torch.Generator().manual_seed(2)
    start = {k: v + 0.2 * torch.randn(v.shape, generator=g) if ".lora_B." in k else v
             for k, v in model.trainable_state().items()}
    private = PrivateSites.start(cfg, method.objective, {"C1": data}, None, 11)
    private.before_round(0, ["C1"])
    result = private.local_train("C1", model, start, None, {}, 0, 0, torch.device("cpu"))
    assert checked and clipped_keys
    worst = max(err for err, _ in checked)
    print(f"worst relative difference of a clipping norm: {worst:.3g}")
    # float32 per-sample gradients (vmap, eager attention) against float32 single-image passes (SDPA): 2e-7 measured
    assert worst < 1e-5, f"per-image clipping norms differ from B's and the other trained tensors' by {worst:.3g}"
    assert sorted(k for k in clipped_keys if A in k) == [], "FFA-LoRA's frozen A is clipped under DP"
    assert not any(frozen for _, frozen in checked), "A was given a gradient"
    assert all(torch.equal(result.state[k], start[k]) for k in start if A in k)
    assert all(not torch.equal(result.state[k], start[k]) for k in start if ".lora_B." in k)


@pytest.mark.parametrize("engine", ["sequential", "batched"])
def test_ffa_lora_never_gives_a_a_gradient_in_either_engine(prepared: dict, engine: str):
    from test_batched import round_inputs

    from fedhisto.train.batched import batched_local_train
    from fedhisto.train.local import local_train

    cfg, method, model, device, jobs = round_inputs("ffa_lora")
    if engine == "batched":
        results = batched_local_train(method.objective, model, jobs[:2], cfg, device)
    else:
        j = jobs[0]
        results = [local_train(method.objective, model, j.start_state, j.data, j.descriptor, j.payload, cfg, j.seed,
                               j.round_idx, j.client_idx, device)]
    for res, job in zip(results, jobs, strict=False):
        assert all(torch.equal(res.state[k], job.start_state[k]) for k in res.state if A in k)
    assert [n for n, p in model.named_parameters() if A in n and p.grad is not None] == []


def test_a_flexlora_site_keeps_its_rank_under_dp(prepared: dict, tmp_path: Path, monkeypatch):
    """C1 at rank 2 in a rank-8 model, two DP rounds: after its DP steps the padded rows of A and columns of
    B are exactly 0 (noise never reaches them), every s B A of C1 has rank <= 2, and Table 8's rank-2 factors
    are all of C1's nonzero LoRA entries."""
    from fedhisto.train.private import PrivateSites

    returned: dict[str, list[dict[str, torch.Tensor]]] = {}
    real = PrivateSites.local_train

    def spy(self, name, *args, **kwargs):
        res = real(self, name, *args, **kwargs)
        returned.setdefault(name, []).append(res.state)
        return res

    monkeypatch.setattr(PrivateSites, "local_train", spy)
    raw = json.loads(dp_cfg(prepared, rounds=2, methods=("flexlora",)).model_dump_json())
    raw["train"]["lora_aggregation"] = {"site_ranks": [["C1", 2]]}
    cfg = study_config(raw)
    train(prepared, "flexlora", tmp_path / "flex", cfg=cfg)
    assert len(returned["C1"]) == 2
    r, model_rank = 2, cfg.model.lora_r
    for state in returned["C1"]:
        pairs = [(k, k.replace("lora_A", "lora_B")) for k in state if A in k]
        assert pairs
        for a_key, b_key in pairs:
            a, b = state[a_key], state[b_key]
            assert a[r:].abs().max() == 0, f"{a_key}: rows beyond rank {r} moved under DP"
            assert b[:, r:].abs().max() == 0, f"{b_key}: columns beyond rank {r} moved under DP"
            assert int(torch.linalg.matrix_rank(b.double() @ a.double())) <= r
        # Table 8 counts C1's factors at rank 2 (down and up): exactly its nonzero LoRA block
        method = build_method("flexlora", cfg)
        counted = method.model_bytes(state, ["C1"])
        lora = sum(state[a].numel() + state[b].numel() for a, b in pairs) * r // model_rank * 4
        rest = sum(t.numel() * t.element_size() for k, t in state.items() if ".lora_" not in k)
        assert counted == 2 * (lora + rest)
