"""Federated methods: a server-side strategy and its client-side objective, registered together (see
``methods.base`` for how the halves fit, ``methods.strategy`` and ``methods.objective`` for the hooks).

The registry and the built-in registrations live in ``fedhisto.registries.method_registry`` (torch-free, below the
configuration); this package holds the methods themselves and builds them.
"""

from __future__ import annotations

import inspect
from typing import Any

from fedhisto.registries.method_registry import (
    Registration,
    default_comparisons,
    method_names,
    register,
    registration,
    settings_blocks,
    unregister,
    wildcard_pattern,
)

__all__ = ["Registration", "build_method", "default_comparisons", "method_names", "register", "registration",
           "settings_blocks", "unregister", "wildcard_pattern"]


def _keywords(cls: type) -> set[str]:
    """The options a half's constructor takes by name (beyond name, cfg and config_key)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)} - {
        "self", "name", "cfg", "config_key"}


def build_method(name: str, cfg: Any) -> Any:
    """The method of a run for a ``config.Config``: its registered strategy class (``methods.strategy.Strategy``)
    and, as its ``objective``, the client half that class names (``objective_class``), each built with the
    registered options its constructor names (an option neither names is refused). Untyped here so that
    this package imports neither (config validates method names against this registry)."""
    reg = registration(name)
    strategy_class = reg.method_class()
    objective_class = strategy_class.objective_class
    server, client = _keywords(strategy_class), _keywords(objective_class)
    unknown = sorted(set(reg.options) - server - client)
    if unknown:
        raise TypeError(f"method {name!r}: unexpected options {unknown} (neither {strategy_class.__qualname__} nor "
                        f"{objective_class.__qualname__} takes them)")
    objective = objective_class(name, cfg, reg.config_key, **{k: v for k, v in reg.options.items() if k in client})
    strategy = strategy_class(name, cfg, reg.config_key, **{k: v for k, v in reg.options.items() if k in server})
    strategy.objective = objective
    return strategy
