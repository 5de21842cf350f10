"""The method registry, in the spirit of peft's ``register_peft_method``: a name, the class that
implements the method's hooks, and the options that the class is built with.

The registry never imports torch: a class may be given as ``"module:Class"`` and is imported only
when a run builds the method, so parsing the Snakefile (which validates method names, builds
wildcard constraints and run identities) stays fast.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Any

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def _resolve(target: Any) -> Any:
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)
    return target


@dataclass(frozen=True)
class Registration:
    name: str
    target: Any                      # a Method subclass or "package.module:Class"
    config_key: str | None = None    # train.<config_key>: the method family's settings (run identity)
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the class
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
    """Add a method. ``target``: a :class:`fedhisto.methods.base.Method` subclass or its import path;
    ``config_key``: the ``train.<key>`` block of the method's settings (it enters the run identity of
    this method only); ``settings``: the pydantic class of that block (or its import path, kept in the
    package's generated ``settings.schema.json`` so the config never imports the method); ``options``:
    keyword arguments the class is constructed with (e.g. a family's switches); ``comparison``: the name
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
