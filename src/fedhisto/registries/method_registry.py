"""The method registry, in the spirit of peft's ``register_peft_method``: a name, the method's strategy
class (the server half, which names its client objective: both are built from one registration), the
options they are built with, its settings block and its default comparison; and the built-in
registrations (one line per method, below).

Nothing here imports torch or a method: a class is given as ``"module:Class"`` and imported only
when a run builds the method, and a settings block is validated against the package's stored JSON
schema of its class (``method_settings.schema.json``, written by ``fedhisto schema --write``), so
parsing the Snakefile (method names, wildcard constraints, config validation, run identities) stays
fast. A job that builds the method validates its block once more with the real class
(``settings`` of either half).
"""

from __future__ import annotations

import importlib
import json
import re
import warnings
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model

from fedhisto.infra.settings_base import ConfigError, Strict

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def _resolve(target: Any) -> Any:
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)
    return target


@dataclass(frozen=True)
class Registration:
    name: str
    target: Any                      # a Strategy subclass (naming its Objective) or "package.module:Class"
    config_key: str | None = None    # train.<config_key>: the method family's settings (run identity)
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the strategy and objective
    settings: Any = None             # the settings class of train.<config_key> (or its import path)
    comparison: str | None = None    # a bootstrap comparison past_v2 vs this method, e.g. "v2_vs_fedstain"

    def method_class(self) -> type:
        return _resolve(self.target)

    def settings_class(self) -> type | None:
        return _resolve(self.settings) if self.settings is not None else None

    def attribute(self, name: str, default: Any = None) -> Any:
        """A class-level setting as this registration builds it (its options win over the class's)."""
        return self.options.get(name, getattr(self.method_class(), name, default))


_REGISTRY: dict[str, Registration] = {}


def register(name: str, target: Any, config_key: str | None = None, *, settings: Any = None,
             comparison: str | None = None, replace: bool = False, **options: Any) -> Registration:
    """Add a method. ``target``: a :class:`fedhisto.methods.strategy.Strategy` subclass (its ``objective_class``
    is the client half) or its import path;
    ``config_key``: the ``train.<key>`` block of the method's settings (it enters the run identity of
    this method only); ``settings``: the pydantic class of that block (or its import path, kept in the
    package's generated ``method_settings.schema.json`` so the config never imports the method); ``options``:
    keyword arguments each half is constructed with, where its constructor names them (e.g. a family's switches); ``comparison``: the name
    of a default bootstrap comparison of past_v2 against this method (Tables 5-6)."""
    if not _NAME.match(name):
        raise ValueError(f"method name {name!r} must be lower-case letters, digits and underscores")
    if name in _REGISTRY and not replace:
        raise ValueError(f"method {name!r} is registered already ({_REGISTRY[name].target}); pass replace=True")
    if (settings is None) != (config_key is None):
        raise ValueError(f"method {name!r}: config_key and settings go together (train.<config_key> is the block "
                         "the settings class validates)")
    other = next((r for r in _REGISTRY.values() if r.config_key == config_key and r.name != name), None)
    if config_key is not None and other is not None and other.settings != settings:
        raise ValueError(f"method {name!r}: train.{config_key} is {other.name!r}'s block with settings "
                         f"{other.settings}, not {settings}")
    reg = Registration(name, target, config_key, dict(options), settings, comparison)
    _REGISTRY[name] = reg
    return reg


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def registration(name: str) -> Registration:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; registered: {', '.join(_REGISTRY)}") from None


def method_names() -> list[str]:
    return list(_REGISTRY)


def default_comparisons() -> dict[str, str]:
    """``{comparison name: reference method}`` declared by registrations (past_v2 against each)."""
    return {r.comparison: r.name for r in _REGISTRY.values() if r.comparison}


def settings_blocks() -> dict[str, Any]:
    """``{config_key: settings class or import path}`` of every registered method family."""
    return {r.config_key: r.settings for r in _REGISTRY.values() if r.config_key is not None}


def wildcard_pattern() -> str:
    """Snakemake ``wildcard_constraints`` for ``{method}``: exactly the registered names."""
    return "|".join(sorted(map(re.escape, _REGISTRY), key=len, reverse=True))


def _registered_method(name: str) -> str:
    if name not in method_names():
        raise ValueError(f"unknown method {name!r}; registered: {', '.join(method_names())}")
    return name


Method = Annotated[str, AfterValidator(_registered_method)]


# ------------------------------------------------------------------ settings blocks

SCHEMA_FILE = Path(__file__).with_name("method_settings.schema.json")
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


# ------------------------------------------------------------------ built-in methods
_PAST = "fedhisto.methods.past:PastFamily"
_PAST_SETTINGS = {"config_key": "past", "settings": "fedhisto.methods.past:PastConfig"}
# The study's Table 3, one keyword-named switch row per method.
register("fedavg_peft", _PAST, **_PAST_SETTINGS)
register("fedprox_peft", _PAST, **_PAST_SETTINGS, proximal=True)
register("film_zero", _PAST, **_PAST_SETTINGS, film=True, zero_descriptor=True)
register("past_v1", _PAST, **_PAST_SETTINGS, film=True, prototypes="v1", aggregation="adaptive")
register("past_v2", _PAST, **_PAST_SETTINGS, film=True, prototypes="v2", paired_views=True, js=True, feat=True,
         aggregation="adaptive")
register("v2_no_js", _PAST, **_PAST_SETTINGS, film=True, prototypes="v2", paired_views=True, js=False, feat=True,
         aggregation="adaptive")
register("v2_no_feat", _PAST, **_PAST_SETTINGS, film=True, prototypes="v2", paired_views=True, js=True, feat=False,
         aggregation="adaptive")
register("v2_no_proto", _PAST, **_PAST_SETTINGS, film=True, prototypes="none", paired_views=True, js=True,
         feat=True, aggregation="adaptive")
# The FedStain comparator (not in the study) on the same PEFT architecture as fedavg_peft, as its
# paper's Algorithm 1 prints it.
register("fedstain", "fedhisto.methods.fedstain:FedStain", "fedstain", settings="fedhisto.methods.fedstain:FedStainConfig",
         comparison="v2_vs_fedstain")
# FedStain as its authors' public code runs it (pixel-level statistics and shift, three views).
register("fedstain_code", "fedhisto.methods.fedstain_code:FedStainCode", "fedstain_code",
         settings="fedhisto.methods.fedstain_code:FedStainCodeConfig", comparison="v2_vs_fedstain_code")
# References every federated method is measured against (FLamby reports both).
register("local_only", "fedhisto.methods.local_only:LocalOnly", comparison="v2_vs_local")  # does federation help?
register("pooled", "fedhisto.methods.pooled:Pooled", comparison="v2_vs_pooled")  # the centralised reference
# SCAFFOLD (Karimireddy et al. 2020, Algorithm 1, option II) on fedavg_peft's model, as its paper runs it (plain
# SGD local steps, uniform weights): control variates correct client drift.
register("scaffold", "fedhisto.methods.scaffold:Scaffold", "scaffold", settings="fedhisto.methods.scaffold:ScaffoldConfig",
         comparison="v2_vs_scaffold")
# The same variates after the study's AdamW local steps: a reading, not SCAFFOLD (marked in the report).
register("scaffold_adamw", "fedhisto.methods.scaffold:Scaffold", "scaffold",
         settings="fedhisto.methods.scaffold:ScaffoldConfig", local_optimizer="adamw")
# FedAdam (Reddi et al. 2021; FedYogi/FedAdagrad via train.fedadam.variant): a server optimiser on the pseudo-gradient.
register("fedadam", "fedhisto.methods.fedadam:FedAdam", "fedadam", settings="fedhisto.methods.fedadam:FedAdamConfig",
         comparison="v2_vs_fedadam")
# Stain-augmented single-view arms (issue 23, not in the study; comparators): fedavg_peft and past_v1 with
# v2's OD / brightness / contrast perturbation on their one view, so "v2 beats FedAvg-PEFT under stain
# shift" can be told apart from "v2 saw stain augmentation".
register("fedavg_peft_stain", _PAST, **_PAST_SETTINGS, stain_views=True, comparison="v2_vs_fedavg_stain")
register("v1_stain", _PAST, **_PAST_SETTINGS, film=True, prototypes="v1", aggregation="adaptive", stain_views=True,
         comparison="v2_vs_v1_stain")
# The federated-LoRA aggregators (not in the study; comparators of its delta-SVD) on fedavg_peft's model and
# objective, one registration each (fedhisto.methods.lora_aggregated; the math: fedmath.lora_aggregators).
_LORA = "fedhisto.methods.lora_aggregated:LoraAggregated"
_LORA_SETTINGS = {"config_key": "lora_aggregation", "settings": "fedhisto.methods.lora_aggregated:LoraAggregationConfig"}
register("factor_mean", _LORA, **_LORA_SETTINGS, aggregator_name="factor_mean", comparison="v2_vs_factor_mean")
register("flexlora", _LORA, **_LORA_SETTINGS, aggregator_name="flexlora", comparison="v2_vs_flexlora")
# FedEx-LoRA folds the factor mean's residual into the frozen weights (dense folded_base.* tensors in the state).
register("fedex_lora", _LORA, **_LORA_SETTINGS, aggregator_name="fedex_lora", comparison="v2_vs_fedex_lora")
register("ffa_lora", _LORA, **_LORA_SETTINGS, aggregator_name="ffa_lora", comparison="v2_vs_ffa_lora")
register("fedsa_lora", _LORA, **_LORA_SETTINGS, aggregator_name="fedsa_lora", comparison="v2_vs_fedsa_lora")
