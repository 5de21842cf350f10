"""Parameter counts of a method's model, built on the meta device: no weights, no download."""

from __future__ import annotations

import torch

from fedhisto.config.study import ModelConfig
from fedhisto.model.encoder import random_encoder
from fedhisto.model.peft_model import FedHistoModel, parameter_counts
from fedhisto.registries.method_registry import registration


def meta_model(encoder: str, method: str, cfg: ModelConfig | None = None) -> FedHistoModel:
    """Any registry entry, giants included: the meta device allocates nothing."""
    cfg = cfg or ModelConfig()
    with torch.device("meta"):
        return FedHistoModel(random_encoder(encoder), cfg, film=registration(method).attribute("film", False))


def model_card(encoder: str, method: str, cfg: ModelConfig | None = None) -> dict:
    """Counts as the study reports them (Table 8).

    Table 8 divides every method's trainable count by the same total, the full model with
    FiLM (86,829,763 with HIBOU-B), so ``trainable_fraction_pct`` does too; ``total_instantiated``
    is the size of this method's own model.
    """
    counts = parameter_counts(meta_model(encoder, method, cfg))
    reference_total = parameter_counts(meta_model(encoder, "past_v2", cfg))["total"]
    return {
        "encoder": encoder,
        "method": method,
        "backbone_parameters": counts["backbone"],
        "lora_parameters": counts["lora"],
        "lora_modules": counts["lora_modules"],
        "adapter_parameters": counts["adapter"],
        "film_parameters": counts["film"],
        "classifier_parameters": counts["classifier"],
        "trainable_parameters": counts["trainable"],
        "total_parameters": reference_total,
        "total_instantiated": counts["total"],
        "trainable_fraction_pct": round(100 * counts["trainable"] / reference_total, 6),
    }
