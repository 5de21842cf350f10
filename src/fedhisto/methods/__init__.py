"""Federated methods as registered strategies (see ``base.Method`` for the hooks).

The registry and the built-in registrations live in ``fedhisto.registries.method_registry`` (torch-free, below the
configuration); this package holds the methods themselves and builds them.
"""

from __future__ import annotations

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


def build_method(name: str, cfg: Any) -> Any:
    """The method object of a run (a ``methods.base.Method``) for a ``config.Config``: its registered class
    with its registered options. Untyped here so that this package imports neither (config validates
    method names against this registry)."""
    reg = registration(name)
    return reg.method_class()(name, cfg, reg.config_key, **reg.options)
