"""Every member of a round (clients, and seeds of a method) trained together: the batched engine.

The sequential engine (``train.local.local_train``) runs one participant's local epochs after the
other. Here the trainable state of M *members* (one participant's run each: start state, data,
descriptor, payload, seed, round, client index) is stacked along a leading member axis, and every
micro-batch step runs ONE forward/backward of the frozen encoder over all active members' views:

- LoRA: each targeted ``Linear`` adds its member's low-rank delta, ``(x_m A_m^T) B_m^T * scaling``,
  as batched matmuls over (member, rows) groups (``lora_members``);
- residual adapter, FiLM and classifier: the model's own modules (``FedHistoModel.head``) called with
  each group's member tensors (``member_heads``, by ``torch.func.functional_call``);
- feature restyling (a method's MixStyle) is applied to each member's rows with that member's random
  stream (``Objective.restyle``);
- loss terms per member come from the method's own ``batch_inputs`` / ``terms_from_outputs``, so
  the objective is the sequential one; the members' losses are summed (their gradients do not mix);
- ``StackedAdamW`` (``train.stacked_optim``): torch.optim.AdamW's update per member, with per-member step counts and a mask of
  the members that step now (``StackedSGD`` for a method whose schedule asks for plain SGD);
  gradient-norm clipping per member where the schedule clips (``clip_per_member``, the
  ``clip_grad_norm_`` formula over that member's tensors). A member whose epoch has fewer
  micro-batches than the others' simply drops out of the later steps of that epoch.

The math is the sequential math: the same micro-batches in the same order (the same named random
streams), the same accumulation boundaries and the same updates. What differs: floating-point
summation order (concatenated batches, batched matmuls), and dropout masks, which are drawn from the
global torch generator once for the whole stack instead of per participant in turn. With dropout
probabilities 0 a round ends in the same state up to float32 rounding (tests/test_batched.py).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from fedhisto.config.study import Config
from fedhisto.fedmath.lora_aggregators.fold import split_folded
from fedhisto.methods.base import Batch, BatchInputs, restyle_views
from fedhisto.methods.objective import Objective
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.train.optimizer_state import keeps_state
from fedhisto.train.plan import (
    LocalResult,
    LossMeans,
    MemberJob,
    batch_of,
    check_optimizer,
    epoch_batches,
    local_run,
    seed_round,
    steps_now,
)
from fedhisto.train.stacked_optim import STACKED_OPTIMIZERS, StackedAdamW, StackedSGD, clip_per_member
from fedhisto.train.view_workers import StepsAhead, step_views, view_workers

__all__ = ["STACKED_OPTIMIZERS", "Layout", "StackedAdamW", "StackedSGD", "batched_local_train", "clip_per_member",
           "compiled_embedding", "member_pathway", "stack_states", "stacked_forward"]


@dataclass
class Layout:
    """How the rows of one concatenated forward split into (member, rows) groups, in order."""

    members: list[int] = field(default_factory=list)       # member of each group
    sizes: list[int] = field(default_factory=list)         # rows (images) of each group
    specs: list[Any] = field(default_factory=list)         # restyle spec of each group, or None
    index: torch.Tensor | None = None                      # members as a device tensor (uniform groups)

    @property
    def uniform(self) -> bool:
        return len(set(self.sizes)) == 1

    def clear(self) -> None:
        """Empty, for the next step's groups: the engine keeps one ``Layout`` per round, which the member
        pathway (patched once per round) reads at every pass."""
        self.members, self.sizes, self.specs, self.index = [], [], [], None

    def spans(self) -> Iterator[tuple[int, int, int]]:
        start = 0
        for m, n in zip(self.members, self.sizes, strict=True):
            yield m, start, start + n
            start += n


# ---------------------------------------------------------------------------- forward
_LORA_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _lora_modules(model: FedHistoModel) -> dict[str, tuple[torch.nn.Module, str, str]]:
    """peft LoRA layers of the encoder -> (module, name of A, name of B) in the trainable state.

    Found once per model (a walk over every module, hundreds per step otherwise): the LoRA layers
    are fixed when peft wraps the encoder."""
    if model not in _LORA_LAYERS:
        out = {}
        for name, module in model.named_modules():
            if hasattr(module, "lora_A") and hasattr(module, "base_layer") and "default" in module.lora_A:
                out[name] = (module, f"{name}.lora_A.default.weight", f"{name}.lora_B.default.weight")
        _LORA_LAYERS[model] = out
    return _LORA_LAYERS[model]


@contextmanager
def lora_members(model: FedHistoModel, params: dict[str, torch.Tensor], layout: Layout) -> Iterator[None]:
    """Within: every LoRA layer adds the delta of the member each row group belongs to."""
    patched = []
    for module, a_name, b_name in _lora_modules(model).values():
        scaling = module.scaling["default"]
        drop = module.lora_dropout["default"]
        p_drop = drop.p if isinstance(drop, torch.nn.Dropout) else 0.0

        def forward(x, *args, _m=module, _a=a_name, _b=b_name, _s=scaling, _p=p_drop, **kwargs):
            result = _m.base_layer(x, *args, **kwargs)
            a, b = params[_a], params[_b]                             # (M, r, in), (M, out, r)
            xd = F.dropout(x, _p, _m.training) if _p else x
            if a.dtype != xd.dtype and not torch.is_autocast_enabled(xd.device.type):
                xd = xd.to(a.dtype)
            if layout.uniform:
                groups = xd.reshape(len(layout.sizes), -1, xd.shape[-1])
                delta = torch.bmm(torch.bmm(groups, a[layout.index].transpose(1, 2)), b[layout.index].transpose(1, 2))
                delta = delta.reshape(*result.shape[:-1], delta.shape[-1])
            else:
                delta = torch.cat([(xd[s:e] @ a[m].T) @ b[m].T for m, s, e in layout.spans()])
            return (result + delta * _s).to(result.dtype)

        module.forward = forward
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def member_restyle(model: FedHistoModel, method: Objective, layout: Layout):
    """``methods.base.restyle_views`` over the layout's (member, view) row groups, each with its spec."""
    return restyle_views(model, method, lambda: [(s, e, spec) for (_m, s, e), spec
                                                 in zip(layout.spans(), layout.specs, strict=True)])


class _Head(torch.nn.Module):
    """The model's pathway after the encoder (``FedHistoModel.head``) as a module, so one member's
    head tensors can be swapped in by ``torch.func.functional_call``."""

    def __init__(self, model: FedHistoModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, cls: torch.Tensor, descriptor: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.head(cls, descriptor)


def member_heads(model: FedHistoModel, params: dict[str, torch.Tensor], layout: Layout, cls: torch.Tensor,
                 descriptors: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row group's member head (adapter, FiLM, classifier: the model's own modules, with that
    member's tensors). Returns logits and z in row order."""
    head = _Head(model)
    names = [n for n in params if not n.startswith("encoder.")]
    # tie_weights=False: the head has no tied tensors, and untying walks every module of the model
    # (the encoder's too) on each call, which cost more than the head's matmuls on the tiny encoder
    outs = [torch.func.functional_call(head, {f"model.{n}": params[n][m] for n in names},
                                       (cls[s:e], descriptors[m] if descriptors is not None else None),
                                       tie_weights=False)
            for m, s, e in layout.spans()]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


@contextmanager
def member_pathway(model: FedHistoModel, method: Objective, params: dict[str, torch.Tensor],
                   layout: Layout) -> Iterator[None]:
    """Both patches of the encoder (member LoRA, member restyling); enter once around many passes
    (e.g. under torch.compile) and call ``stacked_forward(..., patched=True)`` inside."""
    with lora_members(model, params, layout), member_restyle(model, method, layout):
        yield


def stacked_forward(model: FedHistoModel, method: Objective, params: dict[str, torch.Tensor], layout: Layout,
                    pixels: torch.Tensor, descriptors: torch.Tensor | None,
                    patched: bool = False, embed: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One encoder pass over every group's rows with its member's LoRA, then the member heads.

    params: member-stacked trainable tensors (M, ...); descriptors: (M, 1, 14) or None; embed: the
    encoder pass to call (default ``model.encoder_embedding``; ``compiled_embedding`` under train.compile).
    Returns logits (N, classes) and z (N, d) in row order."""
    embed = embed or model.encoder_embedding
    if patched:
        cls = embed(pixels)
    else:
        with member_pathway(model, method, params, layout):
            cls = embed(pixels)
    return member_heads(model, params, layout, cls, descriptors)


def _encoder_pass(model: FedHistoModel, pixels: torch.Tensor) -> torch.Tensor:
    return model.encoder_embedding(pixels)


@functools.cache
def _compiled_pass() -> Callable:
    """The one torch.compile wrapper of the process, made on first use."""
    return torch.compile(_encoder_pass)


def compiled_embedding(model: FedHistoModel) -> Callable[[torch.Tensor], torch.Tensor]:
    """``train.compile``: ``torch.compile`` of the encoder pass (LoRA members patched in), forward and
    backward. The member heads stay eager (a few small matmuls per member). The engine patches the
    encoder once per round and refills one ``Layout`` per step; dynamo guards on the patched forwards'
    code and the layout's values, so a graph is reused while the row layout repeats (no new graph
    after a layout's first step, tests/test_gpu_path.py); a new layout (fewer active members, a short
    last micro-batch) compiles once more. One wrapper for the process (graphs are cached per model by
    dynamo's guards), so every round of a run reuses the graphs compiled in its first round."""
    compiled = _compiled_pass()
    return lambda pixels: compiled(model, pixels)


# ---------------------------------------------------------------------------- engine
def stack_states(states: Sequence[dict[str, torch.Tensor]], device: torch.device) -> dict[str, torch.Tensor]:
    """Member-stacked leaf tensors (M, ...) that require grad, in the first state's key order."""
    return {n: torch.stack([s[n].to(device, torch.float32) for s in states]).requires_grad_(True)
            for n in states[0]}


def batched_local_train(method: Objective, model: FedHistoModel, jobs: Sequence[MemberJob], cfg: Config,
                        device: torch.device) -> list[LocalResult]:
    """``local_train`` for every job at once (``method``: the client objective); returns one ``LocalResult`` per
    job, in order."""
    if not jobs:
        return []
    plan = method.local_schedule(jobs[0].round_idx)
    check_optimizer(method, plan, tuple(STACKED_OPTIMIZERS), "batched")
    seed_round(jobs[0])  # one dropout stream for the whole stack
    model.train()
    n_members = len(jobs)
    # one encoder pass for every member: they must share its frozen weights (FedEx-LoRA's folded base deltas)
    starts = [split_folded(j.start_state) for j in jobs]
    if any(set(f) != set(starts[0][1]) or any(not torch.equal(f[k], starts[0][1][k]) for k in f)
           for _, f in starts[1:]):
        raise ValueError("the batched engine shares one frozen encoder per round, but the members start from "
                         "different folded base deltas; use train.engine: sequential")
    model.fold_base(starts[0][1])
    params = stack_states([s for s, _ in starts], device)
    declared = [method.trained(j.start_state, j.payload) for j in jobs]  # what each member trains (declared)
    if unknown := sorted(set(declared[0]) - set(params)):
        raise ValueError(f"{method.name}: declares trained tensors that are not in the start state: {unknown[:3]}")
    if any(set(d) != set(declared[0]) for d in declared[1:]):
        raise ValueError(f"{method.name}: the batched engine steps every member's tensors together, but the members "
                         "declare different trained tensors; use train.engine: sequential")
    for n, p in params.items():  # a tensor the method does not train (a frozen LoRA factor): no gradient, no step
        p.requires_grad_(n in declared[0])
    trained = {n: p for n, p in params.items() if p.requires_grad}
    masks = {n: torch.stack([d[n].to(device, torch.float32) if d[n] is not None else torch.ones_like(trained[n][0])
                             for d in declared]) for n in trained if any(d[n] is not None for d in declared)}
    opt = STACKED_OPTIMIZERS["adamw" if plan.optimizer == "adam" else plan.optimizer](trained, plan.lr, plan.weight_decay)
    kept = keeps_state(cfg)
    if any(j.optimizer_state is not None for j in jobs):
        if not kept:  # never silently dropped
            raise ValueError("a kept optimiser state was passed but train.readings.optimizer_state is per_round")
        opt.load_members([j.optimizer_state for j in jobs],
                         [f"client {j.client_idx}, round {j.round_idx + 1}" for j in jobs])
    descriptors = (torch.stack([j.descriptor.to(device)[None] for j in jobs])
                   if all(j.descriptor is not None for j in jobs) else None)
    runs = [local_run(model, j, cfg, plan, device, {}) for j in jobs]
    losses = [LossMeans() for _ in jobs]
    updates = [0] * n_members
    autocast = runs[0].autocast
    embed = compiled_embedding(model) if cfg.train.compile else None
    # the encoder is patched once per round (member LoRA, member restyling), not per step: the patched
    # forwards and the restyle hook read this one layout, refilled at every step
    layout = Layout()
    with ExitStack() as stack:
        for run in runs:
            stack.enter_context(method.local_session(run))
        stack.enter_context(member_pathway(model, method, params, layout))
        workers = view_workers(cfg.train.view_workers, device, "batched", cfg.train.view_pipeline)
        pool = stack.enter_context(ThreadPoolExecutor(workers, thread_name_prefix="views")) if workers else None
        for epoch in range(plan.epochs):
            batches = [epoch_batches(j, epoch, plan.micro_batch) for j in jobs]
            n_steps = max(len(x) for x in batches)
            ahead = StepsAhead(functools.partial(step_views, method, cfg, jobs, runs, batches, plan, epoch, pool,
                                                 device.type == "cuda"), n_steps, workers)
            stack.callback(ahead.close)
            for b in range(n_steps):
                active = [m for m in range(n_members) if b < len(batches[m])]
                members_batches: dict[int, Batch] = {}
                inputs = {}
                slices = {n: p.unbind(0) for n, p in params.items()}
                made = ahead.get(b)  # host views made by the view workers while earlier steps ran
                for m in active:
                    runs[m].params = {n: s[m] for n, s in slices.items()}
                    members_batches[m] = batch_of(jobs[m], plan, epoch, b, batches[m][b], device)
                    inputs[m] = (BatchInputs(made[m]) if made is not None
                                 else method.batch_inputs(runs[m], members_batches[m]))
                n_views = len(inputs[active[0]].views)
                layout.clear()
                pixels = []
                for k in range(n_views):  # view-major: a member's views keep their order in the pass
                    for m in active:
                        view = inputs[m].views[k]
                        layout.members.append(m)
                        layout.sizes.append(view.shape[0])
                        layout.specs.append(inputs[m].spec(k))
                        pixels.append(view)
                layout.index = torch.tensor(layout.members, device=device)
                x = torch.cat(pixels).to(device, non_blocking=True)
                with autocast():
                    logits, zs = stacked_forward(model, method, params, layout, x, descriptors, patched=True,
                                                 embed=embed)
                logits, zs = logits.float(), zs.float()
                per_member: dict[int, tuple[list, list]] = {m: ([], []) for m in active}
                for m, s, e in layout.spans():
                    per_member[m][0].append(logits[s:e])
                    per_member[m][1].append(zs[s:e])
                total = 0
                for m in active:
                    terms = method.terms_from_outputs(runs[m], members_batches[m], *per_member[m])
                    total = total + sum(terms.values()) / plan.accumulation
                    losses[m].add(terms)
                total.backward()
                due = [m in active and steps_now(b, len(batches[m]), plan.accumulation) for m in range(n_members)]
                if any(due):
                    mask = torch.tensor(due, device=device)
                    for n, m in masks.items():  # a member's structurally zero block (its declared mask) stays 0
                        trained[n].grad.mul_(m)
                    if plan.grad_clip is not None:  # the method's schedule says (a paper's unclipped SGD: none)
                        clip_per_member(trained, plan.grad_clip, mask)
                    opt.step(mask)
                    opt.zero_grad(mask)
                    updates = [u + int(d) for u, d in zip(updates, due, strict=True)]
    return [LocalResult({n: p[m].detach().clone() for n, p in params.items()}, len(j.data), losses[m].means(),
                        updates[m], opt.member_state(m) if kept else None) for m, j in enumerate(jobs)]
