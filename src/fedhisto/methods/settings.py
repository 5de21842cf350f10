"""Method settings blocks (``train.<key>``) as the registry declares them, without importing a method.

A method's settings class lives in the method's own file (``methods/past.py: PastConfig``), beside
the code that reads it, and its registration names it (``register(..., settings="module:Class")``).
Method files import torch; the Snakefile must not (``snakemake -n`` stays fast). So the package
carries the generated JSON schema of every registered settings class (``settings.schema.json``,
written by ``fedhisto schema --write``, checked by a test) and the configuration is validated
against models rebuilt from it: the same fields, types, bounds, defaults and descriptions, and the
same dump (so the same run identity). A job that builds the method validates its block once more
with the real class (``Method.settings``).
"""

from __future__ import annotations

import json
import warnings
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from fedhisto.config_base import ConfigError, Strict

SCHEMA_FILE = Path(__file__).with_name("settings.schema.json")
_BOUNDS = {"minimum": "ge", "maximum": "le", "exclusiveMinimum": "gt", "exclusiveMaximum": "lt",
           "minLength": "min_length", "maxLength": "max_length", "minItems": "min_length", "maxItems": "max_length"}
_SCALARS = {"number": float, "integer": int, "boolean": bool, "string": str}


def _type(prop: dict[str, Any]) -> Any:
    if "enum" in prop:
        return Literal[tuple(prop["enum"])]
    if "anyOf" in prop:
        kinds = [_type(p) for p in prop["anyOf"]]
        out = kinds[0]
        for k in kinds[1:]:
            out = out | k
        return out
    kind = prop.get("type")
    if kind == "null":
        return type(None)
    if kind in _SCALARS:
        return _SCALARS[kind]
    if kind == "array" and "prefixItems" in prop:
        return tuple[tuple(_type(p) for p in prop["prefixItems"])]
    if kind == "array":
        return list[_type(prop.get("items", {}))]
    raise ConfigError(f"method settings: field type {prop} is not supported (keep settings flat: numbers, "
                      "booleans, strings, literals, tuples and lists of them)")


def model_from_schema(schema: dict[str, Any]) -> type[Strict]:
    """A strict pydantic model with the fields of a (flat) pydantic JSON schema."""
    fields = {}
    for name, prop in schema.get("properties", {}).items():
        bounds = {_BOUNDS[k]: v for k, v in prop.items() if k in _BOUNDS}
        extra = {k: v for k, v in prop.items() if k.startswith("x-")}
        fields[name] = (_type(prop), Field(prop["default"], description=prop.get("description"),
                                           json_schema_extra=extra or None, **bounds))
    model = create_model(schema["title"], __base__=Strict, **fields)
    model.__doc__ = schema.get("description")
    return model


def settings_schemas(classes: dict[str, type]) -> dict[str, Any]:
    """``{key: JSON schema}`` of the real settings classes (what ``fedhisto schema --write`` stores)."""
    return {key: cls.model_json_schema() for key, cls in sorted(classes.items())}


def settings_schema_text(classes: dict[str, type]) -> str:
    return json.dumps(settings_schemas(classes), indent=2) + "\n"  # field order kept: the dump order of the blocks


@cache
def _stored() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text()) if SCHEMA_FILE.exists() else {}


class _Unvalidated(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


def block_models(declared: dict[str, Any]) -> dict[str, type[Strict]]:
    """The model of every registered settings block: a class given to ``register`` as is; an import
    path through the stored schema (no import of the method)."""
    out = {}
    for key, target in declared.items():
        if not isinstance(target, str):
            out[key] = target
            continue
        stored = _stored().get(key)
        if stored is None:  # registered since the schema was written; the method cannot be imported from here
            warnings.warn(f"settings of train.{key} ({target}) are not in {SCHEMA_FILE}: train.{key} is not "
                          "validated until you run `fedhisto schema --write workflow/schemas/config.schema.json`",
                          stacklevel=2)
            out[key] = create_model(f"Unvalidated_{key}", __base__=_Unvalidated)
            continue
        out[key] = model_from_schema(stored)
    return out
