"""The strict base of every configuration block, and the error a person who wrote the YAML reads."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who wrote the YAML."""


def _registered_method(name: str) -> str:
    from fedhisto.methods import method_names

    if name not in method_names():
        raise ValueError(f"unknown method {name!r}; registered: {', '.join(method_names())}")
    return name


Method = Annotated[str, AfterValidator(_registered_method)]
