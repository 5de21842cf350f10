"""The GPU path checked on a CPU: bf16 autocast for every registered method, and torch.compile of the
batched engine's encoder pass (inductor compiles for the CPU too).

bf16 tolerance: autocast runs the matmuls (encoder, LoRA, heads) with bf16 inputs, 8 significant
bits (relative rounding about 2^-9 = 0.2 %). Through two local epochs of AdamW, whose update is
normalised by sqrt(v) so that the sign of a small gradient component decides its step, a round's end
state under bf16 differs from the float32 one by 4 to 8 % of the round's update (measured on 2 CPU
threads for every method, both engines: 0.037 (pooled) to 0.077 (past_v1)); the bound is 15 %. A
broken bf16 path (a NaN, a loss term dropped, a view cast wrongly) moves the state by the order of
the update itself. The gap must also exceed 1 % of the update, or bf16 never ran (float32 against
itself gives about 1e-6). Loss means differ by at most 1.1 % (bound 3 %).

compile tolerance: inductor fuses and reorders float32 reductions (layer norm, softmax, matmul
epilogues), a few float32 ulps per operation, as the batched engine's own reordering
(tests/test_batched.py: below 1e-4 absolute after a round); one step's loss and gradients agree to
rtol 1e-4 / atol 1e-6. The compile test uses a one-block tiny encoder and one row layout, so it
compiles one graph (forward and backward), about 20-40 s of CPU here.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from test_batched import CFG, perturbed, round_inputs, split

from fedhisto.config import load_config
from fedhisto.methods import build_method, method_names
from fedhisto.methods.base import Batch, training_autocast
from fedhisto.model.encoder import random_encoder
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.train.batched import (
    Layout,
    batched_local_train,
    compiled_embedding,
    stack_states,
    stacked_forward,
)
from fedhisto.train.local import local_train
from fedhisto.train.plan import MemberJob, local_run

BF16_BOUND = 0.15
BF16_FLOOR = 0.01


def _norm(state: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    return sum(float((state[k] - other[k]).double().norm() ** 2) for k in state) ** 0.5


def _round(name: str, precision: str, engine: str):
    cfg, method, model, device, jobs = round_inputs(name, {"precision": precision})
    if engine == "batched":
        return jobs, batched_local_train(method, model, jobs, cfg, device)
    return jobs, [local_train(method, model, j.start_state, j.data, j.descriptor, j.payload, cfg, j.seed,
                              j.round_idx, j.client_idx, device) for j in jobs]


@pytest.mark.parametrize("engine", ["sequential", "batched"])
@pytest.mark.parametrize("name", method_names())
def test_a_bf16_round_stays_finite_and_close_to_float32(name: str, engine: str):
    """train.precision: bf16 runs on the CPU the autocast a GPU run gets by default (auto), for every
    registered method's local training (its pre-round upload, e.g. SCAFFOLD's start gradient, too)."""
    jobs, f32 = _round(name, "float32", engine)
    _, bf16 = _round(name, "bf16", engine)
    for f, b, j in zip(f32, bf16, jobs, strict=True):
        assert all(bool(torch.isfinite(v).all()) for v in b.state.values()), name
        assert all(np.isfinite(v) for v in b.losses.values()), (name, b.losses)
        update, gap = _norm(f.state, j.start_state), _norm(f.state, b.state)
        assert update > 0
        assert BF16_FLOOR * update < gap < BF16_BOUND * update, (name, gap / update)
        assert b.losses.keys() == f.losses.keys()
        for k in f.losses:
            assert b.losses[k] == pytest.approx(f.losses[k], rel=0.03, abs=1e-3), (name, k)


def test_precision_default_is_the_studys_amp_and_leaves_identities_unchanged():
    from fedhisto.stage_config import training_settings

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not isinstance(training_autocast(cpu), torch.autocast)            # auto on a CPU: float32
    with warnings.catch_warnings():  # "CUDA is not available ... disabling autocast": the object is what counts
        warnings.simplefilter("ignore")
        cuda_amp = training_autocast(cuda)                                     # auto on CUDA: bf16 (the study)
    assert isinstance(cuda_amp, torch.autocast) and cuda_amp.fast_dtype == torch.bfloat16
    assert not isinstance(training_autocast(cuda, "float32"), torch.autocast)
    forced = training_autocast(cpu, "bf16")
    assert isinstance(forced, torch.autocast) and forced.device == "cpu" and forced.fast_dtype == torch.bfloat16
    assert "precision" not in training_settings(load_config(CFG), "past_v2")
    assert "compile" not in training_settings(load_config(CFG), "past_v2")
    set_ = load_config({**CFG, "train": {**CFG["train"], "precision": "bf16", "engine": "batched", "compile": True}})
    assert training_settings(set_, "past_v2")["precision"] == "bf16"
    assert training_settings(set_, "past_v2")["compile"] is True


def test_compile_is_refused_under_the_sequential_engine():
    from fedhisto.config_base import ConfigError

    with pytest.raises((ConfigError, ValueError), match=r"train\.compile.*train\.engine: batched"):
        load_config({**CFG, "train": {**CFG["train"], "compile": True}})


# ------------------------------------------------------------------ torch.compile
def _one_block_round(compile_: bool):
    """Two members of eight images each: every micro-batch has the same row layout (one graph)."""
    cfg = load_config({**CFG, "train": {**CFG["train"], "engine": "batched", "compile": compile_,
                                        "local_epochs": 1}})
    method = build_method("past_v2", cfg)
    torch.manual_seed(0)
    model = FedHistoModel(random_encoder("tiny", depth=1), cfg.model, film=method.film)
    start = perturbed(model.trainable_state(), 7)
    desc = torch.linspace(-1, 1, 14)
    jobs = [MemberJob(start, split(8, 20 + k), desc, {}, 11, 1, k) for k in range(2)]
    return cfg, method, model, jobs


@pytest.fixture
def one_compile_thread(monkeypatch):
    """Inductor compiles in-process (no worker pool on the two shared cores)."""
    import torch._inductor.config as inductor

    monkeypatch.setattr(inductor, "compile_threads", 1)


def test_compiled_batched_step_and_round_equal_the_eager_ones(one_compile_thread):
    cfg, method, model, jobs = _one_block_round(True)
    device = torch.device("cpu")
    params = stack_states([j.start_state for j in jobs], device)
    plan = method.local_schedule(1)
    runs = [local_run(model, j, cfg, plan, device, {}) for j in jobs]
    rng = np.random.default_rng(0)
    micro = plan.micro_batch
    pixels = torch.tensor(rng.normal(size=(2 * 2 * micro, 3, 48, 48)), dtype=torch.float32)
    layout = Layout(members=[0, 1, 0, 1], sizes=[micro] * 4, specs=[None] * 4)  # view-major, as the engine
    layout.index = torch.tensor(layout.members)
    descriptors = torch.stack([j.descriptor[None] for j in jobs])
    batch = Batch(np.arange(micro), torch.arange(micro) % 3, 0, 0, 0)

    def step(embed):
        for p in params.values():
            p.grad = None
        logits, zs = stacked_forward(model, method, params, layout, pixels, descriptors, embed=embed)
        total = 0
        for m in range(2):
            rows = [slice((k * 2 + m) * micro, (k * 2 + m + 1) * micro) for k in range(2)]
            terms = method.terms_from_outputs(runs[m], batch, [logits[r] for r in rows], [zs[r] for r in rows])
            total = total + sum(terms.values())
        total.backward()
        return float(total.detach()), {n: p.grad.clone() for n, p in params.items()}

    from torch._dynamo.utils import counters

    model.train()
    eager_loss, eager_grads = step(None)
    graphs = counters["stats"]["unique_graphs"]
    compiled_loss, compiled_grads = step(compiled_embedding(model))
    assert counters["stats"]["unique_graphs"] > graphs  # dynamo captured the pass (errors would have raised)
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-5)
    assert eager_grads.keys() == compiled_grads.keys()
    for n in eager_grads:
        assert float(eager_grads[n].abs().max()) > 0 or "lora_A" in n, n  # the gradient is not trivially zero
        torch.testing.assert_close(compiled_grads[n], eager_grads[n], rtol=1e-4, atol=1e-6, msg=n)

    # the engine under train.compile: a round of the same two members ends where the eager one does
    compiled_round = batched_local_train(method, model, jobs, cfg, device)
    eager_cfg, eager_method, _, _ = _one_block_round(False)
    eager_round = batched_local_train(eager_method, model, jobs, eager_cfg, device)
    for c, e, j in zip(compiled_round, eager_round, jobs, strict=True):
        assert _norm(e.state, j.start_state) > 0
        assert max(float((c.state[k] - e.state[k]).abs().max()) for k in e.state) < 1e-4
        for k in e.losses:
            assert c.losses[k] == pytest.approx(e.losses[k], rel=1e-4, abs=1e-6)
