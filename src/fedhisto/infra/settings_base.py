"""The strict base of every configuration block, and the error a person who wrote the YAML reads."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict

#: ``Field(..., json_schema_extra=IF_CHANGED)``: the field enters a stage's identity (``stage_config``)
#: only when set away from its default, so adding an option never changes existing run identities.
IF_CHANGED: dict[str, Any] = {"x-identity": "if-changed"}


def unless(baseline: Any) -> dict[str, Any]:
    """``Field(..., json_schema_extra=unless(v))``: the field enters a stage's identity unless it equals
    ``v``, the value every identity was written under before the field existed. For a default that
    moved (``train.engine``: sequential, then batched): old identities stay valid for the old value,
    and runs under the new default get identities of their own (their results differ)."""
    return {"x-identity": "unless", "x-identity-baseline": baseline}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who wrote the YAML."""


def _distinct_seeds(seeds: list[int]) -> list[int]:
    negative = [s for s in seeds if s < 0]
    if negative:
        raise ValueError(f"seeds are non-negative integers (got {negative})")
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise ValueError(f"seeds must be distinct ({repeated} listed more than once)")
    return seeds


#: A list of run seeds: distinct non-negative integers.
Seeds = Annotated[list[int], AfterValidator(_distinct_seeds)]


def identity_dump(model: BaseModel) -> dict[str, Any]:
    """``model_dump(mode="json")`` without the ``IF_CHANGED`` fields that hold their default and the
    ``unless(v)`` fields that hold ``v``."""
    dump = model.model_dump(mode="json")
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        rule = extra.get("x-identity")
        if (rule == "if-changed" and value == info.get_default(call_default_factory=True)) or (
                rule == "unless" and dump[name] == extra["x-identity-baseline"]):
            dump.pop(name)
        elif isinstance(value, BaseModel):
            dump[name] = identity_dump(value)
    return dump
