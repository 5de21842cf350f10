"""FedStain (Yu et al.'s paper and public code) on the shared frozen-encoder PEFT model, as its paper's Algorithm 1 prints it.

Two pieces: the style statistics a client uploads at the start of a round (Algorithm 2, stage a)
and the local objective on four views of each batch (stage b): the original X, RandStain(X), and
two AugMix views whose intermediate features are restyled by MixStyle. The comparator shares the
encoder, LoRA, residual adapter and classifier of fedavg_peft (no FiLM), so only the method differs.

[ours] MixStyle acts on the token features after one encoder block (``mixstyle_after_layer``),
statistics over all tokens of a channel: the paper's "intermediate features" of a CNN become the
token features of the ViT here. Pixel statistics for RandStain are taken in RGB on [0, 1].
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from fedhisto.config.study import Config, ViewsConfig
from fedhisto.data.splits import Split
from fedhisto.data.views import eval_view, training_views
from fedhisto.fedmath.fedstain_ops import (
    StyleStats,
    augmix,
    channel_moments,
    js_multi,
    mixstyle_higher_order,
    pool_excluding,
    randstain,
    representation_alignment,
    style_traffic,
    upload_count,
)
from fedhisto.infra.settings_base import Strict
from fedhisto.methods.base import (
    Batch,
    BatchInputs,
    LocalRun,
    LocalSchedule,
    PaperAssumptions,
    balanced_cross_entropy,
    named_rng,
)
from fedhisto.methods.objective import Objective
from fedhisto.methods.secure_capability import SecureAggregation
from fedhisto.methods.strategy import Strategy
from fedhisto.model.peft_model import FedHistoModel


class FedStainConfig(Strict):
    """The FedStain comparator (Yu et al.'s paper and public code). The paper sets alpha and beta by grid search and
    prints no values: the defaults weigh its two alignment terms like the study's v2 weighs its own
    (feature 0.10, JS 0.25), so neither method gets more auxiliary pull."""

    upload_ratio: float = Field(0.1, gt=0, le=1, description="r: fraction of local samples whose statistics are uploaded")
    weight_supcon: float = Field(0.10, ge=0, description="alpha: representation alignment (SupCon) weight")
    weight_js: float = Field(0.25, ge=0, description="beta: prediction alignment (JS over four views) weight")
    supcon_tau: float = Field(0.1, gt=0)
    mixstyle_alpha: float = Field(0.1, gt=0, description="lambda ~ Beta(alpha, alpha) in MixStyle")
    mixstyle_after_layer: int = Field(0, ge=0, description="encoder block whose output tokens MixStyle restyles")
    augmix_width: int = Field(3, ge=1)
    augmix_depth: int = Field(3, ge=1)
    # ablation switches: a switched-off augmentation leaves its view(s) as the plain view X
    randstain: bool = True
    augmix: bool = True
    mixstyle: bool = True
    protocol: Literal["study", "paper"] = Field(
        "study", description="study: the study's optimiser/lr/epochs/batch; paper: FedStain's own (paper_* keys)")
    paper_lr: float = Field(1e-4, gt=0)
    paper_lr_end: float = Field(2.5e-6, gt=0)
    paper_local_epochs: int = Field(3, ge=1)
    paper_batch: int = Field(32, ge=2)

class FeatureCapture:
    """A forward hook on one encoder block that records skewness and kurtosis of its token features."""

    def __init__(self, model: FedHistoModel, after_layer: int) -> None:
        blocks = model.encoder_blocks()
        if not 0 <= after_layer < len(blocks):
            raise ValueError(f"train.fedstain.mixstyle_after_layer={after_layer}: the encoder has {len(blocks)} blocks")
        self.captured: tuple[torch.Tensor, torch.Tensor] | None = None
        self._handle = blocks[after_layer].register_forward_hook(self._hook)

    def _hook(self, _module, _inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        _, _, skew, kurt = channel_moments(hidden.transpose(1, 2).detach())  # (B, C, tokens)
        self.captured = (skew.cpu(), kurt.cpu())

    def remove(self) -> None:
        self._handle.remove()


def restyle_tokens(hidden: torch.Tensor, pool: StyleStats, rng: np.random.Generator, alpha: float) -> torch.Tensor:
    """MixStyle (Algorithm 1) on token features (B, tokens, C), statistics per channel over the tokens."""
    return mixstyle_higher_order(hidden.transpose(1, 2), pool, rng, alpha).transpose(1, 2).to(hidden.dtype)


@contextmanager
def feature_capture(model: FedHistoModel, after_layer: int) -> Iterator[FeatureCapture]:
    hook = FeatureCapture(model, after_layer)
    try:
        yield hook
    finally:
        hook.remove()


def _mean_std(cfg: ViewsConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(cfg.mean, dtype=dtype).view(1, 3, 1, 1), torch.tensor(cfg.std, dtype=dtype).view(1, 3, 1, 1))


def to_unit(x: torch.Tensor, cfg: ViewsConfig) -> torch.Tensor:
    """ImageNet-normalised (B, 3, H, W) back to RGB on [0, 1]."""
    mean, std = _mean_std(cfg, x.dtype)
    return (x * std + mean).clamp(0, 1)


def from_unit(x: torch.Tensor, cfg: ViewsConfig) -> torch.Tensor:
    mean, std = _mean_std(cfg, x.dtype)
    return (x - mean) / std


@torch.no_grad()
def client_style_statistics(model: FedHistoModel, global_state: dict[str, torch.Tensor], data: Split, cfg: Config,
                            rng: np.random.Generator, device: torch.device) -> StyleStats:
    """Stage (a): channel mean/std of the pixels and skewness/kurtosis of the block features of
    ceil(r n_i) images drawn without replacement, seen through the evaluation transform under the
    current global model."""
    fs = cfg.train.fedstain
    n = upload_count(len(data), fs.upload_ratio)
    idx = sorted(rng.choice(len(data), size=n, replace=False).tolist())
    pixels = torch.stack([eval_view(data.images[i], cfg.views) for i in idx])
    mu, sd, _, _ = channel_moments(to_unit(pixels, cfg.views))
    model.load_trainable_state(global_state)
    model.eval()
    with feature_capture(model, fs.mixstyle_after_layer) as hook:
        model.embed(pixels.to(device))
    skew, kurt = hook.captured
    return StyleStats(mu, sd, skew, kurt)


def fedstain_views(x: torch.Tensor, pool: StyleStats, cfg: Config, rng: np.random.Generator) -> BatchInputs:
    """Stage (b)'s four views of one batch: X, X_stain, X(1), X(2), and MixStyle's spec for X(1), X(2).

    Draws from ``rng`` in the order RandStain, AugMix (both morphology views), then MixStyle of X(1)
    and X(2) as they are forwarded. A switched-off augmentation (``randstain``, ``augmix``,
    ``mixstyle``) leaves its view(s) as X.
    """
    fs = cfg.train.fedstain
    unit = to_unit(x, cfg.views)
    stained = from_unit(randstain(unit, pool, rng), cfg.views) if fs.randstain else x
    morph = [from_unit(torch.stack([augmix(img, rng, fs.augmix_width, fs.augmix_depth) for img in unit]), cfg.views)
             if fs.augmix else x for _ in range(2)]
    mix = (pool, rng, fs.mixstyle_alpha) if fs.mixstyle else None
    return BatchInputs([x, stained, *morph], [None, None, mix, mix])


def fedstain_loss(logits: list[torch.Tensor], zs: list[torch.Tensor], y: torch.Tensor, ce_weights: torch.Tensor,
                  cfg: Config, nominal_batch: int | None = None) -> dict[str, torch.Tensor]:
    """L = CE + alpha L_RA + beta L_JS (eq. 6); CE on the original view with the class-balanced weights
    every method here uses."""
    fs = cfg.train.fedstain
    return {
        "ce": balanced_cross_entropy(logits[0], y, ce_weights, nominal_batch, cfg.train.readings.ce_reduction),
        "supcon": fs.weight_supcon * representation_alignment(zs[0], zs[1:], y, fs.supcon_tau),
        "js": fs.weight_js * js_multi(logits),
    }


class FedStainObjective(Objective):
    """Client: statistics of ceil(r n_i) images before training (Algorithm 2, stage a); L = CE + alpha L_RA +
    beta L_JS over four views per batch (eq. 6), MixStyle restyling two of them inside the encoder."""

    pre_uploads = True

    def dp_refusal(self) -> str | None:
        return ("its loss does not decompose per sample: the representation alignment is a supervised contrastive "
                "loss (SupCon) whose every term is normalised over the other images of the batch; it also uploads "
                "single images' style statistics (train.fedstain.upload_ratio rows) un-noised")

    def local_schedule(self, round_idx: int) -> LocalSchedule:
        """``train.fedstain.protocol``: ``study`` trains like every other method here (the comparison
        isolates the method); ``paper`` uses FedStain's own settings (its Tables I-II and code): Adam
        without weight decay, 3 local epochs, batch 32, the learning rate decayed linearly from
        1e-4 to 2.5e-6 over the rounds. The input size stays the encoder's (its paper resizes to 128 px
        for a ResNet; our frozen ViT has one input size)."""
        fs = self.settings
        if fs.protocol == "study":
            return super().local_schedule(round_idx)
        span = max(self.cfg.train.max_rounds - 1, 1)
        lr = fs.paper_lr + (fs.paper_lr_end - fs.paper_lr) * min(round_idx, span) / span
        return LocalSchedule("adam", lr, 0.0, fs.paper_local_epochs, fs.paper_batch, 1, self.cfg.train.grad_clip)

    def upload_before_training(self, model, start_state, data, rng, device) -> StyleStats:
        return client_style_statistics(model, start_state, data, self.cfg, rng, device)

    @staticmethod
    def plain_views(run: LocalRun, batch: Batch) -> tuple[torch.Tensor, np.random.Generator]:
        """The plain geometric view of each image (FedStain builds its own views from it) and the
        batch's stream for those views."""
        if run.cfg.train.view_pipeline == "device":  # never silently the host path under a device setting
            raise ValueError("train.view_pipeline: device is not available for fedstain / fedstain_code (their "
                             "views are built from host plain views); set train.view_pipeline: host for them")
        x = torch.stack([training_views(run.data.images[i], run.cfg.views, run.seed, batch.view_epoch, run.data.ids[i],
                                        False, stain_single=False)[0] for i in batch.idx])
        return x, named_rng("style_views", run.seed, run.round_idx, run.client_idx, batch.epoch, batch.number)

    # the views and the loss of one batch; the engines forward the views, MixStyle acting through restyle()
    def batch_inputs(self, run: LocalRun, batch: Batch) -> BatchInputs:
        x, rng = self.plain_views(run, batch)
        return fedstain_views(x, run.payload["style_pool"], run.cfg, rng)

    def terms_from_outputs(self, run: LocalRun, batch: Batch, logits, zs) -> dict[str, torch.Tensor]:
        with run.autocast():
            return fedstain_loss(logits, zs, batch.y, run.ce_weights, run.cfg, run.nominal_batch)

    def restyle_layer(self) -> int | None:
        return self.settings.mixstyle_after_layer

    def restyle(self, hidden: torch.Tensor, spec) -> torch.Tensor:
        return restyle_tokens(hidden, *spec)


class FedStain(Strategy):
    """Server: pools every client's uploaded statistics and sends each client the pool without its own
    rows (Algorithm 2, lines 8-9); FedAvg of the adapters. Its clients: ``FedStainObjective``."""

    objective_class = FedStainObjective
    # its paper's Tables I-II and its authors' code train with Adam (no weight decay); ``protocol: study``
    # (the default) trains with the study's AdamW and is marked as a departure in the report
    assumptions = PaperAssumptions("FedStain (its paper's Tables I-II and code)", local_optimizer="adam")

    def configure_train(self, round_idx, server_state, uploads: dict[str, Any]):
        return {name: {"style_pool": pool_excluding(uploads, name)} for name in uploads}

    def secure_aggregation(self) -> SecureAggregation:
        return SecureAggregation.refused(
            "each site uploads its style statistics before training (pixel channel means and standard deviations, "
            "feature skewness and kurtosis of a sample of its images) and the server sends every site the other "
            "sites' rows: the rows are the payload itself, not a sum")

    def extra_traffic_bytes(self, dim, availability, optimisation_sizes, payload_bytes):
        return {"style_statistics": style_traffic(dim, optimisation_sizes, self.settings.upload_ratio)}
