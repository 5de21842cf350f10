"""The reference tests' one door into fedhisto.

Every ``tests/test_reference_*.py`` compares one round (or one step) of a registered method, LoRA
aggregator or mechanism with code the project did not write (Flower's strategies, peft, Opacus,
scikit-learn) or with its paper's equations written afresh in the test. The calls into fedhisto
go through the functions here, and only through the entry points every engine uses (the method
registry's ``build_method``, the round driver ``train.loop.run_round``, the hooks of a method's client
half, its ``objective``, the sequential engine's DP-SGD round), so a change of those interfaces is
adapted in this file alone. A test holds the method as ``build_method`` returns it, its server half
(the strategy); the client hooks are reached through it here.

Bookkeeping (what each test covers, :class:`Reference`; the checked and recorded difference, :func:`check`)
is ``reference_record``'s; both are handed to the tests from here, with the glue.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from reference_record import Reference as Reference  # re-exported: a test imports from one place
from reference_record import check as check

State = dict[str, torch.Tensor]


# ------------------------------------------------------------------ what is registered
def registered_methods() -> list[str]:
    from fedhisto.methods import method_names

    return method_names()


def registered_aggregators() -> list[str]:
    from fedhisto.fedmath.lora_aggregators import AGGREGATORS

    return list(AGGREGATORS)


# ------------------------------------------------------------------ fedhisto: configs, methods, models
# The training tests' tiny encoder (random weights) and head sizes: LoRA r 8, alpha 16 (s = 2) on 64-wide layers.
TINY = {"model": {"encoder": {"name": "tiny", "require_pretrained": False}, "adapter_hidden": 16, "film_hidden": 16},
        "views": {"crop_size": 48}}


def config(**blocks: Any):
    """A validated ``Config``: TINY with ``blocks`` laid over it (``train={...}``, ``privacy={...}``...)."""
    from fedhisto.config.study import load_config

    raw = {k: dict(v) for k, v in TINY.items()}
    for key, value in blocks.items():
        raw[key] = {**raw.get(key, {}), **value}
    return load_config(raw)


def build(name: str, cfg=None):
    """The registered method ``name`` as a run builds it (the registry's one build function)."""
    from fedhisto.methods import build_method

    return build_method(name, cfg if cfg is not None else config())


def model_for(method, cfg=None, dtype: torch.dtype = torch.float64, seed: int = 0):
    """The real PEFT model of ``method`` on the tiny encoder, every trainable tensor drawn N(0, 0.2^2) so
    no factor is trivially 0 (LoRA's B and FiLM's output layer start at 0)."""
    from fedhisto.model.encoder import random_encoder
    from fedhisto.model.peft_model import FedHistoModel

    cfg = cfg if cfg is not None else method.cfg
    torch.manual_seed(seed)
    model = FedHistoModel(random_encoder("tiny"), cfg.model, film=method.film).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=dtype))
    return model


def trainable_state(model) -> State:
    return model.trainable_state()


def lora_keys(state: Mapping[str, torch.Tensor]) -> list[tuple[str, str]]:
    """(A key, B key) of every LoRA pair of a state, by peft's tensor names."""
    return [(k, k.replace("lora_A", "lora_B")) for k in sorted(state) if ".lora_A." in k]


def perturbed(state: State, seed: int, scale: float = 0.1, skip: Callable[[str], bool] = lambda k: False) -> State:
    """A client's trained state: ``state`` plus N(0, scale^2) noise on every tensor but the skipped ones."""
    g = torch.Generator().manual_seed(seed)
    return {k: v.clone() if skip(k) else v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype)
            for k, v in state.items()}


# ------------------------------------------------------------------ one round through the round driver
@dataclass
class Round:
    """What one round through the round driver gave: the members after it, the server state, the
    weights it recorded, and each participant's start state and payload."""

    members: dict[str, State]
    server_state: Any
    weights: dict[str, float]
    starts: dict[str, State]
    payloads: dict[str, dict]


@dataclass
class _Participants:
    """``train.loop.Participants`` whose local training is the test's function (no data, no optimiser)."""

    names: list[str]
    local: Callable[[str, State, dict], tuple[State, int, int]]
    pre: Callable[[str, State], Any] | None = None
    after: Callable[[str, dict[str, State]], Any] | None = None
    seen: dict[str, Any] = field(default_factory=dict)

    def pre_upload(self, r, starts):
        return {n: self.pre(n, starts[n]) for n in self.names}, {}

    def train(self, r, starts, payloads):
        from fedhisto.train.plan import LocalResult

        self.seen.update(starts=starts, payloads=payloads)
        out = {}
        for n in starts:
            state, n_samples, steps = self.local(n, starts[n], payloads[n])
            out[n] = LocalResult(state, n_samples, {}, steps)
        return out, {}

    def post(self, r, members, uploaders):
        return {n: self.after(n, members) for n in uploaders}, {}, {}

    def row_extra(self):
        return {}


def drive_round(method, model, members: dict[str, State], names: list[str],
                local: Callable[[str, State, dict], tuple[State, int, int]], *, server_state: Any = None,
                round_idx: int = 0, pre: Callable[[str, State], Any] | None = None,
                after: Callable[[str, dict[str, State]], Any] | None = None) -> Round:
    """One round of ``method`` through the round driver every engine calls (``train.loop.run_round``):
    ``local(name, start, payload) -> (trained state, samples, optimiser steps)`` stands for each
    participant's local training; ``pre`` / ``after`` for its uploads before training and after aggregation."""
    from fedhisto.train.loop import run_round

    parts = _Participants(list(names), local, pre, after)
    ckpt = {"members": dict(members), "server_state": server_state}
    row, _ = run_round(method, parts, ckpt, round_idx, model)
    return Round(ckpt["members"], ckpt["server_state"], dict(row["weights"]), parts.seen["starts"],
                 parts.seen["payloads"])


def participants(method, clients: Mapping[str, Any]) -> list[str]:
    """Who trains in a round of ``method`` given the clients (``pooled``: one union participant)."""
    return list(method.participants(dict(clients)))


def members_of(method, names: list[str], state: State) -> dict[str, State]:
    """The run's members at the start, every one at ``state``."""
    return {m: state for m in method.members(names)}


def descriptors_of(method, doc: dict, names: list[str]) -> dict[str, torch.Tensor | None]:
    return method.descriptors(doc, names)


# ------------------------------------------------------------------ one step of a client's objective
def objective_terms(method, logits: list[torch.Tensor], zs: list[torch.Tensor], y: torch.Tensor,
                    ce_weights: torch.Tensor, *, payload: dict | None = None, params: State | None = None,
                    start_state: State | None = None, nominal_batch: int | None = None) -> dict[str, torch.Tensor]:
    """The named loss terms of one micro-batch of ``method`` from its views' logits and embeddings
    (the hook both engines call after the forward), inside the method's local session."""
    from fedhisto.methods.base import Batch, training_autocast

    params = params or {}
    device = torch.device("cpu")
    run = SimpleNamespace(cfg=method.cfg, ce_weights=ce_weights, nominal_batch=nominal_batch or len(y),
                          payload=payload or {}, params=params, start_state=start_state or {}, scratch={},
                          device=device, round_idx=0, client_idx=0, seed=11,
                          autocast=lambda: training_autocast(device, method.cfg.train.precision))
    objective = method.objective
    with objective.local_session(run):
        return objective.terms_from_outputs(run, Batch(np.arange(len(y)), y, 0, 0, 0), logits, zs)


def restyle(method, hidden: torch.Tensor, pool: Any, rng: np.random.Generator) -> torch.Tensor:
    """The method's feature restyling of one view's tokens (B, tokens, C) with the pooled statistics
    ``pool`` and the view's generator, as the engines apply it after the method's restyle block."""
    return method.objective.restyle(hidden, (pool, rng, method.objective.settings.mixstyle_alpha))


def restyle_block(method, model) -> torch.nn.Module:
    """The encoder block whose output the method restyles (and whose features its statistics describe)."""
    return model.encoder_blocks()[method.objective.restyle_layer()]


def upload_before_training(method, model, start_state: State, data, seed: int) -> Any:
    """A participant's upload before training (FedStain's statistics), from the generator of ``seed``."""
    return method.objective.upload_before_training(model, start_state, data, np.random.default_rng(seed),
                                                   torch.device("cpu"))


def upload_after_aggregation(method, model, data) -> Any:
    """A participant's upload after aggregation (PAST's prototypes) with ``model`` holding the new global state."""
    return method.objective.upload_after_aggregation(model, data, None, torch.device("cpu"))


def class_weights(method, counts: list[int]) -> torch.Tensor:
    """The site's class-balanced CE weights as the engines compute them from its class counts."""
    from fedhisto.fedmath.losses import class_balanced_weights

    t = method.cfg.train
    return class_balanced_weights(counts, t.cb_beta, t.cb_cap, t.readings.ce_weight_normalisation)


def prototypes_payload(centroids: torch.Tensor, reliability: torch.Tensor, mask: torch.Tensor) -> dict:
    """A round payload carrying the server's global prototypes, as ``configure_train`` hands them out."""
    from fedhisto.fedmath.prototypes import ServerPrototypes

    return {"prototypes": ServerPrototypes(centroids, reliability, mask, mask.float())}


def client_upload(centroids: dict[int, torch.Tensor], counts: dict[int, int]):
    """A client's post-aggregation prototype upload (one centroid and count per present class)."""
    from fedhisto.fedmath.prototypes import ClientPrototypes

    return ClientPrototypes(centroids, counts)




def server_prototypes(state: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(centroids, reliability, mask) of the server state after the post-aggregation exchange."""
    return state["centroids"], state["reliability"], state["mask"]


def split(n: int, seed: int, size: int = 56):
    """A client's optimisation set of ``n`` random RGB images, labels 0, 1, 2, 0, ..."""
    from fedhisto.data.splits import Split

    rng = np.random.default_rng(seed)
    return Split([f"{seed:04x}{k:011x}" for k in range(n)], [k % 3 for k in range(n)],
                 [rng.integers(0, 256, (size, size + 4, 3), dtype=np.uint8) for k in range(n)])


# ------------------------------------------------------------------ LoRA aggregators
def aggregate_pair(name: str, factors: list[tuple[torch.Tensor, torch.Tensor]], weights: list[float], scaling: float,
                   rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(A', B', folded residual or None) of the registered aggregator ``name`` for one module."""
    from fedhisto.fedmath.lora_aggregators import aggregator

    got = aggregator(name).pair(factors, weights, scaling, rank)
    return got.a, got.b, got.residual




def folded(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The folded base deltas of a member state, keyed by the LoRA A key of the module they offset."""
    from fedhisto.fedmath.lora_aggregators.fold import folded_key

    return {a: state[folded_key(a)] for a, _ in lora_keys(state) if folded_key(a) in state}


# ------------------------------------------------------------------ SCAFFOLD's client step
def corrected_steps(method, payload: dict, params: dict[str, torch.nn.Parameter], start: State, n_steps: int) -> Any:
    """A context (the method's local session for a participant training ``params`` from ``start`` in
    ``n_steps`` optimiser steps of one micro-batch each) yielding a function of the step number that
    returns the method's extra loss terms of that step, summed (SCAFFOLD's correction)."""
    from fedhisto.methods.base import Batch

    run = SimpleNamespace(payload=payload, device=torch.device("cpu"), scratch={}, params=params,
                          start_state=start, data=[None] * n_steps, nominal_batch=1, round_idx=0)

    objective = method.objective

    @contextmanager
    def session():
        with objective.local_session(run):
            yield lambda b: sum(objective.extra_terms(run, Batch(None, None, 0, 0, b), [], []).values())

    return session()


def local_schedule(method, round_idx: int = 0):
    """The local schedule (optimiser, lr, weight decay...) the method's participants train round ``round_idx`` by."""
    return method.objective.local_schedule(round_idx)


def local_optimizer(method, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimiser the engines build from the method's local schedule of round 0."""
    from fedhisto.train.local import OPTIMIZERS

    plan = local_schedule(method)
    return OPTIMIZERS[plan.optimizer](params, lr=plan.lr, weight_decay=plan.weight_decay)


# ------------------------------------------------------------------ DP-SGD: the sequential engine's round
@dataclass
class DPRound:
    """What one participant's DP-SGD round through the sequential engine did: the first logical step's
    views, labels and per-unit norms, its clipped sum before the noise, the CE weights of the
    site, and the state the round ends in."""

    views: torch.Tensor
    labels: torch.Tensor
    norms: torch.Tensor
    clipped_sum: State
    ce_weights: torch.Tensor
    state: State
    clipped_names: list[str]
    epsilon: float
    steps: int


def dp_round(method, model, data, start_state: State, *, client: str = "C1", seed: int = 11) -> DPRound:
    """One DP-SGD round of ``client`` through the sequential engine (``train.private.PrivateSites``, which
    calls ``fedhisto.privacy``) with the payload the method's server half sends it in round 0 (a FlexLoRA
    site's rank), the model and views in float64 (the engine's float32 otherwise), with spies on the
    privacy step recording the first logical step's inputs, norms and clipped sum."""
    from fedhisto.privacy import dpsgd, step
    from fedhisto.train.private import PrivateSites

    seen: dict[str, Any] = {}
    real_grads, real_add, real_release = step.per_unit_gradients, dpsgd.NoisyGradientSum.add, \
        dpsgd.NoisyGradientSum.release

    def grads(model_, unit_loss, views, labels, *args, **kwargs):
        if "views" not in seen:
            seen.update(views=views.detach().clone(), labels=labels.clone(), ce_weights=unit_loss.ce_weights)
        return real_grads(model_, unit_loss, views, labels, *args, **kwargs)

    def add(self, per_unit):
        norms = real_add(self, per_unit)
        seen.setdefault("norms", norms.detach().clone())
        seen.setdefault("names", sorted(per_unit))
        return norms

    def release(self, like, generator, *args, **kwargs):
        seen.setdefault("clipped", {k: v.detach().clone() for k, v in self.total.items()})
        return real_release(self, like, generator, *args, **kwargs)

    objective = method.objective
    real_inputs = objective.batch_inputs

    def inputs64(run, batch):  # the engine's views, in the model's float64
        got = real_inputs(run, batch)
        got.views = [v.double() for v in got.views]
        return got

    cfg = method.cfg
    payload = method.configure_train(0, None, {client: None})[client]  # what the server sends (a site's rank)
    sites = PrivateSites.start(cfg, objective, {client: data}, None, seed)
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(step, "per_unit_gradients", grads)
        mp.setattr(dpsgd.NoisyGradientSum, "add", add)
        mp.setattr(dpsgd.NoisyGradientSum, "release", release)
        mp.setattr(objective, "batch_inputs", inputs64)
        result = sites.local_train(client, model, start_state, None, payload, 0, 0, torch.device("cpu"))
    finally:
        mp.undo()
    return DPRound(seen["views"], seen["labels"], seen["norms"], seen["clipped"], seen["ce_weights"], result.state,
                   seen["names"], sites.epsilons()[client], result.steps)


def lora_scaling(model) -> float:
    return float(model.lora_scaling)


def server_moments(server_state: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(m, v) of an adaptive server optimiser's state (``fedadam``), keyed as :func:`dense` keys tensors."""
    return ({k: v.double().numpy() for k, v in server_state["m"].items()},
            {k: v.double().numpy() for k, v in server_state["v"].items()})


def returning(states: Mapping[str, State], counts: Mapping[str, int] | int, steps: int = 3):
    """A participant's local training that returns ``states[name]`` from ``counts`` samples in ``steps``."""
    return lambda n, start, payload: (states[n], counts[n] if isinstance(counts, Mapping) else counts, steps)


def control_variates(server_state: Mapping[str, Any]) -> tuple[State, dict[str, State]]:
    """(c, {participant: c_i}) of SCAFFOLD's server state (the server keeps every c_i on the sites' behalf)."""
    return server_state["c"], server_state["clients"]
