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


@dataclass(frozen=True)
class Registration:
    name: str
    target: Any                      # a Method subclass or "package.module:Class"
    config_key: str | None = None    # train.<config_key>: the method family's settings (run identity)
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the class

    def method_class(self) -> type:
        if isinstance(self.target, str):
            module, _, attr = self.target.partition(":")
            return getattr(importlib.import_module(module), attr)
        return self.target

    def attribute(self, name: str, default: Any = None) -> Any:
        """A class-level setting as this registration builds it (its options win over the class's)."""
        return self.options.get(name, getattr(self.method_class(), name, default))


_REGISTRY: dict[str, Registration] = {}


def register(name: str, target: Any, config_key: str | None = None, *, replace: bool = False,
             **options: Any) -> Registration:
    """Add a method. ``target``: a :class:`fedhisto.methods.base.Method` subclass or its import path;
    ``config_key``: the ``train.<key>`` block whose settings enter the run identity; ``options``:
    keyword arguments the class is constructed with (e.g. a family's switches)."""
    if not _NAME.match(name):
        raise ValueError(f"method name {name!r} must be lower-case letters, digits and underscores")
    if name in _REGISTRY and not replace:
        raise ValueError(f"method {name!r} is registered already ({_REGISTRY[name].target}); pass replace=True")
    reg = Registration(name, target, config_key, dict(options))
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


def wildcard_pattern() -> str:
    """Snakemake ``wildcard_constraints`` for ``{method}``: exactly the registered names."""
    return "|".join(sorted(map(re.escape, _REGISTRY), key=len, reverse=True))
