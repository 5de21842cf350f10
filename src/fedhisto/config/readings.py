"""Readings of the choices the study leaves open (issue 23, the sensitivity experiment).

Each field names one choice and its readings; the default is the reading the pipeline has always
used, and every field is ``IF_CHANGED``, so a default run's identity and predictions are as before.
The ``sensitivity`` experiment retrains under each other reading and asks which headline
conclusions keep their sign and interval (docs/experiments.md). ``train.readings`` holds the
training-side ones; FiLM's bound is a model choice (``model.film_bound``) and the input
normalisation is ``views.normalisation``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedhisto.infra.settings_base import IF_CHANGED, Strict


class ReadingsConfig(Strict):
    """[ours] Readings of the study's unstated training choices; the defaults are the pipeline's own."""

    ce_weight_normalisation: Literal["sample_mean", "class_mean"] = Field(
        "sample_mean", json_schema_extra=IF_CHANGED,
        description="class-balanced CE weights 'normalised over the client's available classes': sample_mean "
                    "(the client's mean per-sample weight is 1, so the 4.0 cap can bind) or class_mean (the mean "
                    "over its present classes is 1, Cui et al.'s convention)")
    ce_reduction: Literal["nominal_batch", "weighted_mean"] = Field(
        "nominal_batch", json_schema_extra=IF_CHANGED,
        description="nominal_batch: sum_i w_{y_i} CE_i / B (B the nominal micro-batch); weighted_mean: "
                    "PyTorch's F.cross_entropy(weight=w), which divides by the batch's summed weights")
    ce_views: Literal["mean", "sum"] = Field(
        "mean", json_schema_extra=IF_CHANGED,
        description="CE over v2's two stain views averaged, or summed (twice the CE gradient); single-view "
                    "methods are unaffected")
    adaptive_on: Literal["factors", "delta_w"] = Field(
        "factors", json_schema_extra=IF_CHANGED,
        description="adaptive client weights (eq. 4) computed on the raw LoRA factor deltas (A and B), or on the "
                    "induced dW = s (B A - B0 A0), which does not depend on delta-SVD's factor split")
    optimizer_state: Literal["per_round", "kept"] = Field(
        "per_round", json_schema_extra=IF_CHANGED,
        description="each client's AdamW created afresh at every round's local training (per_round), or its "
                    "moments and step count kept by the client from its previous local training to the next "
                    "(kept: never sent to the server; fedhisto.train.optimizer_state). In-process engines "
                    "(sequential, batched, DP-SGD) only: a Flower site keeps no state between messages")
