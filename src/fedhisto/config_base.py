"""The strict base of every configuration block, and the error a person who wrote the YAML reads."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who wrote the YAML."""
