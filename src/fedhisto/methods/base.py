"""The hooks every federated method implements, split into a server half and a client half.

Modelled on Flower's strategies (``configure_train`` / ``aggregate_train``): the engine (the
in-process round loop, the Flower apps, a batched engine) owns data, optimisers, checkpoints and
transport; a method only says what differs. Every hook is a pure function of tensors and plain
values, so the same object serves a simulation and a real federation.

One round, as the engines call the hooks:

1. server ``configure_train``: what each participant receives (start state, method payload);
   a method may first ask every participant for a pre-round upload (client
   ``upload_before_training``, e.g. FedStain's style statistics) and build payloads from them;
2. client: the engine runs ``local_epochs`` of micro-batches; per batch ``batch_terms`` returns the
   named loss terms (summed and back-propagated by the engine), inside ``local_session``. It is
   ``batch_inputs`` (the views), the forward, then ``terms_from_outputs`` (the loss): the batched
   engine (``train.batched``) calls those two halves around one encoder pass for every member, and
   applies ``restyle`` (feature restyling inside the encoder, FedStain's MixStyle) per member;
3. server ``client_weights`` then ``aggregate_train``: the new state of every member and the
   method's server state (``RoundUpdate`` holds what came back; SCAFFOLD keeps control variates and
   FedAdam its moments there);
4. optional post-aggregation exchange (``post_uploads``: client ``upload_after_aggregation``, server
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
from fedhisto.data.device_views import device_views
from fedhisto.data.splits import Split
from fedhisto.data.views import training_views
from fedhisto.fedmath.aggregate import aggregate, delta_svd_from_means, lora_pairs
from fedhisto.fedmath.secure_sums import Terms, lora_products
from fedhisto.fedmath.weights import SampleMass
from fedhisto.methods.dp_objective import PrivateObjective, image_ce
from fedhisto.methods.secure_capability import SecureAggregation, SecureSums, SiteStatistics
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
    ``Method.protocol_departures`` compares them with the run; each departure is a report caveat."""

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
    view, the method's feature-restyling spec or None (``Method.restyle``)."""

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


class Method:
    """Base: FedAvg over the PEFT adapters on single plain views, no extra exchange.

    Subclasses override the hooks that differ. ``config_key`` (from the registration) names the
    ``train.<key>`` block whose settings the method reads and that enters the run identity.
    """

    film: bool = False              # the model carries stain-conditioned FiLM
    paired_views: bool = False      # two stain views per image: micro-batch x accumulation, else one batch
    stain_single: bool | None = None  # a single view stain-perturbed (True), geometry only (False), or
                                      # as ``views.single_view_stain`` says (None)
    exchanges_model: bool = True    # the trainable state travels down and up every round (Table 8)
    pre_uploads: bool = False       # participants upload before training (``upload_before_training``)
    post_uploads: bool = False      # participants upload after aggregation (``upload_after_aggregation``)
    # What the method's paper assumes (None: the method is the study's own, or a reference such as
    # local_only / pooled whose protocol is the study's by definition); see ``protocol_departures``.
    assumptions: PaperAssumptions | None = None
    own_holdout: bool = False       # each member is a site's model, scored on that site's holdout only

    def __init__(self, name: str, cfg: Config, config_key: str | None = None, **options: Any) -> None:
        if options:
            raise TypeError(f"method {name!r}: unexpected options {sorted(options)}")
        self.name = name
        self.cfg = cfg
        self.config_key = config_key

    # ------------------------------------------------------------------ setup
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

    def participants(self, clients: dict[str, Split]) -> dict[str, Split]:
        """What trains in a round (default: every client on its own optimisation set)."""
        return clients

    def members(self, participants: Sequence[str]) -> list[str]:
        """The models a run keeps, checkpoints and evaluates (default: one global model)."""
        return [GLOBAL]

    def descriptors(self, doc: dict | None, participants: Sequence[str]) -> dict[str, torch.Tensor | None]:
        """Stain descriptor per participant and ``global`` (validation/test/external); None without FiLM."""
        return dict.fromkeys([*participants, GLOBAL])

    def local_schedule(self, round_idx: int) -> LocalSchedule:
        """The study's protocol for every method: AdamW, ``train.lr``, ``local_epochs``; paired views in
        micro-batches of 4 accumulated twice, single views in batches of 8."""
        t = self.cfg.train
        micro, accum = (t.paired_micro_batch, t.accumulation_steps) if self.paired_views else (t.single_view_batch, 1)
        return LocalSchedule("adamw", t.lr, t.weight_decay, t.local_epochs, micro, accum, t.grad_clip)

    def weighting(self) -> str:
        """The name of the server's weighting of returned participants (``client_weights``)."""
        return "sample_mass"

    def protocol_departures(self) -> list[str]:
        """Where this run departs from what the method's paper assumes (``assumptions``), one sentence
        each; empty when it runs under its own assumptions (or declares none)."""
        a = self.assumptions
        if a is None:
            return []
        plan, out = self.local_schedule(0), []
        if a.local_optimizer not in ("any", plan.optimizer):
            out.append(f"local steps are {plan.optimizer} (lr {plan.lr:g}); {a.source} assumes {a.local_optimizer}")
        if a.weighting not in ("any", self.weighting()):
            out.append(f"participants weighted by {self.weighting()}; {a.source} assumes {a.weighting}")
        if a.participation not in ("any", "full"):  # the protocol asks every client every round
            out.append(f"every client takes part in every round; {a.source} assumes {a.participation} participation")
        if not a.clipping and plan.grad_clip is not None:
            out.append(f"local gradients clipped to norm {plan.grad_clip:g}; {a.source} does not clip")
        return [f"{self.name}: {d}" for d in out]

    def trains(self, name: str) -> bool:
        """Whether the sites' optimiser updates the trainable tensor ``name`` (default: every one; FFA-LoRA
        keeps A at its shared initialisation). A tensor it does not train still travels and is aggregated."""
        return True

    # ----------------------------------------------------------- server half
    def start_state(self, members: dict[str, dict[str, torch.Tensor]], participant: str) -> dict[str, torch.Tensor]:
        """Server: the state a participant starts the round from (default: the global one)."""
        return members[GLOBAL]

    def upload_before_training(self, model: FedHistoModel, start_state: dict[str, torch.Tensor], data: Split,
                               rng: np.random.Generator, device: torch.device) -> Any | None:
        """Client, before local training: an upload the server needs to configure the round."""
        return None

    def configure_train(self, round_idx: int, server_state: Any, uploads: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Server: the method payload of each participant (``uploads`` holds one entry per participant,
        None where it uploaded nothing). Default: nothing beyond the start state."""
        return {name: {} for name in uploads}

    def client_weights(self, counts: Sequence[int], updates: Sequence[torch.Tensor]) -> list[float]:
        """Server: aggregation weights a_k of the returned participants (default: sample mass)."""
        return SampleMass()(counts, updates)

    def aggregate_train(self, update: RoundUpdate, model: FedHistoModel
                        ) -> tuple[dict[str, dict[str, torch.Tensor]], Any]:
        """Server: the new member states and server state from what came back. Default: delta-SVD for
        LoRA pairs and the weighted mean for the rest (``fedmath.aggregate``); server state unchanged."""
        names = list(update.states)
        merged = aggregate([update.states[n] for n in names], [update.weights[n] for n in names],
                           model.lora_scaling, self.cfg.model.lora_r)
        return {GLOBAL: merged}, update.server_state

    def upload_after_aggregation(self, model: FedHistoModel, data: Split, descriptor: torch.Tensor | None,
                                 device: torch.device) -> Any | None:
        """Client, with the new global model loaded: an upload for the server state (default: none)."""
        return None

    def aggregate_uploads(self, uploads: dict[str, Any], server_state: Any) -> Any:
        """Server (``post_uploads`` only): the server state for the next round from the
        post-aggregation uploads and the state ``aggregate_train`` left."""
        return server_state

    # ----------------------------------------------------------- client half
    @contextmanager
    def local_session(self, run: LocalRun) -> Iterator[None]:
        """Set-up around one participant's local epochs (e.g. a forward hook)."""
        yield

    def batch_inputs(self, run: LocalRun, batch: Batch) -> BatchInputs:
        """The views of one micro-batch the model sees, each (b, 3, H, W) on the host (default: one plain
        view, or the two stain views of ``paired_views``). Engines forward them, then call
        ``terms_from_outputs``: the sequential engine one view at a time, the batched engine
        (``train.batched``) every member's views in one encoder pass."""
        if run.cfg.train.view_pipeline == "device":
            return BatchInputs(list(device_views(run.data, batch.idx, run.cfg.views, run.seed, batch.view_epoch,
                                                 self.paired_views, run.device, self.stain_single)))
        views = [training_views(run.data.images[i], run.cfg.views, run.seed, batch.view_epoch, run.data.ids[i],
                                self.paired_views, self.stain_single) for i in batch.idx]
        return BatchInputs([torch.stack([v[k] for v in views]) for k in range(len(views[0]))])

    def batch_terms(self, run: LocalRun, batch: Batch) -> dict[str, torch.Tensor]:
        """The named loss terms of one micro-batch; the engine sums them and back-propagates. The views
        are forwarded one at a time, each restyled as its spec says (``restyle_views``)."""
        inputs = self.batch_inputs(run, batch)
        outs = []
        for k, x in enumerate(inputs.views):
            with run.autocast(), restyle_views(run.model, self, [(0, x.shape[0], inputs.spec(k))]):
                outs.append(run.model(x.to(run.device), run.descriptor))
        return self.terms_from_outputs(run, batch, [o[0].float() for o in outs], [o[1].float() for o in outs])

    def terms_from_outputs(self, run: LocalRun, batch: Batch, logits: list[torch.Tensor],
                           zs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The loss terms from the views' float32 logits and embeddings (default: class-balanced CE
        averaged over the views, or summed as ``train.readings.ce_views`` says, plus ``extra_terms``)."""
        readings = run.cfg.train.readings
        ce = sum(balanced_cross_entropy(lg, batch.y, run.ce_weights, run.nominal_batch, readings.ce_reduction)
                 for lg in logits)
        terms = {"ce": ce if readings.ce_views == "sum" else ce / len(logits)}
        terms.update(self.extra_terms(run, batch, logits, zs))
        return terms

    # A method whose forward restyles intermediate features (FedStain's MixStyle) names the encoder
    # block and the per-view transform, so a batched engine can apply it to each member's rows alone.
    def restyle_layer(self) -> int | None:
        """Index of the encoder block after which ``restyle`` acts on views that carry a spec (default: none)."""
        return None

    def restyle(self, hidden: torch.Tensor, spec: Any) -> torch.Tensor:
        """Restyle one view's token features (b, tokens, C) after ``restyle_layer`` as ``spec`` says."""
        raise NotImplementedError(f"method {self.name!r} restyles no features")

    def extra_terms(self, run: LocalRun, batch: Batch, logits: list[torch.Tensor],
                    zs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Terms beyond class-balanced CE on the views' logits and embeddings (default: none)."""
        return {}

    # ---------------------------------------------------------- under DP-SGD
    # A method declares in its own file whether it trains under DP-SGD (docs/privacy.md). An upload
    # after aggregation (``post_uploads``) goes through the noised prototype release under DP, so a
    # method whose post-aggregation upload is something else refuses.
    def dp_refusal(self) -> str | None:
        """Why this method cannot train under DP-SGD, or None when ``private_objective`` is its local
        objective written one image at a time (``methods.dp_objective``). Default: refused until declared."""
        return (f"its class {type(self).__module__}:{type(self).__qualname__} declares no objective of one image "
                "(override Method.dp_refusal and Method.private_objective in the method's own file)")

    def private_objective(self, run: LocalRun) -> PrivateObjective:
        """The objective under DP-SGD of one participant's round; the default is the default objective
        (class-balanced CE over the views, ``terms_from_outputs`` without ``extra_terms``) per image."""
        return PrivateObjective(image_ce(run))

    # ------------------------------------------------ under secure aggregation
    # A method declares in its own file whether its server step can be written over masked sums
    # (``methods.secure_capability``, docs/federation.md). The client hooks say what a site masks,
    # the server hooks what the server makes of the sums; no server hook ever sees one site's record.
    def secure_aggregation(self) -> SecureAggregation:
        """What this method's server step needs under secure aggregation. Default: refused until declared."""
        return SecureAggregation.refused(
            f"its class {type(self).__module__}:{type(self).__qualname__} declares nothing (override "
            "Method.secure_aggregation in the method's own file)")

    def secure_terms(self, state: dict[str, torch.Tensor], start: dict[str, torch.Tensor], scaling: float) -> Terms:
        """Client: the terms this site adds, times its weight, to the round's masked sum. Default: what
        the default ``aggregate_train`` (delta-SVD) needs, each LoRA pair's dense s B A and every other tensor."""
        pairs = lora_pairs(list(state))
        paired = {k for p in pairs for k in p}
        return {**lora_products(state, scaling, pairs), **{k: v for k, v in state.items() if k not in paired}}

    def aggregate_sums(self, sums: SecureSums, model: FedHistoModel) -> tuple[dict[str, dict[str, torch.Tensor]], Any]:
        """Server: the new member states and server state from the weighted sums (default: delta-SVD's
        rank-r refactorisation of the weighted mean s B A, the weighted mean of the rest)."""
        return {GLOBAL: delta_svd_from_means(sums.mean, sums.start, model.lora_scaling, self.cfg.model.lora_r)
                }, sums.server_state

    def secure_statistic(self, state: dict[str, torch.Tensor], start: dict[str, torch.Tensor], scaling: float) -> Terms:
        """Client (``weights: statistics``): the update vector D_k whose masked sum the weights are computed from."""
        raise NotImplementedError(f"method {self.name!r} declares no statistics round")

    def secure_weights(self, stats: SiteStatistics) -> dict[str, float]:
        """Server (``weights: statistics``): the aggregation weights from the scalars the sites stated."""
        raise NotImplementedError(f"method {self.name!r} declares no statistics round")

    def secure_post_terms(self, upload: Any) -> Terms:
        """Client (``post_uploads``): the terms of the upload after aggregation, summed masked (unweighted)."""
        raise NotImplementedError(f"method {self.name!r} masks no upload after aggregation")

    def aggregate_post_sums(self, sums: SecureSums, server_state: Any) -> Any:
        """Server (``post_uploads``): the server state for the next round from the summed post-aggregation terms."""
        raise NotImplementedError(f"method {self.name!r} masks no upload after aggregation")

    # ----------------------------------------------------------- accounting
    def model_bytes(self, state: dict[str, torch.Tensor], clients: Sequence[str]) -> int:
        """Bytes of the model exchange per round (Table 8): the trainable ``state`` down and up for each
        of ``clients`` (a method that sends less, or more, says so here)."""
        return 2 * len(clients) * sum(t.numel() * t.element_size() for t in state.values())

    def extra_traffic_bytes(self, dim: int, availability: dict[str, list[bool]], optimisation_sizes: dict[str, int],
                            payload_bytes: int) -> dict[str, int]:
        """Bytes per round beyond the model exchange, by message kind (Table 8): ``dim`` is the embedding
        width, ``payload_bytes`` the trainable state's size (one copy) in float32."""
        return {}


def restyle_output(method: Method, output: Any, groups: Sequence[tuple[int, int, Any]]) -> Any:
    """A block's output with each row group [start, end) that carries a spec restyled by
    ``method.restyle`` (None: unchanged); tuple outputs (transformers blocks) keep their tail."""
    if all(spec is None for *_, spec in groups):
        return None
    hidden = output[0] if isinstance(output, tuple) else output
    parts = [hidden[s:e] if spec is None else method.restyle(hidden[s:e], spec) for s, e, spec in groups]
    mixed = parts[0] if len(parts) == 1 else torch.cat(parts)
    return (mixed, *output[1:]) if isinstance(output, tuple) else mixed


@contextmanager
def restyle_views(model: FedHistoModel, method: Method, groups: Any) -> Iterator[None]:
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
