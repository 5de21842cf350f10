"""The client half of a federated method: its ``Objective`` (see ``methods.base`` for how the halves fit).

An objective says what one participant does in a round: its local schedule (optimiser, learning rate,
epochs, batches), the tensors it trains (``trained``: names, and masks where a block is structurally
zero), the views and loss terms of each micro-batch, and what it uploads before training or after
aggregation. Under DP-SGD (``privacy.enabled``) the engine wraps it (``train.private``): it clips and
noises exactly the declared tensors, and asks the objective for its loss of ONE image
(``private_objective``). Whether an objective can train under DP follows from what it declares
(``dp_refusal``): an upload DP-SGD cannot release, a batch loss without its per-image form beside it,
or a reading of the CE with no per-image form. Under secure aggregation (``secure_terms`` and friends)
it says what a site adds to each masked sum, which its strategy's server step receives summed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from fedhisto.data.device_views import device_views
from fedhisto.data.splits import Split
from fedhisto.data.views import training_views
from fedhisto.fedmath.aggregate import lora_pairs
from fedhisto.fedmath.lora_aggregators.fold import trainable_part
from fedhisto.fedmath.secure_sums import Terms, lora_products
from fedhisto.methods.base import (
    Batch,
    BatchInputs,
    LocalRun,
    LocalSchedule,
    MethodPart,
    balanced_cross_entropy,
    restyle_views,
)
from fedhisto.methods.dp_objective import PrivateObjective, image_ce, objective_refusal
from fedhisto.model.peft_model import FedHistoModel

#: The hooks that define the batch objective. A class that overrides one of them changes what its
#: participants optimise, so it must declare the per-image form of that objective in the same class
#: (or below): otherwise DP-SGD would train the per-image form of an objective it does not have.
BATCH_HOOKS = ("local_session", "batch_inputs", "batch_terms", "terms_from_outputs", "extra_terms",
               "restyle_layer", "restyle")


def _defined_by(cls: type, attr: str) -> type:
    return next(c for c in cls.__mro__ if attr in c.__dict__)


class Objective(MethodPart):
    """Base: the study's protocol (AdamW, ``train.lr``, ``local_epochs``) on class-balanced CE over one
    plain view (or the two stain views of ``paired_views``), every trainable tensor trained."""

    paired_views: bool = False      # two stain views per image: micro-batch x accumulation, else one batch
    stain_single: bool | None = None  # a single view stain-perturbed (True), geometry only (False), or
                                      # as ``views.single_view_stain`` says (None)
    pre_uploads: bool = False       # participants upload before training (``upload_before_training``)
    post_uploads: bool = False      # participants upload after aggregation (``upload_after_aggregation``)

    # ------------------------------------------------------------------ what a participant trains
    def local_schedule(self, round_idx: int) -> LocalSchedule:
        """The study's protocol for every method: AdamW, ``train.lr``, ``local_epochs``; paired views in
        micro-batches of 4 accumulated twice, single views in batches of 8."""
        t = self.cfg.train
        micro, accum = (t.paired_micro_batch, t.accumulation_steps) if self.paired_views else (t.single_view_batch, 1)
        return LocalSchedule("adamw", t.lr, t.weight_decay, t.local_epochs, micro, accum, t.grad_clip)

    def trained(self, start_state: dict[str, torch.Tensor], payload: dict[str, Any]) -> dict[str, torch.Tensor | None]:
        """What a participant trains this round, declared: the names of the tensors of its ``start_state`` its
        optimiser updates, each with a 0/1 mask of the tensor's shape where a block is structurally zero (None:
        every entry). Default: every trainable tensor, unmasked. Every engine trains exactly these (a tensor not
        named gets no gradient: FFA-LoRA's frozen A), and DP-SGD differentiates, clips and noises exactly these
        (``fedhisto.privacy``). A tensor not trained still travels and is aggregated."""
        return dict.fromkeys(trainable_part(start_state))

    # ----------------------------------------------------------- uploads
    def upload_before_training(self, model: FedHistoModel, start_state: dict[str, torch.Tensor], data: Split,
                               rng: np.random.Generator, device: torch.device) -> Any | None:
        """Before local training: an upload the server needs to configure the round (``pre_uploads``)."""
        return None

    def upload_after_aggregation(self, model: FedHistoModel, data: Split, descriptor: torch.Tensor | None,
                                 device: torch.device) -> Any | None:
        """With the new global model loaded: an upload for the server state (``post_uploads``; default: none)."""
        return None

    # ----------------------------------------------------------- the batch objective
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
    # An upload after aggregation goes through the noised prototype release under DP (the engine
    # computes and noises class prototypes), so a method's post-aggregation upload must be those.
    def dp_refusal(self) -> str | None:
        """Why this objective cannot train under DP-SGD (None: it can), from what it declares: an upload
        before training (nothing noises it), an upload after aggregation without ``privacy.prototypes:
        noised``, a batch objective changed (``BATCH_HOOKS``) without its per-image form
        (``private_objective``) declared beside it, or a reading of the class-balanced CE without a
        per-image form. A method whose objective cannot be written one image at a time says why, in its
        own words, by overriding this."""
        if self.pre_uploads:
            return ("it uploads statistics of the site's data before training (upload_before_training), un-noised: "
                    "DP-SGD has no release for them")
        if self.post_uploads and self.cfg.privacy.prototypes != "noised":
            return ("it uploads class prototypes (centroids of the site's embeddings) every round, un-noised; set "
                    "privacy.prototypes: noised to release them through the Gaussian mechanism")
        cls = type(self)
        declared = _defined_by(cls, "private_objective")
        changed = [h for h in BATCH_HOOKS if not issubclass(declared, _defined_by(cls, h))]
        if changed:
            return (f"its objective {cls.__module__}:{cls.__qualname__} changes the batch loss ({', '.join(changed)}) "
                    "but declares no objective of one image beside it (override Objective.private_objective in the "
                    "same class)")
        return objective_refusal(self.cfg)

    def private_objective(self, run: LocalRun) -> PrivateObjective:
        """The objective under DP-SGD of one participant's round; the default is the default objective
        (class-balanced CE over the views, ``terms_from_outputs`` without ``extra_terms``) per image."""
        return PrivateObjective(image_ce(run))

    # ------------------------------------------------ under secure aggregation
    # What a site adds to each masked sum (its strategy declares the form, ``Strategy.secure_aggregation``,
    # and receives the sums).
    def secure_terms(self, state: dict[str, torch.Tensor], start: dict[str, torch.Tensor], scaling: float) -> Terms:
        """The terms this site adds, times its weight, to the round's masked sum. Default: what the default
        ``Strategy.aggregate_train`` (delta-SVD) needs, each LoRA pair's dense s B A and every other tensor."""
        pairs = lora_pairs(list(state))
        paired = {k for p in pairs for k in p}
        return {**lora_products(state, scaling, pairs), **{k: v for k, v in state.items() if k not in paired}}

    def secure_statistic(self, state: dict[str, torch.Tensor], start: dict[str, torch.Tensor], scaling: float) -> Terms:
        """(``weights: statistics``) The update vector D_k whose masked sum the weights are computed from."""
        raise NotImplementedError(f"method {self.name!r} declares no statistics round")

    def secure_post_terms(self, upload: Any) -> Terms:
        """(``post_uploads``) The terms of the upload after aggregation, summed masked (unweighted)."""
        raise NotImplementedError(f"method {self.name!r} masks no upload after aggregation")
