"""The batched engine's optimisers over member-stacked tensors (``train.batched``): torch's AdamW and plain
SGD applied per member, with a per-member step count and a mask of the members that step, and
``clip_grad_norm_`` per member."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedhisto.train.optimizer_state import OptimizerState, check_names


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
    def load_members(self, states: Sequence[OptimizerState | None], where: Sequence[str]) -> None:
        """Each member's kept state (None: fresh). One step count per member: its tensors stepped together."""
        shapes = {n: tuple(p.shape[1:]) for n, p in self.params.items()}
        for m, state in enumerate(states):
            if not state:
                continue
            check_names(state, shapes, where[m])
            steps = {float(s["step"]) for s in state.values()}
            if len(steps) != 1 or set(state) != set(self.params):
                raise ValueError(f"{where[m]}: the batched engine keeps one step count per member, but the kept "
                                 f"state has step counts {sorted(steps)} over {len(state)} of {len(self.params)} "
                                 "tensors")
            self.steps[m] = steps.pop()
            for n, s in state.items():
                self.exp_avg[n][m] = s["exp_avg"].to(self.exp_avg[n].device, self.exp_avg[n].dtype)
                self.exp_avg_sq[n][m] = s["exp_avg_sq"].to(self.exp_avg_sq[n].device, self.exp_avg_sq[n].dtype)

    def member_state(self, m: int) -> OptimizerState:
        """Member ``m``'s state in the engine-neutral form (CPU copies), as torch's AdamW would hold it."""
        if self.steps[m] == 0:
            return {}  # never stepped: torch would hold no state either
        return {n: {"step": float(self.steps[m]), "exp_avg": self.exp_avg[n][m].detach().cpu().clone(),
                    "exp_avg_sq": self.exp_avg_sq[n][m].detach().cpu().clone()} for n in self.params}

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


class StackedSGD:
    """torch.optim.SGD without momentum over member-stacked tensors: p <- p - lr (g + wd p) for the
    members in ``mask``; stateless, as torch's SGD without momentum (a kept reading keeps nothing)."""

    def __init__(self, params: dict[str, torch.Tensor], lr: float, weight_decay: float) -> None:
        self.params, self.lr, self.weight_decay = params, lr, weight_decay

    def load_members(self, states: Sequence[OptimizerState | None], where: Sequence[str]) -> None:
        for m, state in enumerate(states):
            if state:
                raise ValueError(f"{where[m]}: plain SGD keeps no optimiser state, but one was passed")

    def member_state(self, m: int) -> OptimizerState:
        return {}

    @torch.no_grad()
    def step(self, mask: torch.Tensor) -> None:
        for p in self.params.values():
            g = p.grad if self.weight_decay == 0 else p.grad + self.weight_decay * p
            p.copy_(torch.where(mask.view((-1,) + (1,) * (p.dim() - 1)), torch.add(p, g, alpha=-self.lr), p))

    zero_grad = StackedAdamW.zero_grad


STACKED_OPTIMIZERS = {"adamw": StackedAdamW, "sgd": StackedSGD}


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
