"""``train.readings.optimizer_state``: a client's AdamW created afresh every round, or kept by the client.

The study trains each client with AdamW for ``local_epochs`` per round and does not say whether the
optimiser lives on between rounds. ``per_round`` (the pipeline's reading, the default) creates it at
every round's local training: moments zero, step count 0. ``kept`` is what a PyTorch
re-implementation that builds each client's optimiser once and never re-creates it does: the
client's exp_avg, exp_avg_sq and step count carry over from its previous local training to the
next. At the start of a round the client's parameters are overwritten by the start state the
server sends (``load_trainable_state``), the moments are left as they are: they were accumulated
with respect to the client's own last local iterate, and AdamW continues from them (bias
correction with the continued step count) on the new start point.

The state is the client's: it never travels to the server, so nothing in the exchanged state or
the traffic accounting changes. A client unavailable for a round keeps its state for the next round
it trains. The in-process participants (``train.participants.InProcess``) hold every client's state
and checkpoint it with the run (``ckpt["participants"]["optimizer"]``), so a resumed run continues
with the moments the interrupted one had. A Flower site keeps nothing between messages, so the
Flower engine refuses ``kept`` (``federation_refusal``).

One engine-neutral form per client, ``OptimizerState``: trainable tensor name -> {"step": float,
"exp_avg": tensor, "exp_avg_sq": tensor}, on the CPU; the sequential engine (torch.optim.AdamW /
Adam, ``load_into`` / ``read_from``) and the batched one (``StackedAdamW.load_members`` /
``member_state``) read and write it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

#: trainable tensor name -> {"step": float, "exp_avg": tensor, "exp_avg_sq": tensor}
OptimizerState = dict[str, dict[str, Any]]
KEYS = ("step", "exp_avg", "exp_avg_sq")


def keeps_state(cfg: Any) -> bool:
    """Whether the run's clients keep their optimiser state across rounds."""
    return cfg.train.readings.optimizer_state == "kept"


def check_names(state: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """A kept state names only trainable tensors of this model, each with AdamW's three entries in the
    tensor's shape (a state from another model is refused, never half-loaded)."""
    unknown = sorted(set(state) - set(shapes))
    if unknown:
        raise ValueError(f"{where}: kept optimiser state names tensors the model does not train: {unknown[:3]}")
    for name, entry in state.items():
        missing = [k for k in KEYS if k not in entry]
        if missing:
            raise ValueError(f"{where}: kept optimiser state of {name!r} lacks {missing}")
        for k in KEYS[1:]:
            if tuple(entry[k].shape) != tuple(shapes[name]):
                raise ValueError(f"{where}: kept optimiser state {name!r}.{k} has shape {tuple(entry[k].shape)}, "
                                 f"the tensor {tuple(shapes[name])}")


def load_into(opt: torch.optim.Optimizer, params: dict[str, torch.Tensor], state: OptimizerState | None,
              where: str) -> None:
    """Give a freshly built torch Adam/AdamW over ``params`` (one parameter group, in ``params``' order)
    the kept state, through ``load_state_dict`` (which puts moments on each parameter's device and
    dtype). A tensor without kept state starts fresh, as torch's lazy state would."""
    if not state:
        return
    check_names(state, {n: tuple(p.shape) for n, p in params.items()}, where)
    index = {n: i for i, n in enumerate(params)}
    saved = opt.state_dict()
    saved["state"] = {index[n]: {"step": torch.tensor(float(s["step"]), dtype=torch.float32),
                                 "exp_avg": s["exp_avg"].detach().clone(),
                                 "exp_avg_sq": s["exp_avg_sq"].detach().clone()} for n, s in state.items()}
    opt.load_state_dict(saved)


def read_from(opt: torch.optim.Optimizer, params: dict[str, torch.Tensor]) -> OptimizerState:
    """The optimiser's state after local training, on the CPU (copies: the optimiser may live on)."""
    out: OptimizerState = {}
    for name, p in params.items():
        s = opt.state.get(p)
        if s:  # torch creates a tensor's state at its first step with a gradient
            out[name] = {"step": float(s["step"]), "exp_avg": s["exp_avg"].detach().cpu().clone(),
                         "exp_avg_sq": s["exp_avg_sq"].detach().cpu().clone()}
    return out


def federation_refusal(cfg: Any) -> str | None:
    """Why a Flower run cannot use this configuration's optimiser-state reading (None: it can)."""
    if keeps_state(cfg):
        return ("train.readings.optimizer_state: kept needs every site to keep its AdamW moments from one round's "
                "local training to the next, and a Flower site keeps no state between messages; run the in-process "
                "engine (sequential or batched) or set it to per_round")
    return None


__all__ = ["OptimizerState", "federation_refusal", "keeps_state", "load_into", "read_from"]
