"""Class probabilities of a model on a split, with the deterministic evaluation transform; and the
embeddings of the same pass (the adapted representation, the frozen encoder's) for the robustness metrics
and the domain statistics of an exported package."""

from __future__ import annotations

import torch

from fedhisto.config.study import Config
from fedhisto.data.splits import Split, eval_batches
from fedhisto.model.peft_model import N_CLASSES, FedHistoModel


@torch.no_grad()
def predict(model: FedHistoModel, data: Split, descriptor: torch.Tensor | None, cfg: Config,
            device: torch.device) -> torch.Tensor:
    """Class probabilities (N x 3)."""
    return predict_with_embeddings(model, data, descriptor, cfg, device)[0]


@torch.no_grad()
def predict_with_embeddings(model: FedHistoModel, data: Split, descriptor: torch.Tensor | None, cfg: Config,
                            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Class probabilities (N x 3) and the adapted embeddings z (N x dim, float32) the classifier read:
    one forward pass gives both, so the embeddings cost no extra compute."""
    model.eval()
    desc = descriptor.to(device)[None] if descriptor is not None else None
    probs, feats = [], []
    for x, _ in eval_batches(data, cfg.views, cfg.evaluate.eval_batch):
        logits, z = model(x.to(device), desc)
        probs.append(torch.softmax(logits.float(), dim=1).cpu())
        feats.append(z.float().cpu())
    if not probs:
        return torch.zeros(0, N_CLASSES), torch.zeros(0, model.classifier.in_features)
    return torch.cat(probs), torch.cat(feats)


@torch.no_grad()
def frozen_embeddings(model: FedHistoModel, data: Split, cfg: Config, device: torch.device) -> torch.Tensor:
    """The frozen encoder's embedding (N x dim, what the head reads): LoRA switched off through peft's own switch
    (``BaseTunerLayer.enable_adapters``), so the pass is the pretrained encoder as every method received it.
    A model whose frozen weights carry folded LoRA offsets (FedEx-LoRA) is not the frozen encoder: refused."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if model.__dict__.get("_pristine_base"):
        raise ValueError("frozen_embeddings: this model's frozen weights carry folded offsets; call it on a "
                         "freshly built model, before a member state is loaded")
    model.eval()
    layers = [m for m in model.encoder.modules() if isinstance(m, BaseTunerLayer)]
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    for layer in layers:
        layer.enable_adapters(False)
    try:
        out = [model.encoder_embedding(x.to(device)).float().cpu()
               for x, _ in eval_batches(data, cfg.views, cfg.evaluate.eval_batch)]
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for n, p in model.named_parameters():  # peft's switch touches requires_grad; the trainable set is ours
            p.requires_grad_(flags[n])
    return torch.cat(out) if out else torch.zeros(0, model.classifier.in_features)
