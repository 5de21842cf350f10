"""A federated method is two halves registered together, as Flower splits a server app from a client app:
a server-side ``Strategy`` (``methods.strategy``: who trains, what each starts from and receives, how
the server weights and aggregates what comes back, what travels) and the client-side ``Objective``
it names (``methods.objective``: what a participant optimises in a round, with which local
schedule, which tensors it trains, and what it uploads). One file per method holds both; its one
registration names the strategy class, whose ``objective_class`` is its client half, and
``methods.build_method`` builds the pair from the same options. This module holds what both halves
and the engines share.

The engine (the in-process round loop, the Flower apps, a batched engine) owns data, optimisers,
checkpoints and transport; a method only says what differs. Every hook is a pure function of tensors
and plain values, so the same objects serve a simulation and a real federation. One round, as the
engines call the hooks:

1. strategy ``configure_train``: what each participant receives (start state, method payload);
   a method may first ask every participant for a pre-round upload (objective
   ``upload_before_training``, e.g. FedStain's style statistics) and build payloads from them;
2. objective: the engine runs ``local_epochs`` of micro-batches over the tensors the objective
   declares it trains (``trained``); per batch ``batch_terms`` returns the named loss terms (summed
   and back-propagated by the engine), inside ``local_session``. It is ``batch_inputs`` (the views),
   the forward, then ``terms_from_outputs`` (the loss): the batched engine (``train.batched``) calls
   those two halves around one encoder pass for every member, and applies ``restyle`` (feature
   restyling inside the encoder, FedStain's MixStyle) per member. Under DP-SGD the engine wraps the
   objective (``train.private``): its per-image form (``private_objective``) over exactly the
   declared tensors;
3. strategy ``client_weights`` then ``aggregate_train``: the new state of every member and the
   method's server state (``RoundUpdate`` holds what came back; SCAFFOLD keeps control variates and
   FedAdam its moments there);
4. optional post-aggregation exchange (objective ``upload_after_aggregation``, strategy
   ``aggregate_uploads``, e.g. prototypes), folded into the server state for the next round.

A *participant* is what trains in a round (a client; ``pooled`` has one); a *member* is a model the
run keeps and evaluates (``global`` for a federated method; one per client for ``local_only``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedhisto.config.study import Config
from fedhisto.data.splits import Split
from fedhisto.model.peft_model import DESCRIPTOR_DIM, FedHistoModel

GLOBAL = "global"


@dataclass
class LocalRun:
    """One participant's local training in one round: what the engine hands to the batch hooks."""

    model: FedHistoModel
    data: Split
    descriptor: torch.Tensor | None        # (1, 14) on the device, or None without FiLM
    payload: dict[str, Any]                # from configure_train
    start_state: dict[str, torch.Tensor]   # on the device (FedProx pulls towards it)
    params: dict[str, torch.nn.Parameter]
    ce_weights: torch.Tensor
    nominal_batch: int                     # micro-batch size the CE is normalised by (balanced_cross_entropy)
    cfg: Config
    seed: int
    round_idx: int
    client_idx: int
    device: torch.device
    scratch: dict[str, Any] = field(default_factory=dict)  # what local_session sets up for the batches

    def autocast(self):
        return training_autocast(self.device, self.cfg.train.precision)


def training_autocast(device: torch.device, precision: str = "auto"):
    """The engines' mixed precision (``train.precision``): bf16 autocast on CUDA under ``auto`` (the
    study's AMP on GPU), on any device under ``bf16`` (so a CPU runs the GPU's bf16 path, e.g. in
    tests), none under ``float32``. Losses are computed from float32 outputs either way."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


@dataclass
class RoundUpdate:
    """What the server holds after local training in round ``round_idx``, per returned participant."""

    round_idx: int
    states: dict[str, dict[str, torch.Tensor]]   # trained states
    starts: dict[str, dict[str, torch.Tensor]]   # the state each started the round from
    counts: dict[str, int]                       # optimisation samples
    steps: dict[str, int]                        # optimiser steps taken
    weights: dict[str, float]                    # client_weights
    server_state: Any                            # the method's server state before this round


@dataclass(frozen=True)
class LocalSchedule:
    """How a participant optimises in one round: the engine builds its optimiser and batches from this."""

    optimizer: str          # "adamw" (the study), "adam", or "sgd" (plain SGD: no momentum; SCAFFOLD's Algorithm 1)
    lr: float
    weight_decay: float
    epochs: int
    micro_batch: int
    accumulation: int
    grad_clip: float | None = None  # gradient-norm clipping per optimiser step (None: none)


@dataclass(frozen=True)
class PaperAssumptions:
    """What a method's own paper assumes of the protocol it runs under, declared in the method's file:
    ``local_optimizer`` ("sgd", "adam", "adamw" or "any"), ``weighting`` of returned participants
    ("sample_mass", "uniform", "adaptive" or "any"), ``participation`` ("any": full or sampled, "full").
    ``Strategy.protocol_departures`` compares them with the run; each departure is a report caveat."""

    source: str
    local_optimizer: str = "any"
    weighting: str = "any"
    participation: str = "any"
    clipping: bool = True   # the paper's local steps tolerate gradient-norm clipping


@dataclass
class Batch:
    """Indices into ``LocalRun.data`` and their labels; ``view_epoch`` and ``number`` seed the views."""

    idx: np.ndarray
    y: torch.Tensor
    epoch: int
    view_epoch: int
    number: int


@dataclass
class BatchInputs:
    """What the model sees for one micro-batch: views forwarded in order (each (b, 3, H, W)) and, per
    view, the method's feature-restyling spec or None (``Objective.restyle``)."""

    views: list[torch.Tensor]
    restyle: list[Any] = field(default_factory=list)

    def spec(self, k: int) -> Any:
        return self.restyle[k] if k < len(self.restyle) else None


def stream_rng(seed: int, *stream: int) -> np.random.Generator:
    """The generator of one named random stream of a run (see ``STREAMS``)."""
    return np.random.default_rng(np.random.SeedSequence([seed, *stream]))


#: Named random streams of a run; every draw derives from (seed, stream id, round, participant, ...),
#: so a resumed run replays the next round exactly.
STREAMS = {"torch": 10, "order": 11, "style_sample": 12, "style_views": 13}


def named_rng(name: str, seed: int, *keys: int) -> np.random.Generator:
    return stream_rng(seed, STREAMS[name], *keys)


def balanced_cross_entropy(logits: torch.Tensor, y: torch.Tensor, weights: torch.Tensor,
                           nominal_batch: int | None = None, reduction: str = "nominal_batch") -> torch.Tensor:
    """Class-balanced CE: sum_i w_{y_i} CE_i / B, with B the nominal batch size (``len(y)`` if not given).

    Not ``F.cross_entropy(weight=w)``: its mean divides by the batch's summed weights, so a micro-batch
    of majority images cancels their weights and a lone minority image is up-weighted by an amount
    that depends on the micro-batch size (about 2.6x at 4, 3.5x at 8 with weights that encode 5.5x).
    Dividing by the nominal size keeps each image's weight whatever its batch-mates are, and makes
    k micro-batches of size B/k accumulated (each loss divided by k) equal one batch of size B.
    ``reduction="weighted_mean"`` (``train.readings.ce_reduction``) is PyTorch's weighted mean, the
    other reading the sensitivity experiment retrains under.
    """
    if reduction == "weighted_mean":
        return F.cross_entropy(logits, y, weight=weights.to(logits.dtype))
    if reduction != "nominal_batch":
        raise ValueError(f"CE reduction {reduction!r}: nominal_batch or weighted_mean")
    per_image = F.cross_entropy(logits, y, reduction="none") * weights.to(logits.dtype)[y]
    return per_image.sum() / (nominal_batch if nominal_batch is not None else len(y))


class MethodPart:
    """What both halves of a method share: its registered name, the run's config, and its settings block.
    ``config_key`` (from the registration) names the ``train.<key>`` block whose settings the method reads
    and that enters the run identity."""

    def __init__(self, name: str, cfg: Config, config_key: str | None = None, **options: Any) -> None:
        if options:
            raise TypeError(f"method {name!r}: unexpected options {sorted(options)}")
        self.name = name
        self.cfg = cfg
        self.config_key = config_key

    @property
    def settings(self):
        """The method family's config block (``train.<config_key>``) as its registered settings class, or
        None. The config holds it as a model rebuilt from the stored schema (``methods.settings``); here
        the method's own class validates it once more."""
        if not self.config_key:
            return None
        if "_settings" not in self.__dict__:
            from fedhisto.methods import registration

            block = getattr(self.cfg.train, self.config_key)
            cls = registration(self.name).settings_class()
            self._settings = cls.model_validate(block.model_dump()) if cls is not None else block
        return self._settings


def restyle_output(method: Any, output: Any, groups: Sequence[tuple[int, int, Any]]) -> Any:
    """A block's output with each row group [start, end) that carries a spec restyled by
    ``method.restyle`` (None: unchanged); tuple outputs (transformers blocks) keep their tail."""
    if all(spec is None for *_, spec in groups):
        return None
    hidden = output[0] if isinstance(output, tuple) else output
    parts = [hidden[s:e] if spec is None else method.restyle(hidden[s:e], spec) for s, e, spec in groups]
    mixed = parts[0] if len(parts) == 1 else torch.cat(parts)
    return (mixed, *output[1:]) if isinstance(output, tuple) else mixed


@contextmanager
def restyle_views(model: FedHistoModel, method: Any, groups: Any) -> Iterator[None]:
    """Within: the method's restyle block (``restyle_layer``) restyles the row groups of every forward.
    ``groups``: [(start, end, spec)], or a callable returning them at each forward (the batched engine's
    layout changes per step). The one restyle hook of both engines."""
    layer = method.restyle_layer()
    if layer is None:
        yield
        return
    blocks = model.encoder_blocks()
    if not 0 <= layer < len(blocks):
        raise ValueError(f"{method.name}: restyle block {layer} does not exist (the encoder has {len(blocks)} blocks)")
    handle = blocks[layer].register_forward_hook(
        lambda _module, _inputs, output: restyle_output(method, output, groups() if callable(groups) else groups))
    try:
        yield
    finally:
        handle.remove()


def zero_descriptors(participants: Sequence[str]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(DESCRIPTOR_DIM) for k in [*participants, GLOBAL]}


def client_descriptors(doc: dict, participants: Sequence[str]) -> dict[str, torch.Tensor]:
    """Each client's standardised descriptor; the centroid for ``global``."""
    out = {c: torch.tensor(doc["clients"][c]["standardised"], dtype=torch.float32) for c in participants}
    out[GLOBAL] = torch.tensor(doc["centroid"]["standardised"], dtype=torch.float32)
    return out
