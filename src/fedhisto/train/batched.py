"""Every member of a round (clients, and seeds of a method) trained together: the batched engine.

The sequential engine (``train.local.local_train``) runs one participant's local epochs after the
other. Here the trainable state of M *members* (one participant's run each: start state, data,
descriptor, payload, seed, round, client index) is stacked along a leading member axis, and every
micro-batch step runs ONE forward/backward of the frozen encoder over all active members' views:

- LoRA: each targeted ``Linear`` adds its member's low-rank delta, ``(x_m A_m^T) B_m^T * scaling``,
  as batched matmuls over (member, rows) groups (``lora_members``);
- residual adapter, FiLM and classifier: batched matmuls over the same groups (``head_forward``);
- feature restyling (FedStain's MixStyle) is applied to each member's rows with that member's random
  stream (``Method.restyle``);
- loss terms per member come from the method's own ``batch_inputs`` / ``terms_from_outputs``, so
  the objective is the sequential one; the members' losses are summed (their gradients do not mix);
- ``StackedAdamW``: torch.optim.AdamW's update per member, with per-member step counts and a mask of
  the members that step now; gradient-norm clipping per member (``clip_per_member``, the
  ``clip_grad_norm_`` formula over that member's tensors). A member whose epoch has fewer
  micro-batches than the others' simply drops out of the later steps of that epoch.

The math is the sequential math: the same micro-batches in the same order (the same named random
streams), the same accumulation boundaries and the same updates. What differs: floating-point
summation order (concatenated batches, batched matmuls), and dropout masks, which are drawn from the
global torch generator once for the whole stack instead of per participant in turn. With dropout
probabilities 0 a round ends in the same state up to float32 rounding (tests/test_batched.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from fedhisto.config import Config
from fedhisto.fedmath.losses import class_balanced_weights
from fedhisto.methods.base import Batch, LocalRun, Method, named_rng
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.train.data import Split
from fedhisto.train.local import LocalResult

HEAD_PREFIXES = ("adapter.", "film.", "classifier.")


@dataclass
class MemberJob:
    """One participant's local training of one round, as ``local_train`` takes it."""

    start_state: dict[str, torch.Tensor]
    data: Split
    descriptor: torch.Tensor | None
    payload: dict[str, Any]
    seed: int
    round_idx: int
    client_idx: int


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

    def spans(self) -> Iterator[tuple[int, int, int]]:
        start = 0
        for m, n in zip(self.members, self.sizes, strict=True):
            yield m, start, start + n
            start += n


# ---------------------------------------------------------------------------- optimiser
class StackedAdamW:
    """torch.optim.AdamW (amsgrad off) over member-stacked tensors, one step count per member.

    ``step(mask)`` updates only the members where ``mask`` is true, exactly as AdamW would for each:
    p <- p (1 - lr wd); m <- lerp(m, g, 1 - b1); v <- b2 v + (1 - b2) g^2;
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
    """

    def __init__(self, params: dict[str, torch.Tensor], lr: float, weight_decay: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.params = params
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        first = next(iter(params.values()))
        self.steps = torch.zeros(first.shape[0], dtype=torch.float64, device=first.device)
        self.exp_avg = {n: torch.zeros_like(p) for n, p in params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(p) for n, p in params.items()}

    @torch.no_grad()
    def step(self, mask: torch.Tensor) -> None:
        b1, b2 = self.betas
        self.steps += mask.to(self.steps.dtype)
        t = self.steps.clamp(min=1)
        # in float64 as AdamW's Python scalars, then float32 as the kernels see them
        step_size = (self.lr / (1 - b1 ** t)).float()
        bc2_sqrt = (1 - b2 ** t).sqrt().float()
        decay = 1 - self.lr * self.weight_decay
        for n, p in self.params.items():
            shape = (-1,) + (1,) * (p.dim() - 1)
            keep = mask.view(shape)
            g = p.grad
            decayed = p * decay
            m = torch.lerp(self.exp_avg[n], g, 1 - b1)
            v = self.exp_avg_sq[n] * b2 + (1 - b2) * g * g
            denom = v.sqrt() / bc2_sqrt.view(shape) + self.eps
            new = decayed - step_size.view(shape) * m / denom
            p.copy_(torch.where(keep, new, p))
            self.exp_avg[n] = torch.where(keep, m, self.exp_avg[n])
            self.exp_avg_sq[n] = torch.where(keep, v, self.exp_avg_sq[n])

    @torch.no_grad()
    def zero_grad(self, mask: torch.Tensor) -> None:
        for p in self.params.values():
            if p.grad is not None:
                p.grad.masked_fill_(mask.view((-1,) + (1,) * (p.dim() - 1)), 0.0)


@torch.no_grad()
def clip_per_member(params: dict[str, torch.Tensor], max_norm: float, mask: torch.Tensor) -> torch.Tensor:
    """``clip_grad_norm_`` per member over that member's slices, for the members in ``mask``:
    total = ||(||g_1||, ||g_2||, ...)||, g <- g * min(1, max_norm / (total + 1e-6)). Returns the norms."""
    grads = [p.grad for p in params.values()]
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), 2, dim=1) for g in grads])  # (tensors, M)
    total = torch.linalg.vector_norm(norms, 2, dim=0)
    coef = torch.where(mask, (max_norm / (total + 1e-6)).clamp(max=1.0), torch.ones_like(total))
    for g in grads:
        g.mul_(coef.view((-1,) + (1,) * (g.dim() - 1)).to(g.dtype))
    return total


# ---------------------------------------------------------------------------- forward
def _lora_modules(model: FedHistoModel) -> dict[str, tuple[torch.nn.Module, str, str]]:
    """peft LoRA layers of the encoder -> (module, name of A, name of B) in the trainable state."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer") and "default" in module.lora_A:
            out[name] = (module, f"{name}.lora_A.default.weight", f"{name}.lora_B.default.weight")
    return out


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (G, n, in) @ weight (G, out, in)^T + bias (G, out): one linear layer per group."""
    if bias is None:
        return torch.bmm(x, weight.transpose(1, 2))
    return torch.baddbmm(bias[:, None, :], x, weight.transpose(1, 2))


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


@contextmanager
def member_restyle(model: FedHistoModel, method: Method, layout: Layout) -> Iterator[None]:
    """A forward hook on the method's restyle block that restyles each group that carries a spec."""
    layer = method.restyle_layer()
    if layer is None:
        yield
        return

    def hook(_module, _inputs, output):
        if all(s is None for s in layout.specs):
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        parts = []
        for (_m, s, e), spec in zip(layout.spans(), layout.specs, strict=True):
            parts.append(hidden[s:e] if spec is None else method.restyle(hidden[s:e], spec))
        mixed = torch.cat(parts)
        return (mixed, *output[1:]) if isinstance(output, tuple) else mixed

    handle = model.encoder_blocks()[layer].register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def head_forward(model: FedHistoModel, params: dict[str, torch.Tensor], cls: torch.Tensor,
                 descriptor: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Adapter, FiLM and classifier of G members at once: cls (G, n, d), params (G, ...), descriptor
    (G, 1, 14) or None. Returns logits (G, n, classes) and z (G, n, d), as ``FedHistoModel.forward``."""
    ad = model.adapter
    h = F.layer_norm(cls, cls.shape[-1:], eps=ad.norm.eps)
    h = h * params["adapter.norm.weight"][:, None] + params["adapter.norm.bias"][:, None]
    h = _grouped_linear(h, params["adapter.down.weight"], params["adapter.down.bias"])
    h = F.dropout(F.gelu(h), ad.drop.p, model.training)
    z = cls + _grouped_linear(h, params["adapter.up.weight"], params["adapter.up.bias"])
    if model.film is not None:
        if descriptor is None:
            raise ValueError("this model has FiLM: pass a stain descriptor (zeros for FiLM-Zero)")
        f = F.gelu(_grouped_linear(descriptor.to(z.dtype), params["film.hidden.weight"], params["film.hidden.bias"]))
        gamma, beta = _grouped_linear(f, params["film.out.weight"], params["film.out.bias"]).chunk(2, dim=-1)
        z = z * (1 + model.film.scale * gamma) + model.film.scale * beta
    return _grouped_linear(z, params["classifier.weight"], params["classifier.bias"]), z


@contextmanager
def member_pathway(model: FedHistoModel, method: Method, params: dict[str, torch.Tensor],
                   layout: Layout) -> Iterator[None]:
    """Both patches of the encoder (member LoRA, member restyling); enter once around many passes
    (e.g. under torch.compile) and call ``stacked_forward(..., patched=True)`` inside."""
    with lora_members(model, params, layout), member_restyle(model, method, layout):
        yield


def stacked_forward(model: FedHistoModel, method: Method, params: dict[str, torch.Tensor], layout: Layout,
                    pixels: torch.Tensor, descriptors: torch.Tensor | None,
                    patched: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One encoder pass over every group's rows with its member's LoRA, then the member heads.

    params: member-stacked trainable tensors (M, ...); descriptors: (M, 1, 14) or None.
    Returns logits (N, classes) and z (N, d) in row order."""
    if patched:
        cls = model.encoder_embedding(pixels)
    else:
        with member_pathway(model, method, params, layout):
            cls = model.encoder_embedding(pixels)
    head = {n: p for n, p in params.items() if n.startswith(HEAD_PREFIXES)}
    if layout.uniform:
        g = {n: p[layout.index] for n, p in head.items()}
        d = descriptors[layout.index] if descriptors is not None else None
        logits, z = head_forward(model, g, cls.reshape(len(layout.sizes), -1, cls.shape[-1]), d)
        return logits.reshape(-1, logits.shape[-1]), z.reshape(-1, z.shape[-1])
    outs = [head_forward(model, {n: p[m:m + 1] for n, p in head.items()}, cls[None, s:e],
                         descriptors[m:m + 1] if descriptors is not None else None) for m, s, e in layout.spans()]
    return torch.cat([o[0][0] for o in outs]), torch.cat([o[1][0] for o in outs])


# ---------------------------------------------------------------------------- engine
def stack_states(states: Sequence[dict[str, torch.Tensor]], device: torch.device) -> dict[str, torch.Tensor]:
    """Member-stacked leaf tensors (M, ...) that require grad, in the first state's key order."""
    return {n: torch.stack([s[n].to(device, torch.float32) for s in states]).requires_grad_(True)
            for n in states[0]}


def batched_local_train(method: Method, model: FedHistoModel, jobs: Sequence[MemberJob], cfg: Config,
                        device: torch.device) -> list[LocalResult]:
    """``local_train`` for every job at once; returns one ``LocalResult`` per job, in order."""
    t = cfg.train
    if not jobs:
        return []
    plan = method.local_schedule(jobs[0].round_idx)
    if plan.optimizer != "adamw":
        raise NotImplementedError(f"{method.name}: the batched engine implements AdamW, this schedule asks for "
                                  f"{plan.optimizer!r}; use train.engine: sequential")
    torch.manual_seed(int(named_rng("torch", jobs[0].seed, jobs[0].round_idx, jobs[0].client_idx).integers(2**62)))
    model.train()
    n_members = len(jobs)
    params = stack_states([j.start_state for j in jobs], device)
    opt = StackedAdamW(params, plan.lr, plan.weight_decay)
    descriptors = (torch.stack([j.descriptor.to(device)[None] for j in jobs])
                   if all(j.descriptor is not None for j in jobs) else None)
    runs = [LocalRun(model=model, data=j.data,
                     descriptor=j.descriptor.to(device)[None] if j.descriptor is not None else None,
                     payload=j.payload, start_state={k: v.to(device) for k, v in j.start_state.items()},
                     params={}, ce_weights=class_balanced_weights(j.data.class_counts(), t.cb_beta, t.cb_cap).to(device),
                     nominal_batch=plan.micro_batch, cfg=cfg, seed=j.seed, round_idx=j.round_idx, client_idx=j.client_idx, device=device)
            for j in jobs]
    micro, accum = plan.micro_batch, plan.accumulation
    sums: list[dict[str, torch.Tensor]] = [{} for _ in jobs]
    steps = [0] * n_members
    updates = [0] * n_members
    autocast = runs[0].autocast
    with ExitStack() as stack:
        for run in runs:
            stack.enter_context(method.local_session(run))
        for epoch in range(plan.epochs):
            batches = []
            for j in jobs:
                order = named_rng("order", j.seed, j.round_idx, j.client_idx, epoch).permutation(len(j.data))
                batches.append([order[i:i + micro] for i in range(0, len(order), micro)])
            for b in range(max(len(x) for x in batches)):
                active = [m for m in range(n_members) if b < len(batches[m])]
                members_batches: dict[int, Batch] = {}
                inputs = {}
                slices = {n: p.unbind(0) for n, p in params.items()}
                for m in active:
                    j, idx = jobs[m], batches[m][b]
                    runs[m].params = {n: s[m] for n, s in slices.items()}
                    y = torch.tensor([j.data.labels[i] for i in idx], device=device)
                    members_batches[m] = Batch(idx, y, epoch, j.round_idx * plan.epochs + epoch, b)
                    inputs[m] = method.batch_inputs(runs[m], members_batches[m])
                n_views = len(inputs[active[0]].views)
                layout = Layout()
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
                    logits, zs = stacked_forward(model, method, params, layout, x, descriptors)
                logits, zs = logits.float(), zs.float()
                per_member: dict[int, tuple[list, list]] = {m: ([], []) for m in active}
                for m, s, e in layout.spans():
                    per_member[m][0].append(logits[s:e])
                    per_member[m][1].append(zs[s:e])
                total = 0
                for m in active:
                    terms = method.terms_from_outputs(runs[m], members_batches[m], *per_member[m])
                    total = total + sum(terms.values()) / accum
                    for k, v in terms.items():
                        acc = sums[m].get(k)
                        sums[m][k] = v.detach() if acc is None else acc + v.detach()
                    steps[m] += 1
                total.backward()
                due = [m in active and ((b + 1) % accum == 0 or b + 1 == len(batches[m])) for m in range(n_members)]
                if any(due):
                    mask = torch.tensor(due, device=device)
                    clip_per_member(params, t.grad_clip, mask)
                    opt.step(mask)
                    opt.zero_grad(mask)
                    updates = [u + int(d) for u, d in zip(updates, due, strict=True)]
    out = []
    for m, j in enumerate(jobs):
        state = {n: p[m].detach().clone() for n, p in params.items()}
        losses = {k: float(v) / max(steps[m], 1) for k, v in sums[m].items()}
        out.append(LocalResult(state, len(j.data), losses, updates[m]))
    return out

