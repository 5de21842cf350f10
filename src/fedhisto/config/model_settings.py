"""Configuration of the model (``model:``): the frozen encoder, its pipeline pretraining and the
trainable PEFT pathway; re-exported by ``fedhisto.config.study``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from fedhisto.infra.settings_base import IF_CHANGED, Strict
from fedhisto.registries.encoder_registry import ENCODER_NAMES, ENCODERS


# ---------------------------------------------------------------------- model
class EncoderConfig(Strict):
    name: Literal[ENCODER_NAMES] = Field(  # type: ignore[valid-type]
        "hibou-b", description="an entry of the encoder registry (fedhisto.registries.encoder_registry; docs/encoders.md)")
    repo_id: str = Field("histai/hibou-b", description="hub repository; defaults to the entry's (unused by tiny)")
    revision: str | None = Field(
        "7fdc8cce365ebfd9e7e60e6e9a8d4d59388f3c",
        description="hub commit; defaults to the entry's pin (entries without a verified pin need one set here)")
    local_dir: str | None = Field(None, description="load from this folder instead of the hub")
    require_pretrained: bool = True

    @model_validator(mode="before")
    @classmethod
    def _hub_defaults_from_entry(cls, data: Any) -> Any:
        """An entry with a hub repository supplies repo_id and revision unless they are set; the tiny
        encoder has none and keeps the historical defaults, so existing run identities stand."""
        if isinstance(data, dict) and data.get("name") in ENCODERS:
            entry = ENCODERS[data["name"]]
            if entry.hub_id is not None:
                data = {"repo_id": entry.hub_id, "revision": entry.revision, **data}
        return data


class PretrainConfig(Strict):
    """Pipeline pretraining of the tiny encoder (HIBOU-B arrives pretrained and is never retrained)."""

    enabled: bool = Field(False, description="pretrain the tiny encoder on a disjoint synthetic pool")
    images_per_class: int = Field(200, ge=10)
    epochs: int = Field(8, ge=1)
    lr: float = Field(1e-3, gt=0)
    batch: int = Field(32, ge=1)
    seed: int = Field(777, description="pool seed; the pool never overlaps the cohort (different seed stream)")
    stain_views: bool = Field(
        True, json_schema_extra=IF_CHANGED, description="True: pretrain through stain-perturbed views (the pipeline's stain-invariant encoder); "
                          "False: geometry-only views (the 'plain' encoder of the stain-shift dose-response experiment)")
    objective: Literal["synthetic_supervised", "self_supervised"] = Field(
        "synthetic_supervised", json_schema_extra=IF_CHANGED,
        description="[ours] synthetic_supervised: classes of the disjoint synthetic pool; self_supervised: SimCLR on "
                    "two views of each of the clients' optimisation images (manifest split column; never "
                    "validation, test, holdout or external), for real cohorts")
    temperature: float = Field(0.2, gt=0, json_schema_extra=IF_CHANGED,
                               description="[ours] self_supervised only: NT-Xent temperature")
    projection_dim: int = Field(64, ge=2, json_schema_extra=IF_CHANGED,
                                description="[ours] self_supervised only: projection head output")


class ModelConfig(Strict):
    encoder: EncoderConfig = EncoderConfig()
    pretrain: PretrainConfig = PretrainConfig()
    lora_r: int = Field(8, ge=1)
    lora_alpha: float = Field(16, gt=0)
    lora_dropout: float = Field(0.05, ge=0, lt=1)
    lora_targets: list[Literal["query", "key", "value", "attention_output"]] = Field(
        default_factory=lambda: ["query", "key", "value", "attention_output"])
    adapter_hidden: int = Field(256, ge=1)
    adapter_dropout: float = Field(0.10, ge=0, lt=1)
    film_hidden: int = Field(64, ge=1)
    film_scale: float = Field(0.10, ge=0)
    film_bound: Literal["unbounded", "tanh"] = Field(
        "unbounded", json_schema_extra=IF_CHANGED,
        description="[ours] FiLM 'scale fixed at 0.10, limiting the magnitude': unbounded, z (1 + s gamma) + s beta; "
                    "tanh: z (1 + s tanh gamma) + s tanh beta, so the modulation never exceeds s")
