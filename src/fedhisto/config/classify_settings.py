"""The ``classify:`` config block: image folders the workflow classifies with an exported package.

Torch-free (the config module imports it at Snakefile parse time). No stage identity contains this
block (``stage_config``), so listing a folder plans only the export and classify jobs, never training.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from fedhisto.infra.settings_base import Strict

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ClassifyConfig(Strict):
    method: str = Field("past_v2", description="the method whose finalised seeds are exported and used")
    descriptor: Literal["centroid", "site"] = Field(
        "centroid", description="FiLM's stain descriptor: the training centroid (the study's choice for unseen "
                                "data) or each folder's own (falls back to the centroid on too little tissue)")
    calibrate: bool = Field(True, description="temperature-scale with the package's temperature")
    uncertain_below: float = Field(0.6, gt=0, le=1, description="flag images whose top probability is below")
    false_flag_rate: float = Field(
        0.05, gt=0, lt=1, description="domain check: share of in-domain images allowed to be flagged out of domain "
                                      "(threshold calibrated on the training sites' holdouts)")
    folders: dict[str, str] = Field(
        default_factory=dict, description="name -> image folder; results/classify/{name}/predictions.csv each")

    @field_validator("folders")
    @classmethod
    def _names(cls, folders: dict[str, str]) -> dict[str, str]:
        bad = [n for n in folders if not _NAME.match(n)]
        if bad:
            raise ValueError(f"classify.folders name {bad[0]!r}: letters, digits, '_', '-', '.' only "
                             "(it names results/classify/<name>/)")
        return folders
